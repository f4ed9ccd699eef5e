"""Compiled loops of the codec (numba, ``nogil`` so threads scale).

Per-element passes work on blocks of 64 words through the bit-mask primitives
of :mod:`p2psync.codec.simd` (one vector compare per block instead of a branch
per word); everything else touches only changed elements.

Context (see ``sparse`` and ``context``): a float word's *key* is the word
without its sign bit; up to three thresholds ``t_1 < t_2 < t_3`` (keys whose
exponent field reaches ``e_k``: ``t_k = (e_k << shift) - 1``) split the elements
of a segment into magnitude buckets, ``bucket(w) = #{k : key(w) > t_k}``. A
change is coded by its bucket and its *rank*, the number of elements of the same
bucket before it in the segment. The receiver holds the base words, so it
recomputes the buckets and turns ranks back into positions (:func:`locate`).

``consts`` arrays carry the key mask at index 0 and the three thresholds after
it, in the word type of the tensor (``context.consts_for``; missing thresholds
are the key mask itself, which no key exceeds).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec.simd import (
    ctz64,
    gt_mask64,
    gt_mask_tail,
    low_bits,
    ne_mask64,
    ne_mask_tail,
    popcount64,
)

_U64 = np.uint64
_ONE = np.uint64(1)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
SAMPLE_BLOCKS = 256
"""Exponent histograms for choosing thresholds look at about this many blocks of 64 per segment."""


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


@njit(nogil=True, cache=True)
def hash_change(positions, old_values, new_values, seed):
    """Lanes of the new words minus lanes of the old words at ``positions``: what replacing
    them adds to a tensor's fingerprint sums (one pass, one position mix per change)."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    for j in range(positions.shape[0]):
        m = _mix64(_U64(positions[j]) * _GOLD + s)
        r = (m << _S32) | (m >> _S32)
        wo = _U64(old_values[j])
        wn = _U64(new_values[j])
        a += _mix64(wn + m) - _mix64(wo + m)
        b += _mix64((wn ^ _GOLD) + r) - _mix64((wo ^ _GOLD) + r)
    return a, b


@njit(nogil=True, cache=True)
def scatter(words, positions, values):
    """``words[positions] = values`` (positions already validated), ~10x numpy's fancy assignment."""
    for j in range(positions.shape[0]):
        words[positions[j]] = values[j]


