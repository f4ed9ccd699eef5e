"""Per-rank slices of a delta: where segments are cut, in what order they are packed, and the signed index.

A tensor-parallel rank of an engine holds a slice of most tensors. So that it can
fetch and decode only what it holds, the encoder:

- **cuts** the segments of every large (``>= MIN_SLICED`` elements) tensor of two or
  more dimensions at the row boundaries that a split of dimension 0 over 2 to 8
  ranks keeps (row ``k * R / t`` for every ``t`` in 2..8 that divides the ``R``
  rows): a column-parallel or vocab-parallel rank's rows are then a run of whole
  segments, which it decodes against its own words alone; a row-parallel weight
  (``o_proj``, ``down_proj``: vLLM splits it along dimension 1, so every rank holds
  part of every row) is cut alike, and rank ``r`` decodes its row block for the
  group (``rollout.engines.vllm.apply.slices``);
- **orders** the segments: first every tensor that all ranks need whole (small
  tensors, 1-D tensors), in table order; then the row-cut tensors by
  the fraction of the rows where their block starts. Rank ``r`` of ``t`` then needs
  one contiguous run of the second part (rows ``[r/t, (r+1)/t)`` of every tensor),
  and the packer starts a new chunk at each change of block fraction (and after the
  first part), so the chunks it fetches are that run and the first part, with none
  shared with another rank's rows (at most one partly filled chunk per fraction:
  23 in all for splits over 2..8);
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

from collections.abc import Sequence
from fractions import Fraction
from typing import TypeVar

from p2psync.codec.segment import _HEAD
from p2psync.state import TensorSpec

MIN_SLICED = 1 << 14
"""Elements from which a tensor of two or more dimensions is cut into row blocks."""
SPLITS = range(2, 9)
"""Tensor-parallel sizes whose dim-0 splits the cuts keep."""

S = TypeVar("S", bytes, bytearray, memoryview, bytes | bytearray)


def sliced(spec: TensorSpec) -> bool:
    """Whether ``spec``'s segments are cut into row blocks and ordered by block."""
    return len(spec.shape) >= 2 and spec.numel >= MIN_SLICED and spec.shape[0] > 1


def row_cuts(spec: TensorSpec) -> list[int]:
    """The element offsets (sorted, inside ``(0, numel)``) where ``spec``'s row blocks start."""
    if not sliced(spec):
        return []
    rows = spec.shape[0]
    width = spec.numel // rows
    cut = sorted({k * rows // t for t in SPLITS if rows % t == 0 for k in range(1, t)})
    return [r * width for r in cut]


def delta_ranges(spec: TensorSpec, step: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    """``[lo, hi)`` (default: the whole tensor) cut every ``step`` elements from ``lo`` and at
    :func:`row_cuts`: the ranges a delta's jobs cover (each inside one row block)."""
    hi = spec.numel if hi is None else hi
    points = set(range(lo, hi, step)) | {c for c in row_cuts(spec) if lo < c < hi}
    starts = sorted(points | {lo}) if lo < hi else []
    return [(s, e) for s, e in zip(starts, starts[1:] + [hi])]


def order_key(specs: Sequence[TensorSpec], tensor: int, start: int) -> tuple:
    """Where a segment of tensor #``tensor`` starting at element ``start`` goes (module doc)."""
    spec = specs[tensor]
    cuts = row_cuts(spec)
    if not cuts:
        return (0, Fraction(0), tensor, start)
    block = max((c for c in cuts if c <= start), default=0)
    return (1, Fraction(block, spec.numel), tensor, start)


def block_key(specs: Sequence[TensorSpec], seg: bytes | bytearray | memoryview) -> tuple:
    """The part of the packing order a segment belongs to (the uncut tensors, or one row-block
    fraction): the packer starts a new chunk where it changes, so that a rank's run of chunks
    holds no other rank's rows at its ends."""
    _, t, start, _ = _HEAD.unpack_from(seg)
    return order_key(specs, t, start)[:2]


def order_segments(segments: Sequence[S], specs: Sequence[TensorSpec]) -> list[S]:
    """``segments`` in packing order (:func:`order_key`, from each segment's header)."""
    def key(seg: S) -> tuple:
        _, t, start, _ = _HEAD.unpack_from(seg)
        return order_key(specs, t, start)

    return sorted(segments, key=key)
