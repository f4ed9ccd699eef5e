"""The bit writers of the fused segment encoder (:mod:`p2psync.codec.segencode`), numba ``nogil``.

Same streams as the reference writers :func:`p2psync.codec.rice.write` and
``rans._encode`` (tests hold them to the same bytes), written faster:

- Rice codes go out as one 8-byte big-endian store per code, overlapping the next, and the
  writer advances by whole bytes: no branch per code (~3.5 ns per change). One loop over
  a bucket's gaps prices all three candidate parameters (:func:`rice_plan`).
- rANS divides by a symbol's frequency with a precomputed reciprocal (ryg_rans's
  ``RansEncSymbol``: exact for states below 2**31, which byte-wise renormalisation never
  leaves): the state's dependency chain is two multiplies, not a division (~3.8 ns per change).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec import rans, rice
from p2psync.codec.simd import store_be64

_U64 = np.uint64
_ONE = np.uint64(1)
_W32 = np.uint64(0xFFFFFFFF)
_L = 1 << 23


@njit(nogil=True, cache=True, inline="always")
def _put(acc, nb, value, length):
    """One step of an MSB-first bit writer: ``acc`` holds ``nb`` (< 8) pending bits at its top;
    append the ``length`` (1..56) bits of ``value``. The caller then stores ``acc`` whole
    (:func:`~p2psync.codec.simd.store_be64`) and moves on by its complete bytes (no branch: the
    stores overlap, and bits past the stream are zero). Scalars only: an inlined helper that takes
    an array costs reference counting per call."""
    return acc | (value << _U64(64 - nb - length)), nb + length


@njit(nogil=True, cache=True)
def rice_plan(ranks, starts, ends, ks_out):
    """``rice.plan`` (same choice of ``k`` per group, same bit counts), pricing the up to three
    candidate parameters in one loop over the gaps."""
    ubits = 0
    rbits = 0
    for g in range(starts.shape[0]):
        a = starts[g]
        b = ends[g]
        n = b - a
        if n == 0:
            ks_out[g] = 0
            continue
        total = ranks[b - 1] - (n - 1)
        mean = total / n
        guess = 0
        while guess < rice.MAX_K and (1 << (guess + 1)) <= mean + 1.0:
            guess += 1
        klo = max(0, guess - 1)
        khi = min(rice.MAX_K, guess + 1)
        s0 = 0
        s1 = 0
        s2 = 0
        prev = -1
        for j in range(a, b):
            r = np.int64(ranks[j])
            gap = r - prev - 1
            prev = r
            s0 += gap >> klo
            s1 += gap >> (klo + 1)
            s2 += gap >> (klo + 2)
        best_k = klo
        best = n * (klo + 1) + s0
        if klo + 1 <= khi:
            c = n * (klo + 2) + s1
            if c < best:
                best, best_k = c, klo + 1
        if klo + 2 <= khi:
            c = n * (klo + 3) + s2
            if c < best:
                best, best_k = c, klo + 2
        ks_out[g] = best_k
        ubits += best - n * best_k
        rbits += n * best_k
    return ubits, rbits


@njit(nogil=True, cache=True)
def rice_write(ranks, starts, ends, ks, out, uo, ro):
    """``rice.write`` into ``out``: the unary stream at ``uo``, then the remainders at ``ro`` (its
    end). Every code is one 8-byte store (overlapping the next), so each stream writes up to 7
    bytes of zeros past its end: the unary stream's are overwritten by the remainders, which are
    written after it, and ``out`` needs 8 bytes of room after the remainders."""
    p = uo
    acc = _U64(0)
    nb = 0
    for g in range(starts.shape[0]):
        k = ks[g]
        prev = -1
        for j in range(starts[g], ends[g]):
            r = np.int64(ranks[j])
            q = (r - prev - 1) >> k
            prev = r
            while q > 55:  # rare: 48 ones at a time
                acc, nb = _put(acc, nb, (_ONE << _U64(48)) - _ONE, 48)
                store_be64(out, p, acc)
                p += nb >> 3
                acc <<= _U64(nb & ~7)
                nb &= 7
                q -= 48
            acc, nb = _put(acc, nb, ((_ONE << _U64(q)) - _ONE) << _ONE, q + 1)  # q ones, a zero
            store_be64(out, p, acc)
            p += nb >> 3
            acc <<= _U64(nb & ~7)
            nb &= 7
    p = ro
    acc = _U64(0)
    nb = 0
    for g in range(starts.shape[0]):
        k = ks[g]
        if k == 0:
            continue
        kmask = (_ONE << _U64(k)) - _ONE
        prev = -1
        for j in range(starts[g], ends[g]):
            r = np.int64(ranks[j])
            acc, nb = _put(acc, nb, _U64(r - prev - 1) & kmask, k)
            prev = r
            store_be64(out, p, acc)
            p += nb >> 3
            acc <<= _U64(nb & ~7)
            nb &= 7


@njit(nogil=True, cache=True)
def rans_encode(sym, mdl, n, freqs, sbuf):
    """``rans._encode`` of the first ``n`` symbols into the end of ``sbuf`` (at least ``2n + 4``
    bytes: a symbol emits at most two); returns the first used index. Division by the frequency
    is a multiply by its reciprocal (ryg_rans ``RansEncPutSymbol``; exact while the state is below
    2**31, and the byte-wise renormalisation keeps it there)."""
    nm = freqs.shape[0]
    size = nm * rans.ALPHABET
    xmax = np.empty(size, dtype=np.uint64)
    rcp = np.empty(size, dtype=np.uint64)
    rsh = np.empty(size, dtype=np.uint64)
    bias = np.empty(size, dtype=np.uint64)
    cmpl = np.empty(size, dtype=np.uint64)
    for m in range(nm):
        start = 0
        for s in range(rans.ALPHABET):
            f = freqs[m, s]
            i = m * rans.ALPHABET + s
            xmax[i] = _U64(((_L >> rans.SCALE_BITS) << 8) * f)
            cmpl[i] = _U64(rans.M - f)
            if f < 2:
                rcp[i] = _W32
                rsh[i] = _U64(0)
                bias[i] = _U64(start + rans.M - 1)
            else:
                shift = 0
                while f > (1 << shift):
                    shift += 1
                rcp[i] = _U64(((1 << (shift + 31)) + f - 1) // f)
                rsh[i] = _U64(shift - 1)
                bias[i] = _U64(start)
            rsh[i] += _U64(32)  # both shifts in one: (v >> 32) >> r == v >> (32 + r)
            start += f
    x = _U64(_L)
    o = sbuf.shape[0]
    s8 = _U64(8)
    for j in range(n - 1, -1, -1):
        i = np.int64(mdl[j]) * rans.ALPHABET + np.int64(sym[j])
        xm = xmax[i]
        while x >= xm:
            o -= 1
            sbuf[o] = np.uint8(x & _U64(0xFF))
            x >>= s8
        x = (x + bias[i]) + ((x * rcp[i]) >> rsh[i]) * cmpl[i]
    for _ in range(4):
        o -= 1
        sbuf[o] = np.uint8(x & _U64(0xFF))
        x >>= s8
    return o