# --- per-change preparation (encoder) -----------------------------------------------------
@njit(nogil=True, cache=True)
def prepare_changes(positions, old_w, new_w, shift, mask, bits, seed, zres_out, exps_out, hist_out):
    """One pass over the changes: zigzagged residual ``new - old`` (in ``bits``-bit words),
    exponent of the base word and its histogram, and the fingerprint sum change (returned)."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    sh = _U64(shift)
    mk = _U64(mask)
    top = _U64(bits - 1)
    wmask = ~_U64(0) >> _U64(64 - bits)
    hist_out[:] = 0
    for j in range(positions.shape[0]):
        p = positions[j]
        wo = _U64(old_w[j])
        wn = _U64(new_w[j])
        dlt = (wn - wo) & wmask
        neg = _U64(0) - ((dlt >> top) & _ONE)
        zres_out[j] = ((dlt << _ONE) ^ neg) & wmask
        e = (wo >> sh) & mk
        exps_out[j] = e
        hist_out[e] += 1
        m = _mix64(_U64(p) * _GOLD + s)
        r = (m << _S32) | (m >> _S32)
        a += _mix64(wn + m) - _mix64(wo + m)
        b += _mix64((wn ^ _GOLD) + r) - _mix64((wo ^ _GOLD) + r)
    return a, b


@njit(nogil=True, cache=True)
def group_by_bucket(bucket, rank, zres, exps, counts, ranks_out, zres_out, exps_out):
    """Stable counting sort of the changes by bucket (``counts`` per bucket, 4 buckets)."""
    off = np.zeros(4, dtype=np.int64)
    for b in range(1, 4):
        off[b] = off[b - 1] + counts[b - 1]
    for j in range(bucket.shape[0]):
        b = bucket[j]
        k = off[b]
        off[b] = k + 1
        ranks_out[k] = rank[j]
        zres_out[k] = zres[j]
        exps_out[k] = exps[j]


@njit(nogil=True, cache=True)
def residual_symbols(zres, exps, lut, escape, symbols_out, model_out, hist_out):
    """rANS symbol (``min(zres, escape)``) and model (``lut[exponent]``) of each change, and the
    histogram of (model, symbol) pairs (``hist_out`` shaped models x (escape + 1)); returns the
    number of escapes."""
    hist_out[:, :] = 0
    ne = 0
    for j in range(zres.shape[0]):
        z = zres[j]
        s = escape if z >= escape else np.int64(z)
        m = lut[exps[j]]
        symbols_out[j] = s
        model_out[j] = m
        hist_out[m, s] += 1
        ne += z >= escape
    return ne


# --- finding changes -----------------------------------------------------------------------
@njit(nogil=True, cache=True, inline="always")
def _emit(m, base, old, new, pos_out, old_out, new_out, n):
    """Write the positions of the set bits of ``m`` (plus ``base``) at ``pos_out[n:]``, and the
    words there (still in L1) to ``old_out``/``new_out``; returns the new count. The first 8 are
    written unconditionally (branch-free: the count of changes in a block is unpredictable), so
    the outputs need 8 slots of slack."""
    c = np.int64(popcount64(m))
    for t in range(8):
        p = base + np.int64(ctz64(m) & _U64(63))
        pos_out[n + t] = p
        old_out[n + t] = old[p]
        new_out[n + t] = new[p]
        m &= m - _ONE
    t = 8
    while m:
        p = base + np.int64(ctz64(m))
        pos_out[n + t] = p
        old_out[n + t] = old[p]
        new_out[n + t] = new[p]
        m &= m - _ONE
        t += 1
    return n + c


@njit(nogil=True, cache=True)
def _emit_tail(m, base, old, new, pos_out, old_out, new_out, n):
    """:func:`_emit` for a last, short block (reads only the words whose bits are set)."""
    while m:
        p = base + np.int64(ctz64(m))
        pos_out[n] = p
        old_out[n] = old[p]
        new_out[n] = new[p]
        m &= m - _ONE
        n += 1
    return n


@njit(nogil=True, cache=True)
def find_changes(old, new, start, end, cap, pos_out, old_out, new_out):
    """Positions of words that differ in ``[start, end)``, at most ``cap`` of them, and their old
    and new words; the outputs hold ``cap + 64`` slots.

    Returns ``(stop, n)``: ``stop`` is ``end``, or the position of the change that would
    have been number ``cap + 1`` (the segment ends before it)."""
    n = 0
    i = start
    while i < end:
        if i + 64 <= end:
            n = _emit(ne_mask64(old, new, i), i, old, new, pos_out, old_out, new_out, n)
        else:
            n = _emit_tail(ne_mask_tail(old, new, i, end - i), i, old, new, pos_out, old_out, new_out, n)
        if n > cap:
            return pos_out[cap], cap
        i += 64
    return end, n


@njit(nogil=True, cache=True)
def exponent_sample(old, start, stop, shift, mask, hist):
    """Histogram of exponent fields over every ``step``-th block of 64 in ``[start, stop)``;
    returns the number of words counted. ``hist`` is zeroed first."""
    hist[:] = 0
    nblocks = (stop - start + 63) // 64
    step = max(1, nblocks // SAMPLE_BLOCKS)
    sh = _U64(shift)
    mk = _U64(mask)
    counted = 0
    for blk in range(0, nblocks, step):
        a = start + blk * 64
        b = min(stop, a + 64)
        for i in range(a, b):
            hist[(_U64(old[i]) >> sh) & mk] += 1
        counted += b - a
    return counted


# --- ranks (encoder) and positions (decoder) -----------------------------------------------
# Always three thresholds (``consts[1:4]``); a segment with fewer buckets pads with the largest
# key, whose "greater than" mask is empty, so the loops stay branch-free and unrolled.
@njit(nogil=True, cache=True)
def _gt3_tail(old, blk, cnt, consts):
    km = consts[0]
    return gt_mask_tail(old, blk, cnt, km, consts[1]), gt_mask_tail(old, blk, cnt, km, consts[2]), \
        gt_mask_tail(old, blk, cnt, km, consts[3])


@njit(nogil=True, cache=True, inline="always")
def _select(m, j):
    """Index of the ``j``-th (from 0) set bit of ``m`` (branch-free binary search)."""
    at = _U64(0)
    jj = _U64(j)
    for half in (32, 16, 8, 4, 2, 1):
        h = _U64(half)
        c = popcount64(m & ((_ONE << h) - _ONE))
        go = _U64(jj >= c)
        jj -= c * go
        sh = h * go
        m >>= sh
        at += sh
    return np.int64(at)


@njit(nogil=True, cache=True)
def rank_changes(old, start, consts, positions, bucket_out, rank_out):
    """Bucket and rank of each change; ``positions`` sorted, all ``>= start``."""
    n = positions.shape[0]
    if n == 0:
        return
    c0 = 0  # elements before the block
    c1 = 0  # keys above t1 before the block, ...
    c2 = 0
    c3 = 0
    end = positions[n - 1] + 1
    j = 0
    blk = start
    while j < n:
        if blk + 64 <= end:
            cnt = 64
            g1 = gt_mask64(old, blk, consts[0], consts[1])
            g2 = gt_mask64(old, blk, consts[0], consts[2])
            g3 = gt_mask64(old, blk, consts[0], consts[3])
        else:
            cnt = end - blk
            g1, g2, g3 = _gt3_tail(old, blk, cnt, consts)
        lim = blk + 64
        while j < n and positions[j] < lim:
            off = _U64(positions[j] - blk)
            below = (_ONE << off) - _ONE
            a1 = np.int64((g1 >> off) & _ONE)
            a2 = np.int64((g2 >> off) & _ONE)
            a3 = np.int64((g3 >> off) & _ONE)
            # elements before it with key above t_k, for k = 0 (all) .. 3
            k0 = c0 + np.int64(off)
            k1 = c1 + np.int64(popcount64(g1 & below))
            k2 = c2 + np.int64(popcount64(g2 & below))
            k3 = c3 + np.int64(popcount64(g3 & below))
            b = a1 + a2 + a3
            # rank within bucket b: above t_b but not above t_(b+1)
            lo = k0 if b == 0 else (k1 if b == 1 else (k2 if b == 2 else k3))
            hi = k1 if b == 0 else (k2 if b == 1 else (k3 if b == 2 else 0))
            rank_out[j] = lo - hi
            bucket_out[j] = b
            j += 1
        c0 += cnt
        c1 += np.int64(popcount64(g1))
        c2 += np.int64(popcount64(g2))
        c3 += np.int64(popcount64(g3))
        blk += 64


@njit(nogil=True, cache=True)
def locate(old, start, stop, consts, counts, ranks, pos_out, old_out):
    """Inverse of :func:`rank_changes`. ``ranks`` holds each bucket's sorted ranks, bucket after
    bucket (``counts``: 4 buckets); the matching positions go to the same slots of ``pos_out``, and
    their base words (read while the block is in L1) to ``old_out``.
    Returns how many were found: fewer than ``len(ranks)`` means the ranks do not fit this base."""
    total = ranks.shape[0]
    if total == 0:
        return 0
    nxt = np.zeros(4, dtype=np.int64)  # next slot per bucket
    end = np.zeros(4, dtype=np.int64)
    want = np.full(4, stop - start, dtype=np.int64)  # next rank wanted per bucket (span: none)
    cum = np.zeros(4, dtype=np.int64)  # elements of each bucket before the block
    off = 0
    for b in range(4):
        nxt[b] = off
        off += counts[b]
        end[b] = off
        if counts[b] > 0:
            want[b] = ranks[nxt[b]]
    found = 0
    blk = start
    while blk < stop:
        if blk + 64 <= stop:
            g0 = ~_U64(0)
            g1 = gt_mask64(old, blk, consts[0], consts[1])
            g2 = gt_mask64(old, blk, consts[0], consts[2])
            g3 = gt_mask64(old, blk, consts[0], consts[3])
        else:
            g0 = low_bits(stop - blk)
            g1, g2, g3 = _gt3_tail(old, blk, stop - blk, consts)
        for b in range(4):
            if b == 0:
                bm = g0 & ~g1
            elif b == 1:
                bm = g1 & ~g2
            elif b == 2:
                bm = g2 & ~g3
            else:
                bm = g3
            top = cum[b] + np.int64(popcount64(bm))
            while want[b] < top:
                p = blk + _select(bm, want[b] - cum[b])
                pos_out[nxt[b]] = p
                old_out[nxt[b]] = old[p]
                found += 1
                k = nxt[b] + 1
                nxt[b] = k
                want[b] = ranks[k] if k < end[b] else stop - start
            cum[b] = top
        if found == total:
            break
        blk += 64
    return found
