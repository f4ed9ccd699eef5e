"""One segment: the changes (or raw words) of one element range of one tensor.

A segment decodes on its own given the base words of its tensor, which is what
makes every chunk independently decodable. Layout (little-endian)::

    u8 kind            1 = delta, 2 = raw words
    u32 tensor         index into the manifest's tensor table
    u64 start, stop    element range [start, stop) covered
  delta:
    u32 n              changed elements in the range
    u16 n_ctx          contexts with at least one change, then per context:
      u16 ctx, u32 count, u8 k          (k: Rice parameter of its rank gaps)
    u32 unary_len, u32 rem_len, u8 res_codec, u32 res_len
    unary bytes        Rice quotients, unary (q ones then a zero), all contexts in order
    rem bytes          Rice remainders, k bits each, MSB first
    res bytes          zigzag(new - old) as byte planes (plane 0 = low bytes), raw or zstd
  raw:
    u8 codec, u32 len  payload: the words as byte planes, raw or zstd

Positions are coded per context as gaps between ranks (see ``kernels``): inside
one exponent class changes are close to independent with one rate, so a
geometric (Rice) code per class costs close to the conditional entropy, which
is what beats coding positions as if every element were alike.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from p2psync.codec.wire import Reader
from p2psync.errors import CodecError

KIND_DELTA = 1
KIND_RAW = 2
CODEC_RAW = 0
CODEC_ZSTD = 1
_HEAD = struct.Struct("<BIQQ")
_MAX_RICE_K = 40


@dataclass
class SegmentStats:
    header: int = 0
    positions: int = 0
    residuals: int = 0
    raw: int = 0
    changed: int = 0

    def add(self, other: "SegmentStats") -> None:
        self.header += other.header
        self.positions += other.positions
        self.residuals += other.residuals
        self.raw += other.raw
        self.changed += other.changed


# --- Rice coding of rank gaps ------------------------------------------------------------
def _best_k(gaps: np.ndarray) -> int:
    n = gaps.shape[0]
    mean = float(gaps.mean()) if n else 0.0
    guess = max(0, int(np.log2(mean + 1.0)))
    best_k, best_cost = 0, None
    for k in range(max(0, guess - 2), min(_MAX_RICE_K, guess + 3) + 1):
        cost = n * (k + 1) + int((gaps >> np.uint64(k)).sum())
        if best_cost is None or cost < best_cost:
            best_k, best_cost = k, cost
    return best_k


def _unary_bits(q: np.ndarray) -> np.ndarray:
    ends = np.cumsum(q + np.uint64(1), dtype=np.uint64)
    total = int(ends[-1]) if q.shape[0] else 0
    bits = np.ones(total, dtype=np.uint8)
    if total:
        bits[(ends - np.uint64(1)).astype(np.int64)] = 0
    return bits


def _rem_bits(r: np.ndarray, k: int) -> np.ndarray:
    if k == 0 or r.shape[0] == 0:
        return np.zeros(0, dtype=np.uint8)
    shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
    return ((r[:, None] >> shifts) & np.uint64(1)).astype(np.uint8).ravel()


def encode_ranks(ctx: np.ndarray, rank: np.ndarray) -> tuple[bytes, bytes, bytes]:
    """(context table, unary stream, remainder stream) for changes given as (context, rank)."""
    if ctx.shape[0] == 0:
        return b"", b"", b""
    order = np.argsort(ctx, kind="stable")
    ctx_s = ctx[order]
    rank_s = rank[order].astype(np.uint64)
    bounds = np.flatnonzero(np.diff(ctx_s)) + 1
    starts = np.concatenate(([0], bounds)).astype(np.int64)
    ends = np.concatenate((bounds, [ctx_s.shape[0]])).astype(np.int64)
    table = bytearray()
    qs, rems = [], []
    for a, b in zip(starts, ends):
        r = rank_s[a:b]
        gaps = np.empty_like(r)
        gaps[0] = r[0]
        gaps[1:] = r[1:] - r[:-1] - np.uint64(1)
        k = _best_k(gaps)
        table += struct.pack("<HIB", int(ctx_s[a]), int(b - a), k)
        qs.append(gaps >> np.uint64(k))
        rems.append(_rem_bits(gaps & np.uint64((1 << k) - 1), k))
    unary = np.packbits(_unary_bits(np.concatenate(qs))).tobytes()
    rem = np.packbits(np.concatenate(rems)).tobytes() if rems else b""
    return bytes(table), unary, rem


def decode_ranks(
    table: list[tuple[int, int, int]], unary: memoryview, rem: memoryview, n: int, span: int
) -> np.ndarray:
    """Inverse of :func:`encode_ranks`: the ranks, grouped by context in table order.

    ``span`` is the segment's element count: no context can hold a rank at or beyond it."""
    ubits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    zeros = np.flatnonzero(ubits == 0)
    if zeros.shape[0] < n:
        raise CodecError("segment: unary stream too short")
    zeros = zeros[:n]
    used = (int(zeros[-1]) + 8) // 8 if n else 0
    if used != len(unary):
        raise CodecError("segment: unary stream has trailing bytes")
    q = np.diff(zeros, prepend=-1).astype(np.uint64) - np.uint64(1)
    rbits = np.unpackbits(np.frombuffer(rem, dtype=np.uint8))
    need = sum(cnt * k for _, cnt, k in table)
    if (need + 7) // 8 != len(rem):
        raise CodecError("segment: remainder stream length does not match its table")
    ranks = np.empty(n, dtype=np.int64)
    off_n = 0
    off_b = 0
    for _, cnt, k in table:
        qq = q[off_n : off_n + cnt]
        if k:
            bits = rbits[off_b : off_b + cnt * k].reshape(cnt, k).astype(np.uint64)
            weights = np.uint64(1) << np.arange(k - 1, -1, -1, dtype=np.uint64)
            rr = (bits * weights).sum(axis=1, dtype=np.uint64)
            gaps = (qq << np.uint64(k)) | rr
        else:
            gaps = qq
        # Ranks of one context are strictly increasing and below span: bound before summing.
        if gaps.shape[0] and (int(gaps.max()) >= span or float(gaps.sum(dtype=np.float64)) + cnt > span):
            raise CodecError("segment: rank gaps exceed the segment")
        ranks[off_n : off_n + cnt] = np.cumsum(gaps.astype(np.int64) + 1) - 1
        off_n += cnt
        off_b += cnt * k
    return ranks


