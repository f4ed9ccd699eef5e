"""Compiled loops of the codec (numba, ``nogil`` so threads scale).

Per-element passes work on blocks of 64 words through the bit-mask primitives
of :mod:`p2psync.codec.simd` (one vector compare per block instead of a branch
per word); everything else touches only changed elements. The passes stream
hundreds of MB and are bound by memory bandwidth, which a second thread does not
add to on a small VM: each asks for its data 16 KiB ahead
(:func:`~p2psync.codec.simd.prefetch_ahead`), and the encoder finds and ranks the
changes in one pass over the base and new words (:func:`find_ranked_changes`).

Context (see ``sparse`` and ``context``): a float word's *key* is the word
without its sign bit; up to three thresholds ``t_1 < t_2 < t_3`` (keys whose
exponent field reaches ``e_k``: ``t_k = (e_k << shift) - 1``) split the elements
of a segment into magnitude buckets, ``bucket(w) = #{k : key(w) > t_k}``. A
change is coded by its bucket and its *rank*, the number of elements of the same
bucket before it in the segment. The receiver holds the base words, so it
recomputes the buckets and turns ranks back into positions
(:mod:`p2psync.codec.positions`).

``consts`` arrays carry the key mask at index 0 and the three thresholds after
it, in the word type of the tensor (``context.consts_for``; missing thresholds
are the key mask itself, which no key exceeds).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec.simd import (
    ctz64,
    gt3_tail,
    gt_mask64,
    ne_mask64,
    ne_mask_tail,
    popcount64,
    prefetch_ahead,
    prefetch_read,
)
from p2psync.wordops import (  # the element hashes and the scatter the model state uses
    _GOLD,
    _S32,
    _U64,
    _mix64,
    change_lanes,
    hash_change,
    hash_range,
    hash_sparse,
    in_range,
    scatter,
)

_ONE = np.uint64(1)
SAMPLE_BLOCKS = 256
"""Exponent histograms for choosing thresholds look at about this many blocks of 64 per segment."""



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
def group_by_bucket(bucket, rank, zres, exps, counts_out, ranks_out, zres_out, exps_out):
    """Stable counting sort of the changes by bucket (4 buckets); the changes per bucket go to
    ``counts_out``."""
    counts_out[:] = 0
    for j in range(bucket.shape[0]):
        counts_out[bucket[j]] += 1
    off = np.zeros(4, dtype=np.int64)
    for b in range(1, 4):
        off[b] = off[b - 1] + counts_out[b - 1]
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
    words there (still in L1) to ``old_out``/``new_out``; returns the new count. The first one is
    written unconditionally (an empty block writes a dummy that the next block overwrites), so
    the outputs need a slot of slack. One, not more: at RL densities a block holds about one
    change, and every unconditional write costs all the empty blocks (8 made the pass 1.5x
    slower than 1, measured on the benchmark workload)."""
    c = np.int64(popcount64(m))
    p = base + np.int64(ctz64(m) & _U64(63))
    pos_out[n] = p
    old_out[n] = old[p]
    new_out[n] = new[p]
    m &= m - _ONE
    t = 1
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
            prefetch_ahead(old, i)
            prefetch_ahead(new, i)
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
    returns the number of words counted. ``hist`` is zeroed first.

    The sampled blocks lie far apart, so each would wait for memory: the block 8 samples ahead is
    prefetched (about half the time over the benchmark model's jobs), and the counts go to four
    histograms in turn (neighbouring words usually share an exponent, and one counter would chain
    them through memory)."""
    hist[:] = 0
    width = hist.shape[0]
    h4 = np.zeros(4 * width, dtype=np.int64)
    nblocks = (stop - start + 63) // 64
    step = max(1, nblocks // SAMPLE_BLOCKS)
    sh = _U64(shift)
    mk = _U64(mask)
    lines = old.itemsize  # 64-byte lines in a block of 64 words
    per_line = 64 // old.itemsize
    for blk in range(0, min(nblocks, 8 * step), step):
        for ln in range(lines):
            prefetch_read(old, start + blk * 64 + ln * per_line)
    counted = 0
    for blk in range(0, nblocks, step):
        a = start + blk * 64
        b = min(stop, a + 64)
        ahead = a + 8 * step * 64
        for ln in range(lines):
            prefetch_read(old, ahead + ln * per_line)
        for i in range(a, b):
            h4[((i & 3) * width) + np.int64((_U64(old[i]) >> sh) & mk)] += 1
        counted += b - a
    for e in range(width):
        hist[e] = h4[e] + h4[width + e] + h4[2 * width + e] + h4[3 * width + e]
    return counted


CHANGE_SAMPLE_STRIDE = 16
"""The bucket thresholds of a job use the changes in every 16th block of 64 (see ``context``)."""


@njit(nogil=True, cache=True)
def sampled_elements(start, stop):
    """How many elements the sampled blocks of ``[start, stop)`` hold."""
    span = stop - start
    step = 64 * CHANGE_SAMPLE_STRIDE
    full = span // step  # sampled blocks that start before the last partial stride
    rest = span - full * step
    return full * 64 + min(64, rest)


@njit(nogil=True, cache=True)
def change_sample(old, new, start, stop, shift, mask, hist):
    """Histogram of the base words' exponent fields over the changes in every
    ``CHANGE_SAMPLE_STRIDE``-th block of 64 of ``[start, stop)`` (``hist`` is zeroed first)."""
    hist[:] = 0
    sh = _U64(shift)
    mk = _U64(mask)
    blk = start
    while blk < stop:
        if blk + 64 <= stop:
            # the sampled blocks are 16 apart: ask for them 16 KiB ahead (a third less time over
            # the benchmark model's jobs)
            prefetch_ahead(old, blk)
            prefetch_ahead(new, blk)
            m = ne_mask64(old, new, blk)
        else:
            m = ne_mask_tail(old, new, blk, stop - blk)
        while m:
            p = blk + np.int64(ctz64(m))
            hist[(_U64(old[p]) >> sh) & mk] += 1
            m &= m - _ONE
        blk += 64 * CHANGE_SAMPLE_STRIDE


@njit(nogil=True, cache=True)
def cut_sample(old, new, lo, hi, cuts, stride, out):
    """Changes in the sampled elements (the first 64 of every ``stride`` from the array's start) of
    ``[lo, hi)``, per interval that the sorted offsets ``cuts`` make of it (``out``: one more than
    ``cuts``, zeroed first). For ``p2psync.codec.slices.pieces``."""
    out[:] = 0
    k = 0
    nc = cuts.shape[0]
    per_line = 64 // old.itemsize
    blk = (lo // stride) * stride
    while blk < hi:
        # Each sampled block is a few lines ``stride`` words from the last: ask for them 16 blocks
        # ahead, or each waits for memory.
        ahead = blk + 16 * stride
        for ln in range(0, 64, per_line):
            prefetch_read(old, ahead + ln)
            prefetch_read(new, ahead + ln)
        for p in range(max(blk, lo), min(blk + 64, hi)):
            if old[p] != new[p]:
                while k < nc and p >= cuts[k]:
                    k += 1
                out[k] += 1
        blk += stride


@njit(nogil=True, cache=True)
def cut_sample_sparse(positions, offset, lo, hi, cuts, stride, out):
    """:func:`cut_sample` from the sorted changed ``positions`` of an array that starts at element
    ``offset`` of its tensor (the sample is the tensor's; ``lo``, ``hi``, ``cuts`` in positions)."""
    out[:] = 0
    k = 0
    nc = cuts.shape[0]
    for j in range(positions.shape[0]):
        p = positions[j]
        if p < lo or p >= hi or (offset + p) % stride >= 64:
            continue
        while k < nc and p >= cuts[k]:
            k += 1
        out[k] += 1


@njit(nogil=True, cache=True)
def change_sample_sparse(old, positions, start, stop, shift, mask, hist):
    """:func:`change_sample` from the sorted changed ``positions`` (those outside ``[start, stop)``
    are ignored)."""
    hist[:] = 0
    sh = _U64(shift)
    mk = _U64(mask)
    for j in range(positions.shape[0]):
        p = positions[j]
        if p >= start and p < stop and ((p - start) >> 6) % CHANGE_SAMPLE_STRIDE == 0:
            hist[(_U64(old[p]) >> sh) & mk] += 1


# --- ranks (encoder; the decoder's inverse is :mod:`p2psync.codec.positions`) ----------------
# Always three thresholds (``consts[1:4]``); a segment with fewer buckets pads with the largest
# key, whose "greater than" mask is empty, so the loops stay branch-free and unrolled.
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
    km = consts[0]
    t1 = consts[1]
    t2 = consts[2]
    t3 = consts[3]
    end = positions[n - 1] + 1
    j = 0
    blk = start
    while j < n:
        if blk + 64 <= end:
            cnt = 64
            prefetch_ahead(old, blk)
            g1 = gt_mask64(old, blk, km, t1)
            g2 = gt_mask64(old, blk, km, t2)
            g3 = gt_mask64(old, blk, km, t3)
        else:
            cnt = end - blk
            g1, g2, g3 = gt3_tail(old, blk, cnt, consts)
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
            # Rank within bucket b = a1 + a2 + a3: above t_b but not above t_(b+1), i.e.
            # k_b - k_(b+1) (k_4 = 0). The buckets nest (a1 >= a2 >= a3), so this selects
            # without a branch.
            lo = k0 + a1 * (k1 - k0) + a2 * (k2 - k1) + a3 * (k3 - k2)
            hi = k1 + a1 * (k2 - k1) + a2 * (k3 - k2) - a3 * k3
            rank_out[j] = lo - hi
            bucket_out[j] = a1 + a2 + a3
            j += 1
        c0 += cnt
        c1 += np.int64(popcount64(g1))
        c2 += np.int64(popcount64(g2))
        c3 += np.int64(popcount64(g3))
        blk += 64


@njit(nogil=True, cache=True)
def find_ranked_changes(old, new, start, end, cap, consts, pos_out, old_out, new_out, bucket_out, rank_out):
    """:func:`find_changes` and :func:`rank_changes` in one pass: the base block that the change
    mask was computed from is compared with the thresholds while it is in registers, so the
    encoder reads the base words once. Ranks count from ``start``; the outputs hold ``cap + 64``
    slots. Returns ``(stop, n)`` like :func:`find_changes`."""
    km = consts[0]
    t1 = consts[1]
    t2 = consts[2]
    t3 = consts[3]
    c1 = 0  # keys above t1 in [start, blk), ...
    c2 = 0
    c3 = 0
    n = 0
    blk = start
    while blk < end:
        if blk + 64 <= end:
            prefetch_ahead(old, blk)
            prefetch_ahead(new, blk)
            m = ne_mask64(old, new, blk)
            g1 = gt_mask64(old, blk, km, t1)
            g2 = gt_mask64(old, blk, km, t2)
            g3 = gt_mask64(old, blk, km, t3)
        else:
            m = ne_mask_tail(old, new, blk, end - blk)
            g1, g2, g3 = gt3_tail(old, blk, end - blk, consts)
        c0 = blk - start
        while m:
            off = ctz64(m)
            p = blk + np.int64(off)
            below = (_ONE << off) - _ONE
            a1 = np.int64((g1 >> off) & _ONE)
            a2 = np.int64((g2 >> off) & _ONE)
            a3 = np.int64((g3 >> off) & _ONE)
            k0 = c0 + np.int64(off)
            k1 = c1 + np.int64(popcount64(g1 & below))
            k2 = c2 + np.int64(popcount64(g2 & below))
            k3 = c3 + np.int64(popcount64(g3 & below))
            # as in rank_changes: k_b - k_(b+1) for b = a1 + a2 + a3, without a branch
            lo = k0 + a1 * (k1 - k0) + a2 * (k2 - k1) + a3 * (k3 - k2)
            hi = k1 + a1 * (k2 - k1) + a2 * (k3 - k2) - a3 * k3
            pos_out[n] = p
            old_out[n] = old[p]
            new_out[n] = new[p]
            rank_out[n] = lo - hi
            bucket_out[n] = a1 + a2 + a3
            n += 1
            m &= m - _ONE
        if n > cap:
            return pos_out[cap], cap
        c1 += np.int64(popcount64(g1))
        c2 += np.int64(popcount64(g2))
        c3 += np.int64(popcount64(g3))
        blk += 64
    return end, n
