"""Dense delta segments: every word of a range, for changes too dense for the sparse coding.

The sparse coding (``sparse``, ``segencode``) pays for positions; when nearly every element
of a range changes (a LoRA adapter's step, a large learning rate) the positions cost more than
the words they save, and the segment grows past the raw words. A delta then codes that range
densely instead: the new words themselves, or their XOR with the base words, as byte planes
(the high plane of a bf16 XOR is mostly zero: sign and exponent rarely move), raw or zstd,
whichever is smallest. So a dense segment never holds more than the range's raw words plus its
header. Layout (little-endian), after the common header (``segment``, kind 3)::

    u8 coding          0 = new words raw, 1 = new words zstd, 2 = XOR with base zstd
    u32 len            payload bytes
    payload            byte planes of the words (or of the XOR), as ``coding`` says

The encoder makes a sparse segment first and swaps in the dense one only where the sparse one
came out larger than a quarter of the range's raw words (cheap to test, so sparse RL deltas pay no
extra work) and the dense one is smaller: a deterministic choice from the segment's own words,
so every encode path (whole states, changes found elsewhere, the step-by-step reference) writes
the same bytes. Decoding yields what a sparse segment yields: the changed positions (words equal
to the base are dropped), their new words and the fingerprint sums' change.
"""

from __future__ import annotations

import struct

import numpy as np

from p2psync.codec.segment import (
    CODEC_ZSTD,
    KIND_DENSE,
    KIND_RAW,
    SegmentStats,
    compress,
    encode_header,
    parse_segment,
    planes,
    unpack_payload,
    unplanes,
)
from p2psync.dtypes import DType
from p2psync.errors import CodecError
from p2psync.wordops import hash_change

CODING_RAW = 0
CODING_ZSTD = 1
CODING_XOR_ZSTD = 2
CODING_NAMES = {CODING_RAW: "dense-raw", CODING_ZSTD: "dense-zstd", CODING_XOR_ZSTD: "dense-xor-zstd"}
"""How ``p2psync delta inspect`` names each dense coding (the sparse one is ``sparse``)."""
_BODY = struct.Struct("<BI")
HEADER_BYTES = len(encode_header(KIND_DENSE, 0, 0, 0)) + _BODY.size
"""A dense segment's bytes besides its payload (common header, coding, length)."""


def encode(tensor: int, start: int, old: np.ndarray, new: np.ndarray, level: int) -> tuple[bytes, int]:
    """The dense segment of ``[start, start + len(new))`` (``old``, ``new``: the base and new
    words of that range) in its smallest coding, and that coding."""
    raw = planes(new)
    best_coding, best = CODING_RAW, memoryview(raw)
    if level > 0 and len(raw) > 64:
        z = compress(raw, level)
        if len(z) < len(best):
            best_coding, best = CODING_ZSTD, memoryview(z)
        x = compress(planes(np.bitwise_xor(old, new)), level)
        if len(x) < len(best):
            best_coding, best = CODING_XOR_ZSTD, memoryview(x)
    head = encode_header(KIND_DENSE, tensor, start, start + new.shape[0]) + _BODY.pack(best_coding, len(best))
    return b"".join((head, best)), best_coding


def smaller(encoded: tuple[bytes, SegmentStats, tuple[int, int]], tensor: int, start: int, stop: int,
            old: np.ndarray, new_words, width: int, level: int) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """``encoded`` (a sparse segment of ``[start, stop)``, its statistics and hash change), or the
    dense segment of the same range where that is smaller. ``old``: the tensor's base words;
    ``new_words()``: the range's new words (called only when the dense coding is tried)."""
    seg, st, h = encoded
    size = (stop - start) * width
    if 4 * len(seg) <= size:
        return encoded
    dense, _ = encode(tensor, start, old[start:stop], new_words(), level)
    if len(dense) >= len(seg):
        return encoded
    return dense, SegmentStats(header=HEADER_BYTES, raw=len(dense) - HEADER_BYTES, changed=st.changed), h


def coding_of(seg: memoryview) -> tuple[int, str]:
    """``(tensor, coding name)`` of any segment: ``sparse``, one of :data:`CODING_NAMES` or
    ``snapshot-raw`` / ``snapshot-zstd`` (what ``p2psync delta inspect`` reports)."""
    p = parse_segment(seg)
    if p.kind == KIND_DENSE:
        return p.tensor, CODING_NAMES.get(p.res_codec, f"dense-{p.res_codec}")
    if p.kind == KIND_RAW:
        return p.tensor, "snapshot-zstd" if p.res_codec == CODEC_ZSTD else "snapshot-raw"
    return p.tensor, "sparse"


def parse(buf: memoryview) -> tuple[int, memoryview]:
    """``(coding, payload)`` of the dense segment ``buf`` (lengths checked)."""
    p = parse_segment(buf)
    if p.kind != KIND_DENSE:
        raise CodecError(f"segment: kind {p.kind} is not a dense delta")
    if p.res_codec not in CODING_NAMES:
        raise CodecError(f"segment: unknown dense coding {p.res_codec}")
    assert p.res is not None
    return p.res_codec, p.res


def decode(seg: bytes | memoryview, start: int, stop: int, d: DType, old: np.ndarray, seed: np.uint64,
           origin: int = 0) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(positions, new words, fingerprint sum change) of the dense segment ``seg`` of ``[start,
    stop)`` against the base words ``old`` (which hold the tensor from position ``origin`` on):
    what :func:`p2psync.codec.segdecode.decode` returns for a sparse segment. Only the words that
    differ from the base are returned; the hash covers exactly those."""
    coding, payload = parse(memoryview(seg))
    n = stop - start
    if old.shape[0] < stop - origin:
        raise CodecError(f"segment: covers [{start}, {stop}), base words end at {origin + old.shape[0]}")
    base = old[start - origin:stop - origin]
    words = unplanes(payload if coding == CODING_RAW else unpack_payload(CODEC_ZSTD, payload, n * d.width), n, d.word)
    if coding == CODING_XOR_ZSTD:
        np.bitwise_xor(words, base, out=words)
    at = np.flatnonzero(words != base)
    pos = at + start
    new_w = words[at]
    a, b = hash_change(pos, base[at], new_w, seed)
    return pos, new_w, (int(a), int(b))
