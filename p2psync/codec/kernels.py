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
recomputes the buckets and turns ranks back into positions (:func:`locate`, and
:func:`locate_grouped` for sparse segments).

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
    prefetch_ahead,
    prefetch_read,
    select64,
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


# --- ranks (encoder) and positions (decoder) -----------------------------------------------
# Always three thresholds (``consts[1:4]``); a segment with fewer buckets pads with the largest
# key, whose "greater than" mask is empty, so the loops stay branch-free and unrolled.
@njit(nogil=True, cache=True)
def _gt3_tail(old, blk, cnt, consts):
    km = consts[0]
    return gt_mask_tail(old, blk, cnt, km, consts[1]), gt_mask_tail(old, blk, cnt, km, consts[2]), \
        gt_mask_tail(old, blk, cnt, km, consts[3])


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
            g1, g2, g3 = _gt3_tail(old, blk, end - blk, consts)
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


@njit(nogil=True, cache=True)
def locate(old, start, stop, consts, counts, ranks, pos_out, old_out):
    """Inverse of :func:`rank_changes`. ``ranks`` holds each bucket's sorted ranks, bucket after
    bucket (``counts``: 4 buckets); the matching positions go to the same slots of ``pos_out``, and
    their base words (read while the block is in L1) to ``old_out``.
    Returns how many were found: fewer than ``len(ranks)`` means the ranks do not fit this base.

    The per-bucket state lives in scalars, not arrays, so that it stays in registers (the
    output stores could alias an array), and the k-th element of a bucket's mask is found with
    :func:`~p2psync.codec.simd.select64` (``pdep`` where it is fast).

    Dense fast path (learning rates that change most elements): when every element of a bucket
    in the block is wanted (the next rank is the bucket's first in the block and the rank
    ``count - 1`` slots on is its last: ranks strictly increase, so those two decide), the
    positions are the mask's set bits in order, with no select each (~30 % less time for the tiny
    model's delta at lr 1e-2). The check is written out per bucket: an inlined helper made the
    loop 2x slower (measured)."""
    total = ranks.shape[0]
    if total == 0:
        return 0
    span = stop - start
    e0 = counts[0]  # end slot of each bucket's ranks
    e1 = e0 + counts[1]
    e2 = e1 + counts[2]
    e3 = e2 + counts[3]
    n0 = 0  # next slot of each bucket
    n1 = e0
    n2 = e1
    n3 = e2
    w0 = ranks[n0] if n0 < e0 else span  # next rank wanted (span: none)
    w1 = ranks[n1] if n1 < e1 else span
    w2 = ranks[n2] if n2 < e2 else span
    w3 = ranks[n3] if n3 < e3 else span
    c0 = 0  # elements of each bucket before the block
    c1 = 0
    c2 = 0
    c3 = 0
    km = consts[0]
    t1 = consts[1]
    t2 = consts[2]
    t3 = consts[3]
    blk = start
    while blk < stop:
        if blk + 64 <= stop:
            prefetch_ahead(old, blk)
            g0 = ~_U64(0)
            g1 = gt_mask64(old, blk, km, t1)
            g2 = gt_mask64(old, blk, km, t2)
            g3 = gt_mask64(old, blk, km, t3)
        else:
            g0 = low_bits(stop - blk)
            g1, g2, g3 = _gt3_tail(old, blk, stop - blk, consts)
        bm = g0 & ~g1
        top = c0 + np.int64(popcount64(bm))
        cnt = top - c0
        if w0 == c0 and cnt > 0 and n0 + cnt <= e0 and ranks[n0 + cnt - 1] == top - 1:
            m = bm  # dense: every element of the bucket in the block is wanted
            while m:
                p = blk + np.int64(ctz64(m))
                pos_out[n0] = p
                old_out[n0] = old[p]
                n0 += 1
                m &= m - _ONE
            w0 = ranks[n0] if n0 < e0 else span
        while w0 < top:
            p = blk + select64(bm, w0 - c0)
            pos_out[n0] = p
            old_out[n0] = old[p]
            n0 += 1
            w0 = ranks[n0] if n0 < e0 else span
        c0 = top
        bm = g1 & ~g2
        top = c1 + np.int64(popcount64(bm))
        cnt = top - c1
        if w1 == c1 and cnt > 0 and n1 + cnt <= e1 and ranks[n1 + cnt - 1] == top - 1:
            m = bm  # dense: every element of the bucket in the block is wanted
            while m:
                p = blk + np.int64(ctz64(m))
                pos_out[n1] = p
                old_out[n1] = old[p]
                n1 += 1
                m &= m - _ONE
            w1 = ranks[n1] if n1 < e1 else span
        while w1 < top:
            p = blk + select64(bm, w1 - c1)
            pos_out[n1] = p
            old_out[n1] = old[p]
            n1 += 1
            w1 = ranks[n1] if n1 < e1 else span
        c1 = top
        bm = g2 & ~g3
        top = c2 + np.int64(popcount64(bm))
        cnt = top - c2
        if w2 == c2 and cnt > 0 and n2 + cnt <= e2 and ranks[n2 + cnt - 1] == top - 1:
            m = bm  # dense: every element of the bucket in the block is wanted
            while m:
                p = blk + np.int64(ctz64(m))
                pos_out[n2] = p
                old_out[n2] = old[p]
                n2 += 1
                m &= m - _ONE
            w2 = ranks[n2] if n2 < e2 else span
        while w2 < top:
            p = blk + select64(bm, w2 - c2)
            pos_out[n2] = p
            old_out[n2] = old[p]
            n2 += 1
            w2 = ranks[n2] if n2 < e2 else span
        c2 = top
        top = c3 + np.int64(popcount64(g3))
        cnt = top - c3
        if w3 == c3 and cnt > 0 and n3 + cnt <= e3 and ranks[n3 + cnt - 1] == top - 1:
            m = g3  # dense: every element of the bucket in the block is wanted
            while m:
                p = blk + np.int64(ctz64(m))
                pos_out[n3] = p
                old_out[n3] = old[p]
                n3 += 1
                m &= m - _ONE
            w3 = ranks[n3] if n3 < e3 else span
        while w3 < top:
            p = blk + select64(g3, w3 - c3)
            pos_out[n3] = p
            old_out[n3] = old[p]
            n3 += 1
            w3 = ranks[n3] if n3 < e3 else span
        c3 = top
        blk += 64
        if n0 == e0 and n1 == e1 and n2 == e2 and n3 == e3:
            break
    return n0 + (n1 - e0) + (n2 - e1) + (n3 - e2)



