"""Strided pieces: shards whose elements are many short flat runs of their tensor, encoded on rank 0.

A ``Shard(d>0)`` shard (tensor parallelism's row-parallel weights: every rank holds part of
every row) or a ``_StridedShard`` one is a box of its tensor: runs of consecutive flat
positions, a row's worth or less each, with other ranks' runs between them. A delta segment
covers one range ``[start, stop)`` of its tensor, no two segments of a tensor overlap, and with
the ranked position coding its bytes depend on every base word of the range. So a rank cannot
encode its runs as segments spanning rows (the other ranks' base words are in them), and one
segment per run costs ~130 bytes of tables per run: 2-4x the payload of runs of 512-2048
elements at 4 % changed (measured on a 1024 x 4096 bf16 tensor).

What happens instead: each rank extracts the changes of its box as usual (positions in its own
share, compared with its own copy of the previous version) and sends rank 0 a compact stream of
them: global flat position gaps, zigzag residuals and the exponents of the base words, zstd'd
byte planes (:func:`pack_changes`). That is what a delta segment in the base-free coding
(``context_buckets = 1``) needs of the base: its residual models are chosen by the base word's
exponent, its positions are gaps. Rank 0 merges the ranks' streams of a tensor and encodes
base-free segments over the whole tensor (:func:`encode_strided`): the same ranges and cuts as a
single process's encode, every receiver decodes them, no weight leaves its rank. Its words are
rebuilt as ``exponent << shift`` and that plus the residual, which gives the segment coder the
same exponents and residuals (the segment's bytes do not depend on anything else of the words
without buckets). The fingerprint contributions stay with each rank, at global positions.
"""

from __future__ import annotations

import struct

import numpy as np

from p2psync import dtypes
from p2psync.codec.encode import CodecOptions
from p2psync.codec.segencode import encode as encode_segment
from p2psync.codec.segment import SegmentStats, pack_payload, planes, unpack_payload, unplanes, unzigzag, zigzag
from p2psync.codec.slices import delta_ranges
from p2psync.state import TensorSpec, tensor_seed

_HEAD = struct.Struct("<IBQ")  # changes, payload codec, payload length
_NO_THRESHOLDS = np.zeros(0, dtype=np.int64)


def _exp_word(d: dtypes.DType) -> np.dtype:
    return np.dtype(np.uint8) if d.exp_mask <= 0xFF else np.dtype("<u2")


def pack_changes(spec: TensorSpec, gpos: np.ndarray, old_w: np.ndarray, new_w: np.ndarray, level: int) -> bytes:
    """A rank's changes of tensor ``spec`` (sorted global positions, base and new words) as sent to rank 0."""
    d = dtypes.from_code(spec.dtype)
    n = int(gpos.shape[0])
    gaps = np.diff(gpos, prepend=np.int64(0)).astype("<u8")
    zres = zigzag((new_w - old_w).astype(d.word, copy=False))
    exps = ((old_w >> d.word.type(d.exp_shift)) & d.word.type(d.exp_mask)).astype(_exp_word(d))
    raw = b"".join((planes(gaps), planes(zres), planes(exps)))
    codec, body = pack_payload(bytearray(raw), level)
    return _HEAD.pack(n, codec, len(body)) + bytes(body)


def unpack_changes(spec: TensorSpec, blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global positions, zigzag residuals, base exponents) of :func:`pack_changes`."""
    d = dtypes.from_code(spec.dtype)
    n, codec, size = _HEAD.unpack_from(blob)
    ew = _exp_word(d)
    raw = unpack_payload(codec, memoryview(blob)[_HEAD.size:_HEAD.size + size], n * (8 + d.width + ew.itemsize))
    gpos = np.cumsum(unplanes(raw[:8 * n], n, np.dtype("<u8")).astype(np.int64))
    zres = unplanes(raw[8 * n:(8 + d.width) * n], n, d.word)
    exps = unplanes(raw[(8 + d.width) * n:], n, ew)
    return gpos, zres, exps


def encode_strided(index: int, spec: TensorSpec, blobs: list[bytes], opts: CodecOptions
                   ) -> tuple[list[bytes], SegmentStats]:
    """Rank 0: base-free delta segments of tensor #``index`` from every rank's :func:`pack_changes`."""
    d = dtypes.from_code(spec.dtype)
    parts = [unpack_changes(spec, b) for b in blobs]
    gpos = np.concatenate([p[0] for p in parts])
    order = np.argsort(gpos, kind="stable")
    gpos = gpos[order]
    if gpos.shape[0] > 1 and not np.all(gpos[1:] > gpos[:-1]):
        raise ValueError(f"{spec.name}: two ranks sent a change of the same element")
    zres = np.concatenate([p[1] for p in parts])[order]
    exps = np.concatenate([p[2] for p in parts])[order].astype(d.word)
    old_w = exps << d.word.type(d.exp_shift)
    new_w = old_w + unzigzag(zres)
    seed = tensor_seed(spec.name)
    cap = opts.max_changes(d.width)
    segments: list[bytes] = []
    stats = SegmentStats()
    for s, e in delta_ranges(spec, opts.segment_elements):
        lo, hi = np.searchsorted(gpos, [s, e])
        at = s
        for a in range(int(lo), int(hi), cap):
            b = min(int(hi), a + cap)
            stop = int(gpos[b]) if b < hi else e
            seg, st, _ = encode_segment(index, at, stop, old_w, gpos[a:b], old_w[a:b], new_w[a:b], d, _NO_THRESHOLDS,
                                        opts.zstd_level, seed)
            segments.append(seg)
            stats.add(st)
            at = stop
    return segments, stats