# --- residuals ---------------------------------------------------------------------------
def zigzag(delta_u: np.ndarray) -> np.ndarray:
    """Map a wrapping unsigned difference to small unsigned numbers (0, -1, 1, -2 ...)."""
    bits = delta_u.dtype.itemsize * 8
    s = delta_u.view(f"<i{delta_u.dtype.itemsize}")
    return ((s << 1) ^ (s >> (bits - 1))).view(delta_u.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (np.zeros_like(z) - (z & one))


def planes(words: np.ndarray) -> bytes:
    w = words.dtype.itemsize
    if w == 1:
        return words.tobytes()
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, w).T).tobytes()


def unplanes(buf: bytes | memoryview, n: int, word: np.dtype) -> np.ndarray:
    w = word.itemsize
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.shape[0] != n * w:
        raise CodecError(f"segment: payload has {raw.shape[0]} bytes, expected {n * w}")
    if w == 1:
        return raw.view(word).copy()
    return np.ascontiguousarray(raw.reshape(w, n).T).view(word).reshape(n)


def pack_payload(data: bytes, level: int) -> tuple[int, bytes]:
    """zstd if it saves bytes, else raw (tiny segments and incompressible planes)."""
    if level > 0 and len(data) > 64:
        z = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)
        if len(z) < len(data):
            return CODEC_ZSTD, z
    return CODEC_RAW, data


def unpack_payload(codec: int, data: memoryview, size: int) -> bytes | memoryview:
    if codec == CODEC_RAW:
        return data
    if codec == CODEC_ZSTD:
        try:
            out = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CodecError(f"segment: payload does not decompress ({exc})") from None
        if len(out) != size:
            raise CodecError(f"segment: payload decompresses to {len(out)} bytes, expected {size}")
        return out
    raise CodecError(f"segment: unknown payload codec {codec}")


# --- whole segments ----------------------------------------------------------------------
def encode_delta_segment(
    tensor: int, start: int, stop: int, ctx: np.ndarray, rank: np.ndarray, zres: np.ndarray, level: int
) -> tuple[bytes, SegmentStats]:
    """``zres`` are the zigzagged residuals in position order."""
    n = int(rank.shape[0])
    table, unary, rem = encode_ranks(ctx, rank)
    res_codec, res = pack_payload(planes(zres), level)
    head = _HEAD.pack(KIND_DELTA, tensor, start, stop) + struct.pack("<IH", n, len(table) // 7)
    head += table + struct.pack("<IIBI", len(unary), len(rem), res_codec, len(res))
    stats = SegmentStats(header=len(head), positions=len(unary) + len(rem), residuals=len(res), changed=n)
    return b"".join((head, unary, rem, res)), stats


def encode_raw_segment(tensor: int, start: int, words: np.ndarray, level: int) -> tuple[bytes, SegmentStats]:
    codec, payload = pack_payload(planes(words), level)
    head = _HEAD.pack(KIND_RAW, tensor, start, start + words.shape[0]) + struct.pack("<BI", codec, len(payload))
    return head + payload, SegmentStats(header=len(head), raw=len(payload))


@dataclass
class ParsedSegment:
    kind: int
    tensor: int
    start: int
    stop: int
    n: int = 0
    table: list[tuple[int, int, int]] | None = None
    unary: memoryview | None = None
    rem: memoryview | None = None
    res_codec: int = 0
    res: memoryview | None = None
    stats: SegmentStats | None = None


def parse_segment(buf: memoryview) -> ParsedSegment:
    """Split a segment into its fields (no decoding of streams; validates lengths)."""
    r = Reader(buf, "segment")
    kind, tensor, start, stop = r.unpack("BIQQ")
    if stop < start:
        raise CodecError("segment: range ends before it starts")
    if kind == KIND_RAW:
        codec, length = r.unpack("BI")
        payload = r.take(length)
        r.done()
        return ParsedSegment(
            kind, tensor, start, stop, res_codec=codec, res=payload, stats=SegmentStats(header=r.pos - length, raw=length)
        )
    if kind != KIND_DELTA:
        raise CodecError(f"segment: unknown kind {kind}")
    n, n_ctx = r.unpack("IH")
    table = [r.unpack("HIB") for _ in range(n_ctx)]
    if sum(c for _, c, _ in table) != n:
        raise CodecError("segment: context counts do not add up")
    if n > stop - start:
        raise CodecError("segment: more changes than elements")
    if any(k > _MAX_RICE_K or cnt == 0 for _, cnt, k in table) or len({c for c, _, _ in table}) != n_ctx:
        raise CodecError("segment: bad context table")
    ulen, rlen, res_codec, reslen = r.unpack("IIBI")
    head = r.pos
    unary, rem, res = r.take(ulen), r.take(rlen), r.take(reslen)
    r.done()
    return ParsedSegment(
        kind, tensor, start, stop, n, table, unary, rem, res_codec, res,
        SegmentStats(header=head, positions=ulen + rlen, residuals=reslen, changed=n),
    )
