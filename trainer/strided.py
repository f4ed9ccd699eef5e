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
them: global flat positions Rice coded as a segment codes them, and zstd'd zigzag residuals
(:func:`pack_changes`). That is all a delta segment in the base-free coding (``context_buckets =
1``) needs when it has one residual model: rank 0 merges the ranks' streams of a tensor and
encodes base-free segments over the whole tensor (:func:`encode_strided`), the same ranges and row
cuts as a single process's encode (:func:`p2psync.codec.slices.sparse_pieces`), each of at most :data:`ONE_MODEL` changes (a segment chooses a
residual model per run of base exponents holding 4,096 changes or more; below twice that it has
one model, so the base words' exponents play no part in its bytes and rank 0 needs none of them).
Its words are rebuilt as 0 and the residual, which gives the segment coder the same residuals.
Every receiver decodes these segments; no weight leaves its rank; the fingerprint contributions
stay with each rank, at global positions. Cost: the base-free positions (~30 % more than ranked
for these tensors), one segment header (~130 bytes) per 8,191 changes, and between ranks about
the payload of the changes sent.
"""

from __future__ import annotations

import struct

import numpy as np

from p2psync import dtypes
from p2psync.codec import rice
from p2psync.codec.encode import CodecOptions
from p2psync.codec.segencode import encode as encode_segment
from p2psync.codec.segment import SegmentStats, pack_payload, planes, unpack_payload, unplanes, unzigzag, zigzag
from p2psync.codec.slices import delta_ranges, sparse_pieces
from p2psync.codec.sparse import MIN_CHANGES_PER_MODEL
from p2psync.state import TensorSpec, tensor_seed

_HEAD = struct.Struct("<QBII BQ")  # changes, Rice k, unary and remainder bytes, residual codec and bytes
_NO_THRESHOLDS = np.zeros(0, dtype=np.int64)
ONE_MODEL = 2 * MIN_CHANGES_PER_MODEL - 1
"""Changes per segment below which a segment has a single residual model (``sparse.model_bounds``)."""


def pack_changes(spec: TensorSpec, gpos: np.ndarray, old_w: np.ndarray, new_w: np.ndarray, level: int) -> bytes:
    """A rank's changes of tensor ``spec`` (sorted global positions, base and new words) as sent to rank 0."""
    d = dtypes.from_code(spec.dtype)
    n = int(gpos.shape[0])
    gpos = np.ascontiguousarray(gpos, dtype=np.int64)
    one = np.zeros(1, dtype=np.int64)
    ks = np.zeros(1, dtype=np.int64)
    ubits, rbits = rice.plan(gpos, one, one + n, ks)
    unary = np.zeros((ubits + 7) // 8, dtype=np.uint8)
    rem = np.zeros((rbits + 7) // 8, dtype=np.uint8)
    rice.write(gpos, one, one + n, ks, unary, rem)
    codec, res = pack_payload(planes(zigzag((new_w - old_w).astype(d.word, copy=False))), level)
    return b"".join((_HEAD.pack(n, int(ks[0]), unary.shape[0], rem.shape[0], codec, len(res)), unary.tobytes(),
                     rem.tobytes(), bytes(res)))


def unpack_changes(spec: TensorSpec, blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(global positions, zigzag residuals) of :func:`pack_changes`."""
    d = dtypes.from_code(spec.dtype)
    n, k, nu, nr, codec, size = _HEAD.unpack_from(blob)
    view = memoryview(blob)
    at = _HEAD.size
    gpos = np.empty(n, dtype=np.int64)
    status = rice.read(view[at:at + nu], view[at + nu:at + nu + nr], np.array([n], dtype=np.int64),
                       np.array([k], dtype=np.int64), spec.numel, gpos)
    if status != 0:
        raise ValueError(f"{spec.name}: malformed change stream (code {status})")
    at += nu + nr
    zres = unplanes(unpack_payload(codec, view[at:at + size], n * d.width), n, d.word)
    return gpos, zres


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
    old_w = np.zeros(gpos.shape[0], dtype=d.word)
    new_w = unzigzag(np.concatenate([p[1] for p in parts])[order])
    seed = tensor_seed(spec.name)
    cap = min(opts.max_changes(d.width), ONE_MODEL)
    segments: list[bytes] = []
    stats = SegmentStats()
    for s, e in (piece for r in delta_ranges(spec, opts.segment_elements) for piece in sparse_pieces(spec, gpos, *r)):
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
