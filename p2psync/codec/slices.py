"""Per-rank slices of a delta: where segments are cut, in what order they are packed, and the signed index.

A tensor-parallel rank of an engine holds a slice of most tensors. So that it can
fetch and decode only what it holds, the encoder:

- **cuts** the segments of every large (``>= MIN_SLICED`` elements) tensor of two or
  more dimensions at the row boundaries that a split of dimension 0 over 2 to 8
  ranks keeps (row ``k * R / t`` for every ``t`` in 2..8 that divides the ``R``
  rows), **where the cut pays** (:func:`pieces`): a split over ``t`` ranks is kept
  when each piece it leaves holds at least ``MIN_PIECE_CHANGES`` changes (estimated
  from sampled blocks: ``FINE_SAMPLE``), splits taken from 2 up, so a
  tensor with few changes stays whole and one with many is cut at every rank count.
  A cut starts a segment, with its own header and code tables, and coarser residual
  models below ``MIN_PIECE_CHANGES`` (docs/CODEC.md, "Per-rank slices"). A
  column-parallel or vocab-parallel rank's rows are then a run of whole segments
  where its tensors were cut, and part of a shared segment where not; a
  row-parallel weight (``o_proj``, ``down_proj``: vLLM splits it along dimension 1,
  so every rank holds part of every row) is cut alike, and rank ``r`` decodes its
  row block for the group (``rollout.engines.vllm.apply.slices``);
- **orders** the segments (:func:`order_key`, from each segment's header): first
  every segment every rank needs whole (small and 1-D tensors, tensors left
  whole), in table order; then the others by the fraction of the rows of the
  piece they lie in (the span between the row boundaries around them), and the
  packer starts a new chunk at each change of that span, so no chunk holds rows
  of two pieces (at most one partly filled chunk per span: 23 spans in all for
  tensors cut at every split over 2..8);
- **indexes** the chunks in the signed manifest (``segments``): per chunk the
  ``(tensor, start, stop)`` of each of its segments, in order. A rank reads from the
  index which chunks hold the element ranges it holds, fetches those (each checked
  against its signed hash, as every chunk is), and checks that each fetched chunk
  holds exactly the segments the index gives it (:mod:`p2psync.codec.segindex`).

A row of a row-parallel weight spans every rank's columns: the ranks rebuild each
such segment's range together (``rollout.engines.vllm.apply.ranks``), the rank whose row
block holds it decodes it, and the changes go to the ranks holding their columns.
Any split decodes correctly: a segment that lies in no one rank's row block is
fetched and decoded by every rank holding part of it.

Decoders that take whole artifacts ignore all of this: cuts and order change only
which segments exist and where they sit, never what a segment means.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import accumulate
from typing import TypeVar

import numpy as np

from p2psync.codec import kernels
from p2psync.codec.segment import _HEAD
from p2psync.state import TensorSpec

MIN_SLICED = 1 << 14
"""Elements from which a tensor of two or more dimensions is cut into row blocks."""
SPLITS = range(2, 9)
"""Tensor-parallel sizes whose dim-0 splits the cuts keep."""
MIN_PIECE_CHANGES = 1 << 15
"""Changes (estimated) each piece of a split must hold for the encoder to cut there. A cut costs a
segment's header and tables (~120 bytes) and, below this, residual-model resolution: a residual
model needs 4,096 changes (``sparse.MIN_CHANGES_PER_MODEL``), so a piece of 32,768 keeps one per
exponent for the ~8 exponents that hold most changes. Measured on the held-out workload
(``tools/bench_slices.py``): cuts at 16,384 cost +0.67 % at lr 1e-6 and +1.07 % at 1e-5 (MLP
weights of 50 k changes cut in halves: +2.2 % each, nearly all rANS), at 32,768 +0.35 % and +0.12 %."""
COARSE_SAMPLE = 1 << 16
FINE_SAMPLE = 1 << 14
"""The cut estimates count the changes in the first 64 elements of every 65,536 of a tensor (is
the range worth a closer look: at least ``MIN_PIECE_CHANGES`` changes in all?), then of every
16,384 (each candidate piece: a piece at the bound has ~128 sampled changes, so the choice is
within ~10 % of the bound, which moves its cost, not its correctness). Blocks at multiples of
the stride from the tensor's start, whatever range is encoded: the scan, the sparse encoder and
a shard's encoder count alike. One look at every 4,096 took ~6 ms per encode of the held-out
workload's 45 M elements (each sampled block a page from the last, so each waits for memory);
these two passes and the packing order take ~1 ms of CPU."""

S = TypeVar("S", bytes, bytearray, memoryview, bytes | bytearray)


def sliced(spec: TensorSpec) -> bool:
    """Whether ``spec``'s segments may be cut into row blocks and ordered by block."""
    return len(spec.shape) >= 2 and spec.numel >= MIN_SLICED and spec.shape[0] > 1


