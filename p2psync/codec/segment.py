"""One segment: the changes (or raw words) of one element range of one tensor.

A segment decodes on its own given the base words of its tensor, which is what
makes every chunk independently decodable. Layout (little-endian)::

    u8 kind            1 = delta, 2 = raw words, 3 = dense delta (``dense``)
    u32 tensor         index into the manifest's tensor table
    u64 start, stop    element range [start, stop) covered
  delta:
    body               see ``sparse``: changes coded by magnitude bucket and rank,
                       residuals by the base value's exponent
  raw:
    u8 codec, u32 len  payload: the words as byte planes, raw or zstd
  dense delta (a delta's range where nearly every word changed):
    u8 coding, u32 len payload: the new words, or their XOR with the base, as byte planes

The body of a delta segment depends only on the base and new words of its range
relative to ``start``, so the same segment describes the same range of a shard
(the publisher rewrites ``start``/``stop`` for shards).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from p2psync.codec import rice
from p2psync.codec.wire import Reader
from p2psync.errors import CodecError, TruncatedError

KIND_DELTA = 1
KIND_RAW = 2
KIND_DENSE = 3
DELTA_KINDS = (KIND_DELTA, KIND_DENSE)
"""The segment kinds a delta holds."""
CODEC_RAW = 0
CODEC_ZSTD = 1
MAX_BUCKETS = 4
_HEAD = struct.Struct("<BIQQ")
BUCKET_TABLE = np.dtype([("count", "<u4"), ("k", "u1")])
"""A delta segment's per-bucket entry: changes in the bucket, Rice parameter of its rank gaps."""


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


def encode_header(kind: int, tensor: int, start: int, stop: int) -> bytes:
    return _HEAD.pack(kind, tensor, start, stop)


# --- residuals ---------------------------------------------------------------------------
def shift_segment(segment: bytes | bytearray, offset: int) -> bytes | bytearray:
    """The same segment for a range ``offset`` elements further into its tensor (a tensor
    encoded in pieces: each piece's segments are made at offset 0, then shifted)."""
    if offset == 0:
        return segment
    kind, tensor, start, stop = _HEAD.unpack_from(segment)
    return _HEAD.pack(kind, tensor, start + offset, stop + offset) + segment[_HEAD.size:]


