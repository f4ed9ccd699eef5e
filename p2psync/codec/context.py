"""Choosing a segment's magnitude buckets (the context of its position code).

An element changes under a small update when its fp32 master crosses a bf16
rounding boundary: probability about ``lr / ULP(w)``, and the ULP doubles with
every exponent step, so the base value's exponent predicts the chance of a
change. The receiver holds the base values, so this context costs no bytes.

The encoder splits the exponent axis into at most ``max_buckets`` contiguous
ranges by dynamic programming on the binary entropy of "changed" per range
(``sum_b N_b H(C_b / N_b)`` plus a per-bucket header cost), with exact change
counts ``C_e`` and element counts ``N_e`` estimated from a fixed sample of the
segment's blocks (:func:`p2psync.codec.kernels.exponent_sample`). The choice is a
pure function of the base words and the changed positions of the segment, so the
CPU scan and the sparse path produce identical bytes. The decoder does not
repeat it: the thresholds travel in the segment header.

On the 101M-parameter benchmark workload (lr 1e-6), 4 buckets cost ~0.2 bits per
change more than one context per exponent (5.4 vs 5.2 bits; 8 buckets would save
another 0.15 at twice the compares per block); a single bucket (context-free
positions) ~7.7 bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec import kernels
from p2psync.dtypes import DType

_BUCKET_BITS = 56.0
"""Header cost of one more bucket: a u16 threshold, a u32 count and a u8 Rice parameter."""
_MAX_CANDIDATES = 96
_MIN_CHANGES = 64
"""Below this many changes a segment uses one bucket: headers would cost more than context saves."""


def key_mask(d: DType) -> int:
    """The word without its sign bit: exponent and mantissa fields."""
    return (d.exp_mask << d.exp_shift) | ((1 << d.exp_shift) - 1)


def consts_for(d: DType, thresholds: list[int] | np.ndarray) -> np.ndarray:
    """Kernel constants: key mask, then ``(e << shift) - 1`` per threshold exponent ``e``, padded
    to three thresholds with the key mask (no key is greater: the padding buckets stay empty)."""
    vals = [key_mask(d)] + [(int(e) << d.exp_shift) - 1 for e in thresholds]
    vals += [key_mask(d)] * (4 - len(vals))
    return np.array(vals, dtype=d.word)


def exponents(d: DType, words: np.ndarray) -> np.ndarray:
    """Exponent field of each word (int64); all zero for integer dtypes."""
    if d.exp_mask == 0:
        return np.zeros(words.shape[0], dtype=np.int64)
    return ((words >> d.word.type(d.exp_shift)) & d.word.type(d.exp_mask)).astype(np.int64)


@njit(nogil=True, cache=True)
def _group_cost(n, c):
    if c <= 0.0 or c >= n:
        return 0.0
    return c * np.log2(n / c) + (n - c) * np.log2(n / (n - c))


@njit(nogil=True, cache=True)
def _split(ns, cs, max_groups, penalty, starts_out):
    """Optimal split of the candidate axis into <= ``max_groups`` contiguous groups; writes the
    first candidate index of every group but the first, returns how many it wrote."""
    e = ns.shape[0]
    cn = np.zeros(e + 1)
    cc = np.zeros(e + 1)
    for i in range(e):
        cn[i + 1] = cn[i] + ns[i]
        cc[i + 1] = cc[i] + cs[i]
    g = min(max_groups, e)
    inf = 1e300
    dp = np.full((g + 1, e + 1), inf)
    arg = np.zeros((g + 1, e + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    for k in range(1, g + 1):
        for b in range(k, e + 1):
            best = inf
            besta = k - 1
            for a in range(k - 1, b):
                if dp[k - 1, a] >= inf:
                    continue
                v = dp[k - 1, a] + _group_cost(cn[b] - cn[a], cc[b] - cc[a])
                if v < best:
                    best = v
                    besta = a
            dp[k, b] = best
            arg[k, b] = besta
    best_k = 1
    for k in range(2, g + 1):
        if dp[k, e] + k * penalty < dp[best_k, e] + best_k * penalty:
            best_k = k
    b = e
    for k in range(best_k, 1, -1):
        a = arg[k, b]
        starts_out[k - 2] = a
        b = a
    return best_k - 1


def choose_thresholds(d: DType, old: np.ndarray, start: int, stop: int, change_hist: np.ndarray,
                      max_buckets: int) -> np.ndarray:
    """Threshold exponents (strictly increasing, each in ``1..exp_mask``) of a segment's buckets.

    ``change_hist``: histogram of the base words' exponents over the changes in ``[start, stop)``."""
    n = int(change_hist.sum())
    if d.exp_mask == 0 or max_buckets <= 1 or n < _MIN_CHANGES:
        return np.zeros(0, dtype=np.int64)
    width = d.exp_mask + 1
    hist = np.zeros(width, dtype=np.int64)
    counted = kernels.exponent_sample(old, start, stop, d.exp_shift, d.exp_mask, hist)
    c = change_hist.astype(np.float64)
    nn = np.maximum(hist * ((stop - start) / max(1, counted)), c)
    cand = np.flatnonzero(nn > 0)
    if cand.shape[0] <= 1:
        return np.zeros(0, dtype=np.int64)
    ns, cs = nn[cand], c[cand]
    if cand.shape[0] > _MAX_CANDIDATES:  # coarsen (many exponents: unusual, e.g. random bits)
        edges = np.linspace(0, cand.shape[0], _MAX_CANDIDATES + 1).astype(np.int64)[:-1]
        ns, cs, cand = np.add.reduceat(ns, edges), np.add.reduceat(cs, edges), cand[edges]
    starts = np.zeros(max_buckets, dtype=np.int64)
    k = _split(ns, cs, max_buckets, _BUCKET_BITS, starts)
    return cand[starts[:k]].astype(np.int64)
