"""Compiled passes of the placement probe: reading a probe back, factoring its runs into a block.

Deriving a placement (:mod:`rollout.engines.vllm.placement.probe`) reads back every
probe the loader wrote into (tens of millions of words for an embedding or a
layer's experts): :func:`runs` as maximal runs contiguous on both sides, or
:func:`scan` by scattering each id to where it landed where there are too many
runs (:mod:`rollout.engines.vllm.placement.readback`); :func:`factor` finds the strided
block of a tensor's runs (:func:`rollout.engines.vllm.placement.boxes.compress_runs`).
These loops read each word once and allocate nothing the size of the input.

:func:`rollout.engines.vllm.worker.warm.exercise` calls :func:`warm`, so ``p2psync
warm`` and an engine's warm-up compile them before the first placement is
derived.
"""

from __future__ import annotations

import numpy as np
from numba import njit

OK = -1
"""Returned by :func:`scan` in place of a position when nothing was wrong."""


@njit(nogil=True, cache=True, inline="always")
def _element(x, total):
    """The element (from 0) of probe word ``x``: -1 for a word no element was copied to (0), -2 for
    a word that is not an id ``1 .. total`` (negative, fractional, too large, NaN: computed)."""
    if x == 0.0:
        return np.int64(-1)
    i = np.int64(x)
    if not (x >= 1.0) or np.float64(i) != np.float64(x) or i > total:
        return np.int64(-2)
    return i - 1


@njit(nogil=True, cache=True)
def scan(v, total, inv, seen):
    """Record where each element id of probe ``v`` landed: for every word ``v[p] != 0`` (an id
    ``1 .. total`` the loader copied there; 0 is a word it left alone or zeroed, as vLLM does a
    padded vocabulary's rows), ``inv[id - 1] = p`` and ``seen[id - 1] = 1``. ``seen`` starts at 0;
    ``inv`` is only read where ``seen`` is set.

    Returns ``(hits, bad, dup)``: the ids found; the first position holding a word that is not an
    id (the loader computed it), else :data:`OK`; the first element (id less one) found twice (the
    loader wrote it twice), else :data:`OK`. It stops at the first ``bad`` or ``dup``."""
    hits = 0
    for p in range(v.shape[0]):
        i = _element(v[p], total)
        if i == -1:
            continue
        if i == -2:
            return hits, p, OK
        if seen[i] != 0:
            return hits, OK, i
        inv[i] = p
        seen[i] = 1
        hits += 1
    return hits, OK, OK


_BLOCK = 512
"""Words :func:`runs` looks at together: all zero, or all continuing the open run, they are taken
in one vectorised pass (the untouched experts of a probe, the body of a tensor copied whole)."""


@njit(nogil=True, cache=True)
def runs(v, total, p0, i0, ln):
    """The words of probe ``v`` as maximal runs contiguous on both sides: run ``r`` holds ids
    ``i0[r] + 1 .. i0[r] + ln[r]`` (less one: element ids from 0) at positions ``p0[r] ..``,
    in position order; words 0 are skipped, as in :func:`scan`.

    Returns ``(n, bad)``: the runs found, or -1 when there are more than ``p0`` has room for (the
    caller scatters instead); the first position holding a word that is not an id, else
    :data:`OK`. A load that copies blocks (fused shards, experts, tensor-parallel slices) gives a
    few runs per tensor, so the probe is read once and nothing the size of the layer is written."""
    n = 0
    cap = p0.shape[0]
    last_p = -2
    last_i = np.int64(-2)
    size = v.shape[0]
    for b in range(0, size, _BLOCK):
        e = min(b + _BLOCK, size)
        nonzero = 0
        for p in range(b, e):
            nonzero += v[p] != 0.0
        if nonzero == 0:
            continue
        if last_p == b - 1 and last_i + e - b < total:  # the open run may go on through the block
            off = 0
            first = np.float64(last_i + 2 - b)  # the id expected at position p is p + first
            for p in range(b, e):
                off += np.float64(v[p]) != p + first
            if off == 0:
                ln[n - 1] += e - b
                last_p = e - 1
                last_i += e - b
                continue
        for p in range(b, e):
            i = _element(v[p], total)
            if i == -1:
                continue
            if i == -2:
                return n, p
            if p == last_p + 1 and i == last_i + 1:
                ln[n - 1] += 1
            else:
                if n == cap:
                    return -1, OK
                p0[n] = p
                i0[n] = i
                ln[n] = 1
                n += 1
            last_p = p
            last_i = i
    return n, OK


@njit(nogil=True, cache=True)
def factor(ck, dst, levels):
    """The nested arithmetic progressions of the pairs ``(ck[q], dst[q])``, innermost first, into
    ``levels`` rows ``(size, ck_step, dst_step)``.

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
        a = ck[stride] - ck[0]
        b = dst[stride] - dst[0]
        s = m
        for j in range(2, m):
            q = j * stride
            if ck[q] - ck[q - stride] != a or dst[q] - dst[q - stride] != b:
                s = j
                break
        if m % s:
            return -1
        for r in range(s, m, s):  # every later row at the first row's steps
            q0 = r * stride
            c0 = ck[q0]
            d0 = dst[q0]
            for i in range(1, s):
                q = q0 + i * stride
                if ck[q] - c0 != i * a or dst[q] - d0 != i * b:
                    return -1
        levels[nl, 0] = s
        levels[nl, 1] = a
        levels[nl, 2] = b
        nl += 1
        stride *= s
        m //= s
    return nl


def warm() -> None:
    """Compile (or load) the three loops for the array types the probe passes (``float32`` probes)."""
    v = np.array([3.0, 0.0, 1.0, 2.0], dtype=np.float32)
    scan(v, 4, np.empty(4, dtype=np.int64), np.zeros(4, dtype=np.uint8))
    runs(v, 4, np.empty(4, dtype=np.int64), np.empty(4, dtype=np.int64), np.empty(4, dtype=np.int64))
    levels = np.zeros((8, 3), dtype=np.int64)
    pos = np.arange(4, dtype=np.int64)
    factor(pos, pos, levels)