def split_cuts(spec: TensorSpec) -> list[list[int]]:
    """Per split (``t`` in :data:`SPLITS` dividing the rows, ascending), the element offsets inside
    ``(0, numel)`` where its row blocks start; empty for a tensor that is not :func:`sliced`."""
    if not sliced(spec):
        return []
    return [list(c) for c in _split_cuts(spec.shape[0], spec.numel)]


@lru_cache(maxsize=1024)
def _split_cuts(rows: int, numel: int) -> tuple[tuple[int, ...], ...]:
    width = numel // rows
    return tuple(tuple(k * rows // t * width for k in range(1, t)) for t in SPLITS if rows % t == 0)


def row_cuts(spec: TensorSpec) -> list[int]:
    """Every element offset (sorted, inside ``(0, numel)``) where a row block of ``spec`` may start."""
    return list(_row_cuts(spec.shape[0], spec.numel)) if sliced(spec) else []


@lru_cache(maxsize=1024)
def _row_cuts(rows: int, numel: int) -> tuple[int, ...]:
    return tuple(sorted({c for cuts in _split_cuts(rows, numel) for c in cuts}))


def delta_ranges(spec: TensorSpec, step: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    """``[lo, hi)`` (default: the whole tensor) cut into the ranges of a delta's jobs, each at most
    ``step`` elements: a range ends at the last row boundary (:func:`row_cuts`) inside it where
    there is one, so that a job's end is a place a rank's rows end too (a 16.4 M-element embedding
    in jobs of 2**23 is cut in halves, not at 2**23 with a sliver of rows after its middle). A job
    cuts its range further into :func:`pieces`."""
    hi = spec.numel if hi is None else hi
    cuts = _row_cuts(spec.shape[0], spec.numel) if sliced(spec) else ()
    out = []
    s = lo
    while s < hi:
        e = min(hi, s + step)
        if e < hi:
            i = bisect_right(cuts, e)
            if i and cuts[i - 1] > s:
                e = cuts[i - 1]
        out.append((s, e))
        s = e
    return out


def sampled_in(a: int, b: int, stride: int) -> int:
    """Elements of ``[a, b)`` in the sample of ``stride`` (the first 64 of every ``stride``)."""
    def upto(x: int) -> int:
        return (x // stride) * 64 + min(64, x % stride)
    return upto(b) - upto(a)


_NO_CUTS = np.zeros(0, dtype=np.int64)
Count = Callable[[np.ndarray, int], np.ndarray]
"""``count(cuts, stride)``: the sampled changes in each of the ``len(cuts) + 1`` intervals that
the sorted element offsets ``cuts`` make of the range (``kernels.cut_sample``)."""


def pieces(spec: TensorSpec, lo: int, hi: int, count: Count) -> list[tuple[int, int]]:
    """``[lo, hi)`` of ``spec`` cut at the row blocks of the splits that pay (module doc).

    ``count``: :data:`Count` over ``[lo, hi)`` (``kernels.cut_sample``,
    ``kernels.cut_sample_sparse``: the same numbers). Only these counts decide, so the scan and
    the sparse encoder cut alike."""
    if not sliced(spec) or hi - lo < 2 * MIN_PIECE_CHANGES:
        return [(lo, hi)]
    total = int(count(_NO_CUTS, COARSE_SAMPLE)[0])
    if total * (hi - lo) < MIN_PIECE_CHANGES * max(1, sampled_in(lo, hi, COARSE_SAMPLE)):
        return [(lo, hi)]
    splits = [[c for c in cuts if lo < c < hi] for cuts in split_cuts(spec)]
    cand = sorted({c for cuts in splits for c in cuts})
    if not cand:
        return [(lo, hi)]
    below = [0, *accumulate(count(np.array(cand, dtype=np.int64), FINE_SAMPLE).tolist())]
    at = {c: k for k, c in enumerate([lo, *cand, hi])}  # below[at[x]]: sampled changes in [lo, x)

    def pays(a: int, b: int) -> bool:  # estimate (sampled changes * elements / sampled elements) >= bound
        return (below[at[b]] - below[at[a]]) * (b - a) >= MIN_PIECE_CHANGES * max(1, sampled_in(a, b, FINE_SAMPLE))

    chosen: set[int] = set()
    for cuts in splits:
        trial = sorted(chosen | set(cuts))
        if len(trial) == len(chosen):
            continue
        ends = [lo, *trial, hi]
        if all(pays(a, b) for a, b in zip(ends, ends[1:])):
            chosen.update(cuts)
    ends = [lo, *sorted(chosen), hi]
    return list(zip(ends, ends[1:]))


def dense_pieces(spec: TensorSpec, old: np.ndarray, new: np.ndarray, s: int, e: int) -> list[tuple[int, int]]:
    """:func:`pieces` of ``[s, e)`` from the tensor's base and new words (the scan path)."""
    def count(cuts: np.ndarray, stride: int) -> np.ndarray:
        out = np.empty(cuts.shape[0] + 1, dtype=np.int64)
        kernels.cut_sample(old, new, s, e, cuts, stride, out)
        return out
    return pieces(spec, s, e, count)


def sparse_pieces(spec: TensorSpec, pos: np.ndarray, s: int, e: int, offset: int = 0) -> list[tuple[int, int]]:
    """:func:`dense_pieces` from the sorted changed positions ``pos`` of an array that starts at
    element ``offset`` of the tensor (a shard of it; ``s``, ``e`` and the pieces in its positions)."""
    def count(cuts: np.ndarray, stride: int) -> np.ndarray:
        out = np.empty(cuts.shape[0] + 1, dtype=np.int64)
        kernels.cut_sample_sparse(pos, offset, s, e, cuts - offset, stride, out)
        return out
    return [(a - offset, b - offset) for a, b in pieces(spec, s + offset, e + offset, count)]


def order_key(specs: Sequence[TensorSpec], tensor: int, start: int, stop: int) -> tuple:
    """Where the segment of tensor #``tensor`` covering ``[start, stop)`` goes (module doc): its
    piece is the span between the row boundaries around it (:func:`row_cuts`); a piece that is
    the whole tensor goes with the tensors every rank needs whole.

    The span is a pair of fractions of the rows. Their denominators divide 840 (each row boundary is
    ``k / t`` of the rows, ``t`` in 2..8), so as floats (a correctly rounded quotient: equal
    fractions give equal floats, and distinct ones differ by far more than a rounding) they order
    exactly as :class:`fractions.Fraction` would, at a tenth of the cost."""
    spec = specs[tensor]
    if sliced(spec):
        n = spec.numel
        cuts = _row_cuts(spec.shape[0], n)
        i = bisect_right(cuts, start)
        a = cuts[i - 1] if i else 0
        j = bisect_left(cuts, stop)
        b = cuts[j] if j < len(cuts) else n
        if (a, b) != (0, n):
            return (1, a / n, b / n, tensor, start)
    return (0, 0.0, 0.0, tensor, start)


def block_key(specs: Sequence[TensorSpec], seg: bytes | bytearray | memoryview) -> tuple:
    """The part of the packing order a segment belongs to (the segments every rank needs whole,
    or one piece span): the packer starts a new chunk where it changes, so that a chunk holds
    the rows of one piece span only."""
    _, t, start, stop = _HEAD.unpack_from(seg)
    return order_key(specs, t, start, stop)[:3]


def segment_key(specs: Sequence[TensorSpec], seg: bytes | bytearray | memoryview) -> tuple:
    """:func:`order_key` of a segment, from its header."""
    _, t, start, stop = _HEAD.unpack_from(seg)
    return order_key(specs, t, start, stop)


def order_segments(segments: Sequence[S], specs: Sequence[TensorSpec]) -> list[S]:
    """``segments`` in packing order (:func:`order_key`, from each segment's header)."""
    return sorted(segments, key=lambda seg: segment_key(specs, seg))
