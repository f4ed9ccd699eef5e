"""Compiled loops of the vLLM backend for tensors held as one strided block of a parameter.

An expert inside a repacked ``w13_weight``, a transposed weight: the tensor's
checkpoint position ``p`` lives at ``base + sum_k (p // cstr_k mod size_k) * dstr_k``
(:meth:`rollout.engines.vllm_placement.Placement.strided`). :func:`scatter_mapped_logged`
maps, keeps the old word, writes and hashes in one pass over the changes, as
:func:`p2psync.wordops.scatter_logged` does for a tensor stored contiguously.
The backend's warm-up (:mod:`rollout.engines.vllm_warm`) compiles it before the
first update.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.wordops import SCATTER_AHEAD, change_lanes, prefetch_l2

_U64 = np.uint64


@njit(nogil=True, cache=True, inline="always")
def _mapped(p, base, cstr, dstr):
    """The parameter position of checkpoint position ``p`` in the block (module doc)."""
    rem = p
    dst = base
    for k in range(cstr.shape[0]):
        q = rem // cstr[k]
        rem -= q * cstr[k]
        dst += q * dstr[k]
    return dst


@njit(nogil=True, cache=True)
def scatter_mapped_logged(words, positions, values, undo, seed, base, cstr, dstr):
    """For each change ``j``: the word at the parameter position of checkpoint position
    ``positions[j]`` is kept in ``undo[j]`` and replaced by ``values[j]``; returns what the
    writes add to the fingerprint lanes, hashed at the checkpoint positions (as read back from
    ``words``). ``cstr`` are the block's row-major checkpoint strides, outermost first, and
    ``dstr`` its parameter strides; positions must lie in the tensor (the decoder checks)."""
    n = positions.shape[0]
    s = _U64(seed)
    a = _U64(0)
    b = _U64(0)
    for j in range(n):
        if j + SCATTER_AHEAD < n:  # the line written SCATTER_AHEAD changes later, as scatter_logged does
            prefetch_l2(words, _mapped(positions[j + SCATTER_AHEAD], base, cstr, dstr))
        p = positions[j]
        dst = _mapped(p, base, cstr, dstr)
        o = words[dst]
        undo[j] = o
        words[dst] = values[j]
        da, db = change_lanes(p, _U64(o), _U64(words[dst]), s)
        a += da
        b += db
    return a, b


@njit(nogil=True, cache=True)
def map_positions(positions, base, cstr, dstr):
    """The parameter positions of checkpoint ``positions`` (the map of :func:`scatter_mapped_logged`)."""
    n = positions.shape[0]
    out = np.empty(n, dtype=np.int64)
    for j in range(n):
        out[j] = _mapped(positions[j], base, cstr, dstr)
    return out
