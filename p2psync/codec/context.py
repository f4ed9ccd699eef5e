"""Choosing a segment's magnitude buckets (the context of its position code).

An element changes under a small update when its fp32 master crosses a bf16
rounding boundary: probability about ``lr / ULP(w)``, and the ULP doubles with
every exponent step, so the base value's exponent predicts the chance of a
change. The receiver holds the base values, so this context costs no bytes.

The encoder splits the exponent axis into at most ``max_buckets`` contiguous
ranges by dynamic programming on the binary entropy of "changed" per range
(``sum_b N_b H(C_b / N_b)`` plus a per-bucket header cost). It does so once per
encoding job (an element range of at most ``segment_elements``), before looking
for the job's changes, so that one pass over the base and new words finds the
changes and ranks them (``kernels.find_ranked_changes``): change counts ``C_e``
come from the changes in every 16th block of 64 and element counts ``N_e`` from
a fixed sample of 256 blocks (``kernels.change_sample``,
``kernels.exponent_sample``). On the benchmark workload that moves a step's payload by
-0.05 to +0.12 % against exact change counts, which needed a second pass over the
base words. The choice is a pure function of the job's base words and changed
positions, so the CPU scan and the sparse path produce identical bytes. The
decoder does not repeat it: the thresholds travel in each segment header.
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
"""Below this many changes (estimated) a job uses one bucket: headers would cost more than context saves."""


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
    # cost of every group [a, b): computed once, not once per group count (the logs dominate)
    cost = np.zeros((e + 1, e + 1))
    for a in range(e):
        for b in range(a + 1, e + 1):
            cost[a, b] = _group_cost(cn[b] - cn[a], cc[b] - cc[a])
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
                v = dp[k - 1, a] + cost[a, b]
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


def choose_thresholds(d: DType, old: np.ndarray, start: int, stop: int, change_sample: np.ndarray,
                      max_buckets: int) -> np.ndarray:
    """Threshold exponents (strictly increasing, each in ``1..exp_mask``) of the buckets of every
    segment of the job ``[start, stop)``.

    ``change_sample``: histogram of the base words' exponents over the changes in the job's
    sampled blocks (:func:`~p2psync.codec.kernels.change_sample`, or
    :func:`~p2psync.codec.kernels.change_sample_sparse` from positions: the same numbers)."""
    if d.exp_mask == 0 or max_buckets <= 1:
        return np.zeros(0, dtype=np.int64)
    c = change_sample.astype(np.float64) * ((stop - start) / max(1, kernels.sampled_elements(start, stop)))
    if c.sum() < _MIN_CHANGES:
        return np.zeros(0, dtype=np.int64)
    width = d.exp_mask + 1
    hist = np.zeros(width, dtype=np.int64)
    counted = kernels.exponent_sample(old, start, stop, d.exp_shift, d.exp_mask, hist)
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


def job_thresholds(d: DType, old: np.ndarray, new: np.ndarray, start: int, stop: int, max_buckets: int) -> np.ndarray:
    """:func:`choose_thresholds` of a job from its base and new words (the scan path)."""
    if d.exp_mask == 0 or max_buckets <= 1:
        return np.zeros(0, dtype=np.int64)
    hist = np.empty(d.exp_mask + 1, dtype=np.int64)
    kernels.change_sample(old, new, start, stop, d.exp_shift, d.exp_mask, hist)
    return choose_thresholds(d, old, start, stop, hist, max_buckets)


def job_thresholds_sparse(d: DType, old: np.ndarray, positions: np.ndarray, start: int, stop: int,
                          max_buckets: int) -> np.ndarray:
    """:func:`job_thresholds` from the job's sorted changed positions (the sparse path)."""
    if d.exp_mask == 0 or max_buckets <= 1:
        return np.zeros(0, dtype=np.int64)
    hist = np.empty(d.exp_mask + 1, dtype=np.int64)
    kernels.change_sample_sparse(old, positions, start, stop, d.exp_shift, d.exp_mask, hist)
    return choose_thresholds(d, old, start, stop, hist, max_buckets)
