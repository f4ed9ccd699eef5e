"""Where the elements of one checkpoint tensor live in one vLLM parameter, as compact strided boxes.

A :class:`Placement` maps the elements of a checkpoint tensor that this rank
holds to flat positions in one live parameter. It is a list of
:class:`Family` objects; a family is a set of blocks that share one strided
shape: block ``b`` holds checkpoint positions ``ck[b] + sum(i_k * ck_stride_k)``
at parameter positions ``dst[b] + sum(i_k * dst_stride_k)`` for every
multi-index ``0 <= i_k < size_k``. That covers, as one block each, a tensor
stored whole, a shard of a fused parameter (q inside qkv, an expert's gate
inside ``w13``), a tensor-parallel row or column slice, a transposed load, and a
blocked repacking (CPU MoE weights: 16-row blocks stored column-major).
Irregular layouts (per-head permutations) fall back to one family of 1-D runs.

:func:`compress_runs` builds a placement from maximal runs contiguous on both
sides (what probing vLLM's loaders reads back, see
:mod:`rollout.engines.vllm.placement.probe`), :func:`compress` from explicit
``(checkpoint position, parameter position)`` pairs; :meth:`Placement.local` maps a delta's
changed positions to parameter positions in O(changes x dims).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from rollout.engines.vllm.placement.rules import LayoutError, Piece
from rollout.engines.vllm.placement.kernels import factor

_CHUNK = 1 << 22
"""Elements enumerated at a time by :meth:`Placement.chunks`."""


@dataclass
class Family:
    """Blocks of one strided shape (see module doc); ``dims`` are ``(size, ck_stride, dst_stride)``,
    outermost first, checkpoint strides nested (each larger than the extent of the dims inside it)."""

    dims: tuple[tuple[int, int, int], ...]
    ck: np.ndarray
    dst: np.ndarray

    @property
    def block(self) -> int:
        return math.prod(s for s, _, _ in self.dims)

    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """Checkpoint and parameter offsets of every element of one block, in checkpoint order."""
        c = np.zeros(1, dtype=np.int64)
        d = np.zeros(1, dtype=np.int64)
        for size, cs, ds in self.dims:
            i = np.arange(size, dtype=np.int64)
            c = (c[:, None] + i[None, :] * cs).reshape(-1)
            d = (d[:, None] + i[None, :] * ds).reshape(-1)
        return c, d


@dataclass
class Placement:
    """This rank's elements of checkpoint tensor ``name`` inside parameter ``param`` (see module doc)."""

    name: str
    param: str
    shape: tuple[int, ...]
    families: list[Family]
    counted: bool = True
    """This rank's words count towards the fingerprint (False: another rank holds the same copy)."""
    cast: str | None = None
    """The parameter's dtype where vLLM's loader converts the checkpoint's into it (``float32`` for a
    ``bfloat16`` router; :mod:`rollout.engines.vllm.placement.casts`); None: the same dtype."""
    numel: int = field(init=False)
    held: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = math.prod(self.shape)
        self.held = sum(f.block * f.ck.shape[0] for f in self.families)

    @property
    def whole(self) -> bool:
        """This rank holds every element of the tensor."""
        return self.held == self.numel

    def simple(self) -> int | None:
        """The parameter offset if the tensor is stored whole and contiguous there (else None)."""
        if len(self.families) != 1 or not self.whole:
            return None
        f = self.families[0]
        if f.ck.shape[0] != 1 or int(f.ck[0]) != 0:
            return None
        expect = 1
        for size, cs, ds in reversed(f.dims):
            if size == 1:
                continue
            if cs != expect or ds != expect:
                return None
            expect *= size
        return int(f.dst[0])

    def row_block(self) -> tuple[int, int, int, int, int, int] | None:
        """``(ck0, dst0, rows, ck_stride, dst_stride, width)`` when the elements held are one block of
        rows, each a run of ``width`` elements contiguous on both sides: row ``i`` holds checkpoint
        positions ``[ck0 + i * ck_stride, + width)`` at parameter positions ``[dst0 + i * dst_stride,
        + width)`` (a column slice of a row-parallel weight; rows contiguous on both sides are one
        run, ``rows == 1``); else None."""
        if len(self.families) != 1 or self.families[0].ck.shape[0] != 1:
            return None
        f = self.families[0]
        dims = [d for d in f.dims if d[0] > 1] or [(1, 1, 1)]
        if len(dims) == 1:
            dims = [(1, dims[0][0], dims[0][0])] + dims
        if len(dims) != 2 or dims[1][1:] != (1, 1):
            return None
        (rows, cs, ds), (width, _, _) = dims
        if cs == width and ds == width:
            rows, width = 1, rows * width
            cs = ds = width
        return int(f.ck[0]), int(f.dst[0]), rows, cs, ds, width

    def run(self) -> tuple[int, int, int] | None:
        """``(ck0, dst0, n)`` when the elements held are one run contiguous on both sides (checkpoint
        positions ``[ck0, ck0 + n)`` at parameter positions ``[dst0, dst0 + n)``: a tensor-parallel
        rank's rows of a column- or vocab-parallel weight, a tensor stored whole); else None."""
        rb = self.row_block()
        return (rb[0], rb[1], rb[5]) if rb is not None and rb[2] == 1 else None

    def local(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(which, dst)``: the indices into ``pos`` (checkpoint positions, any order) held here,
        and their parameter positions."""
        whiches, dsts = [], []
        for f in self.families:
            b = np.searchsorted(f.ck, pos, side="right") - 1
            ok = b >= 0
            b = np.where(ok, b, 0)
            rem = pos - f.ck[b]
            ok &= rem >= 0
            dst = f.dst[b].copy()
            for size, cs, ds in f.dims:
                q = rem // cs
                rem = rem - q * cs
                ok &= q < size
                dst += q * ds
            ok &= rem == 0
            which = np.flatnonzero(ok)
            whiches.append(which)
            dsts.append(dst[which])
        if len(whiches) == 1:
            return whiches[0], dsts[0]
        return np.concatenate(whiches), np.concatenate(dsts)

    def chunks(self, limit: int = _CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every held element as ``(checkpoint positions, parameter positions)``, a bounded chunk at a time."""
        for f in self.families:
            c, d = f.offsets()
            per = max(1, limit // max(1, c.shape[0]))
            if c.shape[0] > limit and f.dims:  # one huge block: split its outermost dim
                size, cs, ds = f.dims[0]
                sub = Family(f.dims[1:], np.empty(0, np.int64), np.empty(0, np.int64))
                ic, idd = sub.offsets()
                step = max(1, limit // max(1, ic.shape[0]))
                for b in range(f.ck.shape[0]):
                    for lo in range(0, size, step):
                        i = np.arange(lo, min(size, lo + step), dtype=np.int64)
                        yield ((f.ck[b] + i[:, None] * cs + ic[None, :]).reshape(-1),
                               (f.dst[b] + i[:, None] * ds + idd[None, :]).reshape(-1))
                continue
            for lo in range(0, f.ck.shape[0], per):
                ck0, dst0 = f.ck[lo:lo + per], f.dst[lo:lo + per]
                yield (ck0[:, None] + c[None, :]).reshape(-1), (dst0[:, None] + d[None, :]).reshape(-1)

    def block_map(self) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
        """``(base, sizes, checkpoint strides, parameter strides)`` when this tensor is held whole as
        one block whose checkpoint strides are row-major (outermost first, sizes above 1 only), so
        that position ``p`` lives at ``base + sum_k (p // cstr_k mod size_k) * dstr_k``; None when
        the placement is not that (several blocks or families, or a non-positive parameter stride)."""
        if not self.whole or len(self.families) != 1:
            return None
        f = self.families[0]
        if f.ck.shape[0] != 1 or int(f.ck[0]) != 0:
            return None
        dims = [d for d in f.dims if d[0] > 1]
        if not dims:
            return None
        expect = 1
        for size, cs, ds in reversed(dims):
            if cs != expect or ds <= 0:
                return None
            expect *= size
        return (int(f.dst[0]), tuple(d[0] for d in dims), tuple(d[1] for d in dims), tuple(d[2] for d in dims))

    def strided(self, mem: np.ndarray) -> np.ndarray | None:
        """This tensor, held whole as one block (:meth:`block_map`), as a read-only n-D view of
        ``mem`` (its parameter's flat words) whose C order is checkpoint order; None when it is not.

        A transposed weight is such a view too: its C order walks memory with a stride, so a range of
        it is not a slice of ``mem`` (:func:`rollout.engines.vllm.apply.kernels.gather_mapped` copies one)."""
        bm = self.block_map()
        if bm is None:
            return None
        start, sizes, _, dstr = bm
        last = start + sum((size - 1) * ds for size, ds in zip(sizes, dstr))
        if start < 0 or last >= mem.shape[0]:
            return None
        return np.lib.stride_tricks.as_strided(mem[start:], shape=sizes,
                                               strides=tuple(ds * mem.itemsize for ds in dstr), writeable=False)

    def key(self) -> str:
        """The set of checkpoint positions held, as text (equal on ranks holding the same copy)."""
        parts = [f"{f.dims}:{f.ck.tolist()}" for f in self.families]
        return f"{self.shape}|" + "|".join(parts)

    def describe(self) -> str:
        cast = f" (as {self.cast})" if self.cast else ""
        return f"{self.name} -> {self.param}{cast}: " + "; ".join(
            f"{f.ck.shape[0]} x {[(s, cs, ds) for s, cs, ds in f.dims]}" for f in self.families)


def same(a: Placement, b: Placement) -> bool:
    """``a`` and ``b`` hold the same elements at the same positions of the same parameter, in the same
    compressed form."""
    return (a.param == b.param and a.shape == b.shape and a.cast == b.cast and len(a.families) == len(b.families)
            and all(f.dims == g.dims and np.array_equal(f.ck, g.ck) and np.array_equal(f.dst, g.dst)
                    for f, g in zip(a.families, b.families)))


def compress(name: str, param: str, shape: tuple[int, ...], ck: np.ndarray | None, dst: np.ndarray,
             ck_sorted: bool = False) -> Placement:
    """The placement holding checkpoint positions ``ck`` at parameter positions ``dst`` (pairs, any order;
    ``ck_sorted``: ``ck`` is strictly ascending already; ``ck=None``: positions ``0, 1, ...``, one per
    element of ``dst``): :func:`compress_runs` of their maximal runs."""
    dst = np.asarray(dst, dtype=np.int64)
    if dst.shape[0] == 0:
        return Placement(name, param, tuple(shape), [])
    if ck is None:
        ck = np.arange(dst.shape[0], dtype=np.int64)
    else:
        ck = np.asarray(ck, dtype=np.int64)
        if not ck_sorted:
            order = np.argsort(ck, kind="stable")
            ck, dst = ck[order], dst[order]
            if ck.shape[0] > 1 and bool((np.diff(ck) == 0).any()):
                raise LayoutError(f"{name}: vLLM's loader writes some of its elements to more than one place "
                                  f"in {param}")
    return compress_runs(name, param, shape, *maximal_runs(ck, dst))


def maximal_runs(ck: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (``ck`` ascending) as maximal runs contiguous on both sides: starts and lengths."""
    starts = np.flatnonzero((np.diff(ck) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([np.zeros(1, np.int64), starts])
    lengths = np.diff(np.concatenate([starts, [ck.shape[0]]]))
    return ck[starts], dst[starts], lengths


def expand_runs(ck: np.ndarray, dst: np.ndarray, lengths: np.ndarray, step: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
    """Runs back as pairs, one per element; ``step``: run ``r`` is ``lengths[r]`` pieces of ``step``
    elements, given back as the pieces' starts."""
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    within *= step
    return np.repeat(ck, lengths) + within, np.repeat(dst, lengths) + within


def compress_runs(name: str, param: str, shape: tuple[int, ...], ck: np.ndarray, dst: np.ndarray,
                  lengths: np.ndarray) -> Placement:
    """The placement holding, for each run ``r``, checkpoint positions ``ck[r] .. ck[r] + lengths[r]``
    at parameter positions ``dst[r] ..``: maximal runs contiguous on both sides, ``ck`` ascending
    (how probing reads them back, see :mod:`rollout.engines.vllm.placement.probe`).

    One nested strided block when the runs are one (:func:`_factor`); else one family of runs per
    run length."""
    if ck.shape[0] == 0:
        return Placement(name, param, tuple(shape), [])
    ck, dst, lengths = (np.ascontiguousarray(x, dtype=np.int64) for x in (ck, dst, lengths))
    fam = _factor(ck, dst, lengths)
    if fam is not None:
        return Placement(name, param, tuple(shape), [fam])
    fams = []
    for n in np.unique(lengths):
        sel = lengths == n
        fams.append(Family(((int(n), 1, 1),), ck[sel].copy(), dst[sel].copy()))
    return Placement(name, param, tuple(shape), fams)


_MAX_LEVELS = 64
"""Levels of a block :func:`_factor` looks for (every level at least doubles the elements)."""


def _factor(ck: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> Family | None:
    """One block ``ck[0] + sum(i_k cs_k) -> dst[0] + sum(i_k ds_k)`` holding the runs, if there is one.

    A block's rows of ``L`` elements contiguous on both sides read back as maximal runs of a multiple
    of ``L`` (rows that happen to abut merge): runs of one length are the rows; others are cut
    into pieces of their greatest common divisor, then of single elements, and
    :func:`~rollout.engines.vllm.placement.kernels.factor` looks for the levels over the pieces' starts, with
    ``(L, 1, 1)`` innermost. Single elements are the pairs themselves, so a block is always found
    where there is one; the cuts before only spare expanding a large tensor's runs."""
    if bool((lengths == lengths[0]).all()):
        return _block(ck, dst, int(lengths[0]))  # as single elements, the first row is the first run too
    for piece in sorted({int(np.gcd.reduce(lengths)), 1}, reverse=True):
        fam = _block(*expand_runs(ck, dst, lengths // piece, step=piece), piece)
        if fam is not None:
            return fam
    return None


def _block(ck: np.ndarray, dst: np.ndarray, piece: int) -> Family | None:
    """:func:`_factor` over pieces of ``piece`` elements starting at ``(ck, dst)``."""
    levels = np.zeros((_MAX_LEVELS, 3), dtype=np.int64)
    nl = factor(np.ascontiguousarray(ck), np.ascontiguousarray(dst), levels)
    if nl < 0:
        return None
    found = ([(piece, 1, 1)] if piece > 1 else []) + [(int(s), int(a), int(b)) for s, a, b in levels[:nl]]
    extent = 1
    for s, a, _ in found:  # innermost first: each stride must clear the dims inside it
        if s > 1 and a < extent:
            return None
        extent = (s - 1) * a + extent if s > 1 else extent
    dims = tuple(reversed(found)) or ((1, 1, 1),)
    return Family(dims, ck[:1].copy(), dst[:1].copy())


def from_piece(piece: Piece, param_shape: tuple[int, ...]) -> Placement:
    """A hand-rule :class:`Piece` (rows x columns at a row of a 2-D or 1-D parameter) as a placement."""
    (r0, r1), (c0, c1) = piece.rows, piece.cols
    pcols = param_shape[1] if len(param_shape) >= 2 else 1
    if len(param_shape) > 2:
        pcols = int(np.prod(param_shape[1:]))
    dims = ((r1 - r0, piece.width, pcols), (c1 - c0, 1, 1))
    fam = Family(dims, np.array([r0 * piece.width + c0], np.int64), np.array([piece.at_row * pcols], np.int64))
    return Placement(piece.name, piece.param, piece.shape, [fam], piece.counted)