def zigzag(delta_u: np.ndarray) -> np.ndarray:
    """Map a wrapping unsigned difference to small unsigned numbers (0, -1, 1, -2 ...)."""
    bits = delta_u.dtype.itemsize * 8
    s = delta_u.view(f"<i{delta_u.dtype.itemsize}")
    return ((s << 1) ^ (s >> (bits - 1))).view(delta_u.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (np.zeros_like(z) - (z & one))


def planes(words: np.ndarray, head: bytes = b"") -> bytearray:
    """The bytes of the 1-D ``words`` as byte planes: every word's byte 0, then every byte 1, ...

    One strided gather per plane straight into the result (no transposed intermediate, no
    ``tobytes`` copy of it): the bytes pass through memory once. ``head``: bytes placed before
    the planes in the same buffer (a raw segment's header, so joining them copies nothing).
    """
    w = words.dtype.itemsize
    n = words.size
    out = bytearray(len(head) + n * w)
    out[:len(head)] = head
    dst = np.frombuffer(out, dtype=np.uint8)[len(head):]
    src = np.ascontiguousarray(words).reshape(-1).view(np.uint8)
    if w == 1:
        dst[:] = src
        return out
    for k in range(w):
        dst[k * n:(k + 1) * n] = src[k::w]
    return out


def unplanes(buf: bytes | memoryview, n: int, word: np.dtype) -> np.ndarray:
    """Inverse of :func:`planes`: ``n`` words of dtype ``word`` (a new array), one strided
    scatter per plane."""
    w = word.itemsize
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.shape[0] != n * w:
        raise CodecError(f"segment: payload has {raw.shape[0]} bytes, expected {n * w}")
    out = np.empty(n, dtype=word)
    dst = out.view(np.uint8)
    if w == 1:
        dst[:] = raw
        return out
    for k in range(w):
        dst[k::w] = raw[k * n:(k + 1) * n]
    return out


_zstd = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level (zstandard objects are not thread-safe; making one
    costs ~25 us, a sizeable part of a small segment)."""
    cs = getattr(_zstd, "c", None)
    if cs is None:
        cs = _zstd.c = {}
    c = cs.get(level)
    if c is None:
        c = cs[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def pack_payload(data: bytes | bytearray | memoryview, level: int) -> tuple[int, bytes | bytearray | memoryview]:
    """zstd if it saves bytes, else raw (tiny segments and incompressible planes)."""
    if level > 0 and len(data) > 64:
        z = _compressor(level).compress(data)
        if len(z) < len(data):
            return CODEC_ZSTD, z
    return CODEC_RAW, data


def compress(data: bytes | bytearray | memoryview, level: int) -> bytes:
    """``data`` as one zstd frame (this thread's compressor for ``level``)."""
    return _compressor(level).compress(data)


def decompress(data: bytes | memoryview | np.ndarray, max_size: int) -> bytes:
    """A zstd frame (with this thread's decompressor); ``max_size`` bounds frames that do not
    state their size."""
    d = getattr(_zstd, "d", None)
    if d is None:
        d = _zstd.d = zstandard.ZstdDecompressor()
    try:
        return d.decompress(data.data if isinstance(data, np.ndarray) else data, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise CodecError(f"segment: payload does not decompress ({exc})") from None


def unpack_payload(codec: int, data: memoryview, size: int) -> bytes | memoryview:
    if codec == CODEC_RAW:
        return data
    if codec == CODEC_ZSTD:
        out = decompress(data, size)
        if len(out) != size:
            raise CodecError(f"segment: payload decompresses to {len(out)} bytes, expected {size}")
        return out
    raise CodecError(f"segment: unknown payload codec {codec}")


# --- whole segments ----------------------------------------------------------------------
def encode_raw_segment(tensor: int, start: int, words: np.ndarray, level: int
                       ) -> tuple[bytes | bytearray, SegmentStats]:
    size = words.size * words.dtype.itemsize
    if level <= 0 or size <= 64:  # stored raw (as pack_payload would): header and planes in one buffer
        head = _HEAD.pack(KIND_RAW, tensor, start, start + words.shape[0]) + struct.pack("<BI", CODEC_RAW, size)
        return planes(words, head), SegmentStats(header=len(head), raw=size)
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
    thresholds: np.ndarray | None = None
    """delta: bucket threshold exponents (``sparse``)."""
    counts: np.ndarray | None = None
    """delta: changes per bucket."""
    ks: np.ndarray | None = None
    """delta: Rice parameter per bucket."""
    unary: memoryview | None = None
    rem: memoryview | None = None
    res_codec: int = 0
    res: memoryview | None = None
    """delta: the residual section; raw: the payload."""
    stats: SegmentStats | None = None
    raw: memoryview | None = None
    """The whole segment."""
    body_at: int = 0
    """Offset in :attr:`raw` of what follows the common header."""


def span_of(buf: memoryview) -> int:
    """Elements the segment ``buf`` covers, from its header alone (0 where the header is short or
    the range empty or inverted: decoding the segment reports those)."""
    if len(buf) < _HEAD.size:
        return 0
    _, _, start, stop = _HEAD.unpack_from(buf)
    return max(0, stop - start)


def parse_head(buf: memoryview) -> ParsedSegment:
    """The common header of a segment (kind, tensor, range) and, in :attr:`ParsedSegment.raw`, the
    segment itself: what the one-call delta decoder (``segdecode``) starts from. Raw segments are
    parsed whole."""
    if len(buf) < _HEAD.size:
        raise TruncatedError(f"segment: truncated (needs {_HEAD.size} bytes, has {len(buf)})")
    kind, tensor, start, stop = _HEAD.unpack_from(buf)
    if kind not in (KIND_DELTA, KIND_DENSE):
        return parse_segment(buf)
    if stop < start:
        raise CodecError("segment: range ends before it starts")
    return ParsedSegment(kind, tensor, start, stop, raw=buf, body_at=_HEAD.size)


def parse_segment(buf: memoryview) -> ParsedSegment:
    """Split a segment into its fields (no decoding of streams; validates lengths and counts)."""
    r = Reader(buf, "segment")
    kind, tensor, start, stop = r.unpack("BIQQ")
    if stop < start:
        raise CodecError("segment: range ends before it starts")
    if kind == KIND_RAW:
        codec, length = r.unpack("BI")
        payload = r.take(length)
        r.done()
        return ParsedSegment(
            kind, tensor, start, stop, res_codec=codec, res=payload, stats=SegmentStats(header=r.pos - length, raw=length),
            raw=r.buf, body_at=_HEAD.size,
        )
    if kind == KIND_DENSE:
        coding, length = r.unpack("BI")
        payload = r.take(length)
        r.done()
        return ParsedSegment(
            kind, tensor, start, stop, res_codec=coding, res=payload,
            stats=SegmentStats(header=r.pos - length, raw=length), raw=r.buf, body_at=_HEAD.size,
        )
    if kind != KIND_DELTA:
        raise CodecError(f"segment: unknown kind {kind}")
    n, n_b = r.unpack("IB")
    if not 1 <= n_b <= MAX_BUCKETS:
        raise CodecError(f"segment: {n_b} buckets (1 to {MAX_BUCKETS} allowed)")
    thresholds = np.frombuffer(r.take(2 * (n_b - 1)), dtype="<u2").astype(np.int64)
    table = np.frombuffer(r.take(5 * n_b), dtype=BUCKET_TABLE)
    counts = table["count"].astype(np.int64)
    ks = table["k"].astype(np.int64)
    if int(counts.sum()) != n:
        raise CodecError("segment: bucket counts do not add up")
    if n > stop - start:
        raise CodecError("segment: more changes than elements")
    if int(ks.max()) > rice.MAX_K or bool(np.any(np.diff(thresholds) <= 0)) or (n_b > 1 and thresholds[0] < 1):
        raise CodecError("segment: bad bucket table")
    ulen, rlen = r.unpack("II")
    head = r.pos
    unary, rem = r.take(ulen), r.take(rlen)
    res = r.take(len(r.buf) - r.pos)
    return ParsedSegment(
        kind, tensor, start, stop, n, thresholds, counts, ks, unary, rem, 0, res,
        SegmentStats(header=head, positions=ulen + rlen, residuals=len(res), changed=n), r.buf, _HEAD.size,
    )
