"""Dense delta segments: every word of a range, for changes too dense for the sparse coding.

The sparse coding (``sparse``, ``segencode``) pays for positions; when nearly every element
of a range changes (a LoRA adapter's step, a large learning rate) the positions cost more than
the words they save, and the segment grows past the raw words. A delta then codes that range
densely instead: the new words themselves, or the zigzagged integer difference of the new and
base words (what the sparse coding's residual is: an Adam step of a few ULPs is a small integer),
as byte planes (the high plane of a bf16 difference is mostly zero: sign and exponent rarely
move), raw or zstd, whichever is smallest. (Coding 2, the words' XOR with the base, is decoded but
no longer written: on adapter steps it was never smaller than the better of the other two, and
each coding tried is a zstd pass over the range on the publisher's critical path.) So a dense segment never holds more than the range's raw words plus its
header. Layout (little-endian), after the common header (``segment``, kind 3)::

    u8 coding          0 = new words raw, 1 = new words zstd, 2 = XOR with base zstd,
                       3 = zigzag(new - base) zstd (wrapping integer difference of the words)
    u32 len            payload bytes
    payload            byte planes of the words (or of the XOR, or the difference), as ``coding`` says

A range where at least :data:`DENSE_SHARE` of the words changed (an adapter step: every word
moves) is coded densely outright: near all-changed the sparse coding is within a few percent of
the dense one either way (it pays for positions, and its residuals are coded by context; -3 to +5 %
per version on the LoRA benchmark's adapter), and its encode is the costly part (7x the dense
one), so an encoder that knows the count (changes found elsewhere: the trainer's publisher; an
all-changed segment found by one compare on the scan path) skips it. Elsewhere the encoder makes
a sparse segment first and swaps in the dense one only where the sparse one came out larger than a
quarter of the range's raw words (cheap to test, so sparse RL deltas pay no extra work) and the
dense one is smaller. Both are deterministic choices from the segment's own words, so every encode
path (whole states, changes found elsewhere, the step-by-step reference) writes the same bytes.
Decoding yields what a sparse segment yields: the changed positions (words equal to the base are
dropped), their new words and the fingerprint sums' change.
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

ZSTD_LEVEL = 1
"""zstd level of every compressed dense coding, whatever the delta's level: dense byte planes are
near-random low bytes over mostly-zero high bytes, where level 1 is about 4x faster than level 3
and no larger (on adapter steps 4 % smaller: the higher level's match search finds nothing and
costs literal-coding precision). Fixed, so every encoder writes the same bytes."""
DENSE_SHARE = (31, 32)
"""A range with at least this share of its words changed is coded densely without trying sparse."""
CODING_RAW = 0
CODING_ZSTD = 1
CODING_XOR_ZSTD = 2
CODING_DIFF_ZSTD = 3
CODING_NAMES = {CODING_RAW: "dense-raw", CODING_ZSTD: "dense-zstd", CODING_XOR_ZSTD: "dense-xor-zstd",
                CODING_DIFF_ZSTD: "dense-diff-zstd"}
"""How ``p2psync delta inspect`` names each dense coding (the sparse one is ``sparse``)."""
_BODY = struct.Struct("<BI")
HEADER_BYTES = len(encode_header(KIND_DENSE, 0, 0, 0)) + _BODY.size
"""A dense segment's bytes besides its payload (common header, coding, length)."""


def zigzag_diff(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``new - old`` as integers of the words' width (wrapping), zigzagged so that small
    differences of either sign are small unsigned words (a new array of ``old``'s dtype)."""
    d = np.subtract(new, old, dtype=old.dtype)  # unsigned: wraps
    signed = d.view(np.dtype(f"i{old.dtype.itemsize}"))
    out = np.left_shift(signed, 1)
    np.bitwise_xor(out, np.right_shift(signed, 8 * old.dtype.itemsize - 1), out=out)
    return out.view(old.dtype)


def add_unzigzag(z: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag_diff`: ``base`` plus the difference ``z`` codes, written over ``z``."""
    low = np.bitwise_and(z, 1)
    np.right_shift(z, 1, out=z)
    np.negative(low, out=low)  # 0 or all ones (unsigned: wraps)
    np.bitwise_xor(z, low, out=z)
    np.add(z, base, out=z)  # wraps
    return z


def encode(tensor: int, start: int, old: np.ndarray, new: np.ndarray, level: int) -> tuple[bytes, int]:
    """The dense segment of ``[start, start + len(new))`` (``old``, ``new``: the base and new
    words of that range) in its smallest coding, and that coding. ``level`` 0: raw words only;
    any other level compresses at :data:`ZSTD_LEVEL`."""
    raw = planes(new)
    best_coding, best = CODING_RAW, memoryview(raw)
    if level > 0 and len(raw) > 64:
        level = ZSTD_LEVEL
        z = compress(raw, level)
        if len(z) < len(best):
            best_coding, best = CODING_ZSTD, memoryview(z)
        df = compress(planes(zigzag_diff(old, new)), level)
        if len(df) < len(best):
            best_coding, best = CODING_DIFF_ZSTD, memoryview(df)
    head = encode_header(KIND_DENSE, tensor, start, start + new.shape[0]) + _BODY.pack(best_coding, len(best))
    return b"".join((head, best)), best_coding


def dense_first(changed: int, n: int) -> bool:
    """Whether a range of ``n`` words, ``changed`` of them changed, is coded densely outright
    (:data:`DENSE_SHARE`; module doc)."""
    num, den = DENSE_SHARE
    return den * changed >= num * n


def encode_range(tensor: int, start: int, old: np.ndarray, new: np.ndarray, pos: np.ndarray,
                 old_w: np.ndarray | None, new_w: np.ndarray, seed: np.uint64, level: int
                 ) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """The dense segment of ``[start, start + len(new))`` with its statistics and fingerprint sum
    change, as the encoders' segment functions return them. ``old``/``new``: the range's base and
    new words; ``pos``/``old_w``/``new_w``: its changed positions (in the tensor) and their words
    (``old_w`` ``None``: the sum change is not computed, ``(0, 0)``)."""
    seg, _ = encode(tensor, start, old, new, level)
    h = (0, 0)
    if old_w is not None:
        a, b = hash_change(pos, old_w, new_w, seed)
        h = (int(a), int(b))
    return seg, SegmentStats(header=HEADER_BYTES, raw=len(seg) - HEADER_BYTES, changed=int(pos.shape[0])), h


def smaller(encoded: tuple[bytes, SegmentStats, tuple[int, int]], tensor: int, start: int, stop: int,
            old: np.ndarray, new_words, width: int, level: int) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """``encoded`` (a sparse segment of ``[start, stop)``, its statistics and hash change), or the
    dense segment of the same range where that is smaller or :func:`dense_first` says so. ``old``: the tensor's base words;
    ``new_words()``: the range's new words (called only when the dense coding is tried)."""
    seg, st, h = encoded
    size = (stop - start) * width
    forced = dense_first(st.changed, stop - start)
    if 4 * len(seg) <= size and not forced:
        return encoded
    dense, _ = encode(tensor, start, old[start:stop], new_words(), level)
    if len(dense) >= len(seg) and not forced:
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
    elif coding == CODING_DIFF_ZSTD:
        add_unzigzag(words, base)
    at = np.flatnonzero(words != base)
    pos = at + start
    new_w = words[at]
    a, b = hash_change(pos, base[at], new_w, seed)
    return pos, new_w, (int(a), int(b))
