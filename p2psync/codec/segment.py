"""One segment: the changes (or raw words) of one element range of one tensor.

A segment decodes on its own given the base words of its tensor, which is what
makes every chunk independently decodable. Layout (little-endian)::

    u8 kind            1 = delta, 2 = raw words
    u32 tensor         index into the manifest's tensor table
    u64 start, stop    element range [start, stop) covered
  delta:
    u32 n              changed elements in the range
    u16 n_ctx          contexts with at least one change, then per context:
      u16 ctx, u32 count, u8 k, u8 model   (k: Rice parameter of its rank gaps;
                                            model: residual frequency table it uses)
    u32 unary_len, u32 rem_len
    unary bytes        Rice quotients, unary (q ones then a zero), all contexts in order
    rem bytes          Rice remainders, k bits each, MSB first
    residual tables    see ``rans``: u8 count, then per table a symbol mask and frequencies
    u32 len, bytes     rANS stream of min(zigzag(new - old), 31), in position order,
                       each coded with the table of its position's context
    u8 codec, u32 len  escapes: zigzag residuals >= 31, as byte planes, raw or zstd
  raw:
    u8 codec, u32 len  payload: the words as byte planes, raw or zstd

Positions are coded per context as gaps between ranks (see ``kernels``): inside
one exponent class changes are close to independent with one rate, so a
geometric (Rice) code per class costs close to the conditional entropy, which
is what beats coding positions as if every element were alike. Residuals use
the same context: how many ULPs a change moves depends on how the update
compares with the element's ULP, i.e. on its exponent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from p2psync.codec import kernels, rans
from p2psync.codec.wire import Reader
from p2psync.errors import CodecError

KIND_DELTA = 1
KIND_RAW = 2
CODEC_RAW = 0
CODEC_ZSTD = 1
_HEAD = struct.Struct("<BIQQ")
_MAX_RICE_K = 40
# Contexts are merged (neighbouring exponents first) until a residual table covers this many
# changes: a table costs up to ~70 bytes, so smaller groups would pay more than they save.
MIN_CHANGES_PER_MODEL = 4096


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


# --- Rice coding of rank gaps (bit loops in ``kernels``) ---------------------------------
def assign_models(ctx_ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Model index per context (contexts sorted ascending): runs of neighbours with enough changes."""
    model = np.zeros(ctx_ids.shape[0], dtype=np.int64)
    current, acc = 0, 0
    for i, c in enumerate(counts):
        if acc >= MIN_CHANGES_PER_MODEL and current < 254:
            current, acc = current + 1, 0
        model[i] = current
        acc += int(c)
    if acc < MIN_CHANGES_PER_MODEL and current > 0:  # fold a small tail into its neighbour
        model[model == current] = current - 1
    return model


