"""Compiled per-element loops of the codec (numba, ``nogil`` so threads scale).

These are the only loops that touch every element of a tensor. Everything that
touches only changed elements stays in numpy.

Context: ``ctx(w) = (w >> shift) & mask`` (the exponent field of a float word).
For each changed position the encoder records its context and its *rank*: how
many elements of the same context precede it inside the segment. The decoder
holds the same base words, so it recomputes every context and turns the ranks
back into positions.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_U64 = np.uint64
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)


@njit(nogil=True, cache=True, inline="always")
def _mix64(z):
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(nogil=True, cache=True)
def scan_changes(old, new, start, end, shift, mask, max_changes, pos_out, ctx_out, rank_out, counts):
    """Scan ``[start, end)`` for words that differ; stop before the change that would exceed
    ``max_changes``. Returns ``(stop, n)``: the segment is ``[start, stop)`` with ``n`` changes."""
    counts[:] = 0
    n = 0
    sh = _U64(shift)
    mk = _U64(mask)
    for i in range(start, end):
        w = old[i]
        c = (_U64(w) >> sh) & mk
        if w != new[i]:
            if n == max_changes:
                return i, n
            pos_out[n] = i
            ctx_out[n] = c
            rank_out[n] = counts[c]
            n += 1
        counts[c] += 1
    return end, n


@njit(nogil=True, cache=True)
def rank_given(old, positions, start, shift, mask, ctx_out, rank_out, counts):
    """Contexts and ranks for already-known sorted ``positions`` (all >= ``start``)."""
    counts[:] = 0
    sh = _U64(shift)
    mk = _U64(mask)
    j = 0
    n = positions.shape[0]
    if n == 0:
        return
    last = positions[n - 1]
    for i in range(start, last + 1):
        c = (_U64(old[i]) >> sh) & mk
        if i == positions[j]:
            ctx_out[j] = c
            rank_out[j] = counts[c]
            j += 1
        counts[c] += 1


@njit(nogil=True, cache=True)
def scan_decode(old, start, end, shift, mask, next_rank, ranks, next_idx, end_idx, total, pos_out, counts):
    """Inverse of :func:`scan_changes`. ``ranks[next_idx[c]:end_idx[c]]`` are the sorted ranks of
    context ``c``; ``next_rank[c]`` is the first of them or -1. Returns how many positions were
    found; fewer than ``total`` means the ranks do not fit this base."""
    counts[:] = 0
    if total == 0:
        return 0
    out = 0
    sh = _U64(shift)
    mk = _U64(mask)
    for i in range(start, end):
        c = (_U64(old[i]) >> sh) & mk
        if counts[c] == next_rank[c]:
            pos_out[out] = i
            out += 1
            if out == total:
                return out
            k = next_idx[c] + 1
            next_idx[c] = k
            if k < end_idx[c]:
                next_rank[c] = ranks[k]
            else:
                next_rank[c] = -1
        counts[c] += 1
    return out


@njit(nogil=True, cache=True)
def hash_range(words, start, end, seed):
    """Two 64-bit lanes of sum over i in [start, end) of h(i, words[i]) (wrapping)."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    for i in range(start, end):
        m = _mix64(_U64(i) * _GOLD + s)
        w = _U64(words[i])
        a += _mix64(w + m)
        b += _mix64((w ^ _GOLD) + ((m << _S32) | (m >> _S32)))
    return a, b


@njit(nogil=True, cache=True)
def hash_sparse(positions, values, seed):
    """Same lanes as :func:`hash_range` over the listed positions only."""
    a = _U64(0)
    b = _U64(0)
    s = _U64(seed)
    for j in range(positions.shape[0]):
        m = _mix64(_U64(positions[j]) * _GOLD + s)
        w = _U64(values[j])
        a += _mix64(w + m)
        b += _mix64((w ^ _GOLD) + ((m << _S32) | (m >> _S32)))
    return a, b


# --- Rice coding of rank gaps ------------------------------------------------------------
# Per context group: gaps between consecutive ranks; quotient (gap >> k) in unary (ones, then a
# zero) into one stream, k low bits MSB-first into another. Bits are packed MSB-first.


@njit(nogil=True, cache=True)
def rice_plan(rank_s, starts, ends, max_k, ks_out):
    """Choose k per group (cheapest of a few around log2(mean gap)); returns (unary bits, rem bits)."""
    ubits = 0
    rbits = 0
    for g in range(starts.shape[0]):
        a = starts[g]
        b = ends[g]
        n = b - a
        total = rank_s[b - 1] - (b - a) + 1  # sum of gaps: last rank minus (n - 1) separators
        mean = total / n
        guess = 0
        while guess < max_k and (1 << (guess + 1)) <= mean + 1.0:
            guess += 1
        best_k = 0
        best = -1
        for k in range(max(0, guess - 2), min(max_k, guess + 2) + 1):
            cost = n * (k + 1)
            prev = -1
            for j in range(a, b):
                cost += (rank_s[j] - prev - 1) >> k
                prev = rank_s[j]
            if best < 0 or cost < best:
                best = cost
                best_k = k
        ks_out[g] = best_k
        ubits += best - n * best_k
        rbits += n * best_k
    return ubits, rbits


@njit(nogil=True, cache=True)
def rice_write(rank_s, starts, ends, ks, ubuf, rbuf):
    up = 0
    rp = 0
    for g in range(starts.shape[0]):
        k = ks[g]
        prev = -1
        for j in range(starts[g], ends[g]):
            gap = rank_s[j] - prev - 1
            prev = rank_s[j]
            q = gap >> k
            for _ in range(q):
                ubuf[up >> 3] |= np.uint8(0x80 >> (up & 7))
                up += 1
            up += 1  # the terminating zero
            for b in range(k - 1, -1, -1):
                if (gap >> b) & 1:
                    rbuf[rp >> 3] |= np.uint8(0x80 >> (rp & 7))
                rp += 1


@njit(nogil=True, cache=True)
def rice_read(ubuf, rbuf, counts, ks, span, ranks_out):
    """Inverse of :func:`rice_write`. Returns 0, or a negative code if the streams are malformed."""
    up = 0
    rp = 0
    ulen = ubuf.shape[0] * 8
    rlen = rbuf.shape[0] * 8
    o = 0
    for g in range(counts.shape[0]):
        k = ks[g]
        r = -1
        for _ in range(counts[g]):
            q = 0
            while True:
                if up >= ulen:
                    return -1
                bit = (ubuf[up >> 3] >> (7 - (up & 7))) & 1
                up += 1
                if bit == 0:
                    break
                q += 1
                if q > span:
                    return -2
            if rp + k > rlen:
                return -3
            rem = 0
            for _ in range(k):
                rem = (rem << 1) | ((rbuf[rp >> 3] >> (7 - (rp & 7))) & 1)
                rp += 1
            gap = (q << k) | rem
            r += gap + 1
            if r >= span:
                return -2
            ranks_out[o] = r
            o += 1
    if (up + 7) // 8 != ubuf.shape[0] or (rp + 7) // 8 != rbuf.shape[0]:
        return -4
    return 0
