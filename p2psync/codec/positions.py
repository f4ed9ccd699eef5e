"""Ranks back to positions: the decoder's pass over the base words (numba, ``nogil``).

A delta segment codes each change by its magnitude bucket and its rank among the
elements of that bucket (:mod:`p2psync.codec.kernels`, whose
:func:`~p2psync.codec.kernels.rank_changes` is the encoder's side). The receiver
holds the same base words, so it recomputes every element's bucket, 64 words at a
time through the bit masks of :mod:`p2psync.codec.simd`, and finds the element of
each rank: :func:`locate` walks the blocks with running counts per bucket (cheap
where most blocks hold a change), :func:`locate_grouped` counts whole groups of
blocks first and looks inside a group only where it holds a rank (a fixed cost per
change: sparse segments). Both give the positions in the slots of their ranks and
gather the base words there, which the residual decoder reads next.

``consts``: the key mask at index 0 and three thresholds after it, in the tensor's
word type (``context.consts_for``; missing thresholds are the key mask itself).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec.simd import ctz64, gt3_tail, gt_mask64, low_bits, popcount64, prefetch_ahead, select64

_ONE = np.uint64(1)
_U64 = np.uint64


@njit(nogil=True, cache=True)
def locate(old, start, stop, consts, counts, ranks, pos_out, old_out):
    """Inverse of :func:`~p2psync.codec.kernels.rank_changes`. ``ranks`` holds each bucket's
    sorted ranks, bucket after bucket (``counts``: 4 buckets); the matching positions go to the
    same slots of ``pos_out``, and their base words (read while the block is in L1) to ``old_out``.
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
            g1, g2, g3 = gt3_tail(old, blk, stop - blk, consts)
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
                g1, g2, g3 = gt3_tail(old, blk, gend - blk, consts)
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