def encode_ranks(ctx: np.ndarray, rank: np.ndarray) -> tuple[bytes, bytes, bytes, dict[int, int]]:
    """(context table, unary stream, remainder stream, context -> model) for (context, rank) pairs."""
    if ctx.shape[0] == 0:
        return b"", b"", b"", {}
    order = np.argsort(ctx, kind="stable")
    ctx_s = ctx[order]
    rank_s = rank[order].astype(np.int64)
    bounds = np.flatnonzero(np.diff(ctx_s)) + 1
    starts = np.concatenate(([0], bounds)).astype(np.int64)
    ends = np.concatenate((bounds, [ctx_s.shape[0]])).astype(np.int64)
    models = assign_models(ctx_s[starts], ends - starts)
    ks = np.empty(starts.shape[0], dtype=np.int64)
    ubits, rbits = kernels.rice_plan(rank_s, starts, ends, _MAX_RICE_K, ks)
    ubuf = np.zeros((ubits + 7) // 8, dtype=np.uint8)
    rbuf = np.zeros((rbits + 7) // 8, dtype=np.uint8)
    kernels.rice_write(rank_s, starts, ends, ks, ubuf, rbuf)
    table = np.zeros(starts.shape[0], dtype=[("ctx", "<u2"), ("count", "<u4"), ("k", "u1"), ("model", "u1")])
    table["ctx"] = ctx_s[starts]
    table["count"] = ends - starts
    table["k"] = ks
    table["model"] = models
    return table.tobytes(), ubuf.tobytes(), rbuf.tobytes(), {int(c): int(m) for c, m in zip(table["ctx"], models)}


def decode_ranks(
    table: list[tuple[int, int, int, int]], unary: memoryview, rem: memoryview, n: int, span: int
) -> np.ndarray:
    """Inverse of :func:`encode_ranks`: the ranks, grouped by context in table order.

    ``span`` is the segment's element count: no context can hold a rank at or beyond it."""
    counts = np.array([t[1] for t in table], dtype=np.int64)
    ks = np.array([t[2] for t in table], dtype=np.int64)
    ranks = np.empty(n, dtype=np.int64)
    status = kernels.rice_read(np.frombuffer(unary, dtype=np.uint8), np.frombuffer(rem, dtype=np.uint8), counts, ks,
                               span, ranks)
    if status != 0:
        raise CodecError(f"segment: position streams are malformed (code {status})")
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
def encode_residuals(ctx: np.ndarray, zres: np.ndarray, model_of_ctx: dict[int, int], level: int) -> bytes:
    """Residual section: tables, rANS stream, escapes (``zres`` in position order)."""
    lut = np.zeros(max(model_of_ctx) + 1, dtype=np.int64)
    for c, m in model_of_ctx.items():
        lut[c] = m
    model_of = lut[ctx.astype(np.int64)]
    big = zres >= rans.ESCAPE
    symbols = np.where(big, rans.ESCAPE, zres).astype(np.uint8)
    n_models = int(lut.max()) + 1
    hist = np.bincount(model_of * rans.ALPHABET + symbols, minlength=n_models * rans.ALPHABET)
    freqs = np.stack([rans.quantize(h) for h in hist.reshape(n_models, rans.ALPHABET)])
    stream = rans.encode(symbols, model_of, freqs)
    esc_codec, esc = pack_payload(planes(zres[big]), level)
    return b"".join((rans.encode_models(freqs), struct.pack("<I", len(stream)), stream,
                     struct.pack("<BI", esc_codec, len(esc)), esc))


def encode_delta_segment(
    tensor: int, start: int, stop: int, ctx: np.ndarray, rank: np.ndarray, zres: np.ndarray, level: int
) -> tuple[bytes, SegmentStats]:
    """``ctx``/``rank``/``zres`` per change in position order; ``zres`` zigzagged residuals."""
    n = int(rank.shape[0])
    table, unary, rem, model_of_ctx = encode_ranks(ctx, rank)
    res = encode_residuals(ctx, zres, model_of_ctx, level)
    head = _HEAD.pack(KIND_DELTA, tensor, start, stop) + struct.pack("<IH", n, len(table) // 8)
    head += table + struct.pack("<II", len(unary), len(rem))
    stats = SegmentStats(header=len(head), positions=len(unary) + len(rem), residuals=len(res), changed=n)
    return b"".join((head, unary, rem, res)), stats


def decode_residuals(res: memoryview, ctx: np.ndarray, model_of_ctx: dict[int, int], word: np.dtype) -> np.ndarray:
    """Zigzagged residuals in position order, given each position's context."""
    r = Reader(res, "residuals")
    freqs = rans.read_models(r)
    if max(model_of_ctx.values(), default=0) >= freqs.shape[0]:
        raise CodecError("residuals: context names a missing table")
    stream = r.take(r.u32())
    esc_codec, esc_len = r.unpack("BI")
    esc = r.take(esc_len)
    r.done()
    lut = np.zeros(max(model_of_ctx, default=0) + 1, dtype=np.int64)
    for c, m in model_of_ctx.items():
        lut[c] = m
    model_of = lut[ctx.astype(np.int64)]
    symbols = rans.decode(stream, model_of, freqs)
    z = symbols.astype(word)
    big = np.flatnonzero(symbols == rans.ESCAPE)
    if big.shape[0]:
        vals = unplanes(unpack_payload(esc_codec, esc, big.shape[0] * word.itemsize), big.shape[0], word)
        if int(vals.min()) < rans.ESCAPE:
            raise CodecError("residuals: escaped value is small enough to be a symbol")
        z[big] = vals
    elif esc_len or esc_codec not in (CODEC_RAW, CODEC_ZSTD):
        raise CodecError("residuals: escapes present but no escape symbol")
    return z


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
    table: list[tuple[int, int, int, int]] | None = None
    unary: memoryview | None = None
    rem: memoryview | None = None
    res_codec: int = 0
    res: memoryview | None = None
    """delta: the residual section; raw: the payload."""
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
    table = [r.unpack("HIBB") for _ in range(n_ctx)]
    if sum(t[1] for t in table) != n:
        raise CodecError("segment: context counts do not add up")
    if n > stop - start:
        raise CodecError("segment: more changes than elements")
    if any(t[2] > _MAX_RICE_K or t[1] == 0 for t in table) or len({t[0] for t in table}) != n_ctx:
        raise CodecError("segment: bad context table")
    ulen, rlen = r.unpack("II")
    head = r.pos
    unary, rem = r.take(ulen), r.take(rlen)
    res = r.take(len(r.buf) - r.pos)
    return ParsedSegment(
        kind, tensor, start, stop, n, table, unary, rem, 0, res,
        SegmentStats(header=head, positions=ulen + rlen, residuals=len(res), changed=n),
    )