GROUP_BLOCKS = 64
"""Blocks of 64 words per group of :func:`locate_grouped` (a group's running counts per bucket
are one 64-lane vector of u16)."""


@njit(nogil=True, cache=True)
def locate_grouped(old, start, stop, consts, counts, ranks, pos_out, old_out):
    """:func:`locate` (same arguments, positions, base words and count found) in two phases per
    group of :data:`GROUP_BLOCKS` blocks, with no branch per block that depends on the data.

    Phase one classifies the group's words: per block and bucket, the bucket's mask and how many
    of its elements come before and through the block. Phase two places each rank that falls in
    the group: its block is the number of blocks whose running count does not exceed it (one
    vector compare of the 64 counts and a popcount), its position the matching set bit of that
    block's mask (:func:`~p2psync.codec.simd.select64`). Each change costs the same whatever
    the blocks around it hold. :func:`locate` decides per block and bucket whether the block
    holds the bucket's next wanted element, and at RL densities (about one change per block)
    those branches go either way at random. The one data-dependent branch left here ends a
    bucket's run of ranks in a group (four per group). The placement loop is written once for
    the four buckets, over their state in small arrays: a helper function per bucket would
    take references on its array arguments on every call (atomic counts, measured ~15 %)."""
    total = ranks.shape[0]
    if total == 0:
        return 0
    G = GROUP_BLOCKS
    nxt = np.empty(4, dtype=np.int64)  # next slot of each bucket
    end = np.empty(4, dtype=np.int64)  # end slot of each bucket's ranks
    done = np.zeros(4, dtype=np.int64)  # elements of each bucket before the group
    cnt = np.empty(4, dtype=np.int64)  # ... in the group
    e = 0
    for k in range(4):
        nxt[k] = e
        e += counts[k]
        end[k] = e
    km = consts[0]
    t1 = consts[1]
    t2 = consts[2]
    t3 = consts[3]
    masks = np.empty(4 * G, dtype=np.uint64)
    before = np.empty(4 * G, dtype=np.int64)
    through = np.empty(4 * G, dtype=np.uint16)
    grp = start
    while grp < stop:
        gend = min(grp + 64 * G, stop)
        c0 = 0
        c1 = 0
        c2 = 0
        c3 = 0
        nb = 0
        blk = grp
        while blk < gend:
            if blk + 64 <= gend:
                prefetch_ahead(old, blk)
                g1 = gt_mask64(old, blk, km, t1)
                g2 = gt_mask64(old, blk, km, t2)
                g3 = gt_mask64(old, blk, km, t3)
                m0 = ~g1
            else:  # the segment's last, shorter block
                g1, g2, g3 = _gt3_tail(old, blk, gend - blk, consts)
                m0 = low_bits(gend - blk) & ~g1
            m1 = g1 & ~g2
            m2 = g2 & ~g3
            masks[nb] = m0
            masks[G + nb] = m1
            masks[2 * G + nb] = m2
            masks[3 * G + nb] = g3
            before[nb] = c0
            before[G + nb] = c1
            before[2 * G + nb] = c2
            before[3 * G + nb] = c3
            c0 += np.int64(popcount64(m0))
            c1 += np.int64(popcount64(m1))
            c2 += np.int64(popcount64(m2))
            c3 += np.int64(popcount64(g3))
            through[nb] = c0
            through[G + nb] = c1
            through[2 * G + nb] = c2
            through[3 * G + nb] = c3
            nb += 1
            blk += 64
        for b in range(nb, G):  # a short group: blocks past its end hold nothing
            through[b] = c0
            through[G + b] = c1
            through[2 * G + b] = c2
            through[3 * G + b] = c3
        cnt[0] = c0
        cnt[1] = c1
        cnt[2] = c2
        cnt[3] = c3
        left = 0
        for k in range(4):
            n = nxt[k]
            stop_n = end[k]
            base = done[k]
            last = base + cnt[k]
            off = k * G
            while n < stop_n:
                r = ranks[n]
                if r >= last:
                    break
                loc = r - base
                # the block holding the bucket's element ``loc``: blocks whose running count is <= loc
                b = off + np.int64(popcount64(~gt_mask64(through, off, np.uint16(0xFFFF), np.uint16(loc))))
                p = grp + (b - off) * 64 + select64(masks[b], loc - before[b])
                pos_out[n] = p
                old_out[n] = old[p]
                n += 1
            nxt[k] = n
            done[k] = last
            left += stop_n - n
        grp = gend
        if left == 0:
            break
    return nxt[0] + (nxt[1] - end[0]) + (nxt[2] - end[1]) + (nxt[3] - end[2])
