"""Compiled passes of the placement probe: reading a probe back, factoring its pairs into a block.

Deriving a placement (:mod:`rollout.engines.vllm_probe`) reads back every
probe the loader wrote into (tens of millions of ``float64`` words for an
embedding or a layer's experts) and factors each tensor's ``(checkpoint
position, parameter position)`` pairs into one strided block
(:func:`rollout.engines.vllm_placement.compress`). As numpy passes both made
a dozen temporaries the size of the probe (masks, differences, casts); these
loops read each word once and allocate nothing the size of the input.

:func:`rollout.engines.vllm_warm.exercise` calls both, so ``p2psync warm`` and
an engine's warm-up compile them before the first placement is derived.
"""

from __future__ import annotations

import numpy as np
from numba import njit

OK = -1
"""Returned by :func:`scan` in place of a position when nothing was wrong."""


@njit(nogil=True, cache=True)
def scan(v, total, inv, which, k):
    """Record where each element id of probe ``k`` landed: for every word ``v[p] >= 0`` (an id the
    loader copied there), ``inv[id] = p`` and ``which[id] = k``.

    Returns ``(hits, bad, dup)``: the ids found; the first position holding a word that is not an
    id (not an integer, or ``>= total``: the loader computed it), else :data:`OK`; the first id
    already recorded (in this probe or an earlier one: the loader wrote it twice), else :data:`OK`.
    It stops at the first ``bad`` or ``dup``."""
    hits = 0
    for p in range(v.shape[0]):
        x = v[p]
        if x < 0.0:
            continue
        i = np.int64(x)
        if np.float64(i) != x or i >= total:
            return hits, p, OK
        if inv[i] >= 0:
            return hits, OK, i
        inv[i] = p
        which[i] = k
        hits += 1
    return hits, OK, OK


@njit(nogil=True, cache=True, inline="always")
def _ck(ck, q, dense):
    return q if dense else ck[q]


@njit(nogil=True, cache=True)
def factor(ck, dst, dense, levels):
    """The nested arithmetic progressions of the pairs ``(ck[q], dst[q])`` (``dense``: ``ck[q] = q``,
    ``ck`` unused), innermost first, into ``levels`` rows ``(size, ck_step, dst_step)``.

    Level by level: the run of the first pairs at one step (the next level's elements are every
    ``size``-th pair) must repeat, at that length and those steps, over all of them. Returns the
    number of levels, or -1 when the pairs are not such a block (a run length that does not divide,
    a row off its steps, more levels than ``levels`` has rows)."""
    n = dst.shape[0]
    stride = 1  # pairs between two elements of the current level
    m = n  # elements at the current level
    nl = 0
    while m > 1:
        if nl == levels.shape[0]:
            return -1
        a = _ck(ck, stride, dense) - _ck(ck, 0, dense)
        b = dst[stride] - dst[0]
        s = m
        for j in range(2, m):
            q = j * stride
            if _ck(ck, q, dense) - _ck(ck, q - stride, dense) != a or dst[q] - dst[q - stride] != b:
                s = j
                break
        if m % s:
            return -1
        for r in range(s, m, s):  # every later row at the first row's steps
            q0 = r * stride
            c0 = _ck(ck, q0, dense)
            d0 = dst[q0]
            for i in range(1, s):
                q = q0 + i * stride
                if _ck(ck, q, dense) - c0 != i * a or dst[q] - d0 != i * b:
                    return -1
        levels[nl, 0] = s
        levels[nl, 1] = a
        levels[nl, 2] = b
        nl += 1
        stride *= s
        m //= s
    return nl


def warm() -> None:
    """Compile (or load) both loops for the array types the probe passes."""
    inv = np.full(4, -1, dtype=np.int64)
    scan(np.array([2.0, -1.0, 0.0, 1.0]), 4, inv, np.full(4, -1, dtype=np.int32), 0)
    levels = np.zeros((8, 3), dtype=np.int64)
    pos = np.arange(4, dtype=np.int64)
    factor(pos, pos, False, levels)
    factor(pos[:0], pos, True, levels)
