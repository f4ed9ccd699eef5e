"""Compiled loops over raw words that the model state needs: the element hashes of its
fingerprint, the scatter that writes changes in place, and a range check.

Below the codec: :mod:`p2psync.state` uses these, and the codec's kernels
(:mod:`p2psync.codec.kernels`) build on the same hashes, so both agree bit for bit.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_U64 = np.uint64
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)


def is_word_array(a) -> bool:
    """Whether the numba type ``a`` is a contiguous 1-d array of integer words (what the intrinsics take)."""
    return isinstance(a, types.Array) and isinstance(a.dtype, types.Integer) and a.layout in "CA" and a.ndim == 1


def prefetch_codegen(locality: int):
    """Codegen of an intrinsic ``(arr, idx) -> None`` that prefetches the line of word ``idx`` for
    reading with LLVM's ``locality`` (3: keep in all levels, 2: L2 and below ...)."""

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        i32 = ir.IntType(32)
        builder.call(fn, [ptr, i32(0), i32(locality), i32(1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch_l2(typingctx, arr, idx):
    """Prefetch the line of word ``idx`` into L2 for reading (``prefetcht1``; a hint: never
    faults). For scattered writes far ahead: measured on the benchmark VM, it keeps more misses
    in flight than a prefetch for writing into L1 (``prefetchw``)."""
    if not is_word_array(arr):
        return None
    return types.void(arr, types.intp), prefetch_codegen(2)


# --- fingerprint element hashes ------------------------------------------------------------
@njit(nogil=True, cache=True, inline="always")
def _mix64(z):
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(nogil=True, cache=True, inline="always")
def _lanes(pos, w, s):
    m = _mix64(_U64(pos) * _GOLD + s)
    return _mix64(w + m), _mix64((w ^ _GOLD) + ((m << _S32) | (m >> _S32)))


@njit(nogil=True, cache=True)
def hash_range(words, start, end, seed):
    """Two 64-bit lanes of sum over i in [start, end) of h(i, words[i]) (wrapping)."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    for i in range(start, end):
        x, y = _lanes(i, _U64(words[i]), s)
        a += x
        b += y
    return a, b


@njit(nogil=True, cache=True)
def hash_sparse(positions, values, seed):
    """Same lanes as :func:`hash_range` over the listed positions only."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    for j in range(positions.shape[0]):
        x, y = _lanes(positions[j], _U64(values[j]), s)
        a += x
        b += y
    return a, b


@njit(nogil=True, cache=True, inline="always")
def change_lanes(pos, wo, wn, s):
    """What replacing the word ``wo`` at ``pos`` by ``wn`` adds to the two lanes (one position mix)."""
    m = _mix64(_U64(pos) * _GOLD + s)
    r = (m << _S32) | (m >> _S32)
    return _mix64(wn + m) - _mix64(wo + m), _mix64((wn ^ _GOLD) + r) - _mix64((wo ^ _GOLD) + r)


@njit(nogil=True, cache=True)
def hash_change(positions, old_values, new_values, seed):
    """Lanes of the new words minus lanes of the old words at ``positions``: what replacing
    them adds to a tensor's fingerprint sums (one pass, one position mix per change)."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    for j in range(positions.shape[0]):
        da, db = change_lanes(positions[j], _U64(old_values[j]), _U64(new_values[j]), s)
        a += da
        b += db
    return a, b


SCATTER_AHEAD = 32
"""How many changes ahead :func:`scatter` prefetches the line it will write."""


@njit(nogil=True, cache=True)
def scatter(words, positions, values):
    """``words[positions] = values`` (positions already validated), ~10x numpy's fancy assignment.

    Each write misses the cache (at RL densities about one change per line), so the line
    :data:`SCATTER_AHEAD` changes ahead is prefetched into L2 for reading: on the benchmark VM
    that keeps the most misses in flight (12.5-13.3 ms for the lr 1e-6 delta's 1.44 M changes,
    one thread; L1 and L3 read hints at 32-128 changes ahead and write hints at 16-64 are
    slower; docs/CODEC.md, "Speed")."""
    n = positions.shape[0]
    for j in range(n):
        if j + SCATTER_AHEAD < n:
            prefetch_l2(words, positions[j + SCATTER_AHEAD])
        words[positions[j]] = values[j]


@njit(nogil=True, cache=True)
def scatter_logged(words, positions, values, undo, seed):
    """:func:`scatter` that first keeps each overwritten word in ``undo`` (same slots as
    ``values``) and returns what the writes add to the fingerprint lanes (:func:`hash_change` of
    the overwritten and the written words): an undoable, fingerprinted write in one pass over the
    changes. ``scatter(words, positions, undo)`` takes it back."""
    n = positions.shape[0]
    s = _U64(seed)
    a = _U64(0)
    b = _U64(0)
    for j in range(n):
        if j + SCATTER_AHEAD < n:
            prefetch_l2(words, positions[j + SCATTER_AHEAD])
        p = positions[j]
        o = words[p]
        undo[j] = o
        words[p] = values[j]
        da, db = change_lanes(p, _U64(o), _U64(words[p]), s)
        a += da
        b += db
    return a, b


@njit(nogil=True, cache=True)
def in_range(positions, n):
    """Whether every position is in ``[0, n)`` (a min/max reduction: it vectorises)."""
    if positions.shape[0] == 0:
        return True
    lo = positions[0]
    hi = positions[0]
    for j in range(positions.shape[0]):
        lo = min(lo, positions[j])
        hi = max(hi, positions[j])
    return lo >= 0 and hi < n
