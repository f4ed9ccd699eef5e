"""Rice coding of rank gaps (numba), with 64-bit bit buffers.

Per bucket: the gaps between consecutive ranks (``rank - previous - 1``, the first
against -1); quotient ``gap >> k`` in unary (ones, then a zero) into one stream,
the ``k`` low bits into another. Both streams are packed MSB-first. Inside one
magnitude bucket changes are close to independent with one rate, so gaps are
nearly geometric and a Rice code with the right ``k`` costs close to their
entropy.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec.simd import clz64, load_be64

MAX_K = 40
_U64 = np.uint64
_ONE = np.uint64(1)
_PAD = 8


@njit(nogil=True, cache=True)
def plan(ranks, starts, ends, ks_out):
    """Choose ``k`` per group (cheapest of a few around log2 of the mean gap); returns
    (unary bits, remainder bits)."""
    ubits = 0
    rbits = 0
    for g in range(starts.shape[0]):
        a = starts[g]
        b = ends[g]
        n = b - a
        if n == 0:
            ks_out[g] = 0
            continue
        total = ranks[b - 1] - (n - 1)  # sum of gaps: last rank minus the n - 1 separators, plus 1 - 1
        mean = total / n
        guess = 0
        while guess < MAX_K and (1 << (guess + 1)) <= mean + 1.0:
            guess += 1
        best_k = 0
        best = -1
        for k in range(max(0, guess - 1), min(MAX_K, guess + 1) + 1):
            cost = n * (k + 1)
            prev = -1
            for j in range(a, b):
                cost += (ranks[j] - prev - 1) >> k
                prev = ranks[j]
            if best < 0 or cost < best:
                best = cost
                best_k = k
        ks_out[g] = best_k
        ubits += best - n * best_k
        rbits += n * best_k
    return ubits, rbits


@njit(nogil=True, cache=True, inline="always")
def _put(buf, p, acc, nb, value, length):
    """Append ``length`` (<= 56) bits; returns the new (p, acc, nb)."""
    acc = (acc << _U64(length)) | value
    nb += length
    while nb >= 8:
        nb -= 8
        buf[p] = np.uint8((acc >> _U64(nb)) & _U64(0xFF))
        p += 1
    return p, acc, nb


@njit(nogil=True, cache=True)
def write(ranks, starts, ends, ks, ubuf, rbuf):
    up = 0
    uacc = _U64(0)
    unb = 0
    rp = 0
    racc = _U64(0)
    rnb = 0
    for g in range(starts.shape[0]):
        k = ks[g]
        kmask = (_ONE << _U64(k)) - _ONE
        prev = -1
        for j in range(starts[g], ends[g]):
            gap = ranks[j] - prev - 1
            prev = ranks[j]
            q = gap >> k
            while q >= 56:
                up, uacc, unb = _put(ubuf, up, uacc, unb, (_ONE << _U64(56)) - _ONE, 56)
                q -= 56
            # q ones then a zero
            up, uacc, unb = _put(ubuf, up, uacc, unb, ((_ONE << _U64(q)) - _ONE) << _ONE, q + 1)
            if k:
                rp, racc, rnb = _put(rbuf, rp, racc, rnb, _U64(gap) & kmask, k)
    if unb:
        ubuf[up] = np.uint8((uacc << _U64(8 - unb)) & _U64(0xFF))
    if rnb:
        rbuf[rp] = np.uint8((racc << _U64(8 - rnb)) & _U64(0xFF))


@njit(nogil=True, cache=True, inline="always")
def _peek(buf, bitpos):
    """64 bits from ``bitpos`` (at least 57 of them real; ``buf`` is padded with 8 bytes)."""
    return load_be64(buf, bitpos >> 3) << _U64(bitpos & 7)


@njit(nogil=True, cache=True)
def _read(ubuf, ulen, rbuf, rlen, counts, ks, span, ranks_out):
    """Decode the ranks. The unary stream goes through a 64-bit window ``v`` (``vb`` valid bits,
    the rest zero) that is reloaded only when a code runs past it: finding a code's end is then
    ``clz`` and a shift on a register, not a load from an address that depends on the previous
    code (2x faster on dense segments, whose codes are a bit or two). With ``k = 0`` a run of zero
    bits is a run of codes for consecutive elements, taken at once. Results and status codes are
    those of reading every code with its own 64-bit peek."""
    up = 0
    rp = 0
    ubits = ulen * 8
    rbits = rlen * 8
    o = 0
    v = _U64(0)
    vb = 0
    for g in range(counts.shape[0]):
        k = ks[g]
        r = -1
        left = counts[g]
        while left > 0:
            if up >= ubits:
                return -1
            if vb == 0:
                v = _peek(ubuf, up)
                vb = 64 - (up & 7)
            if k == 0:
                # Dense segments: a zero bit is a whole code (gap 0, the next element of the
                # bucket), and most bits are zeros. Take the run of them at once.
                run = min(np.int64(clz64(v)), vb, ubits - up, left)
                if run > 0:
                    if r + run >= span:
                        return -2
                    for t in range(run):
                        ranks_out[o + t] = r + 1 + t
                    r += run
                    o += run
                    left -= run
                    up += run
                    vb -= run
                    v = (v << _U64(run - 1)) << _ONE
                    continue
            left -= 1
            q = 0
            while True:
                if vb == 0:  # the stream is zero-padded, so a run of ones ends by bit ``ubits``
                    v = _peek(ubuf, up)
                    vb = 64 - (up & 7)
                ones = np.int64(clz64(~v))  # <= vb: the bits past the window are zero
                if ones < vb:
                    q += ones
                    up += ones + 1
                    vb -= ones + 1
                    v = (v << _U64(ones)) << _ONE
                    break
                q += ones
                up += ones
                vb = 0
            if q > 56 and 56 * ((q - 1) // 56) > span:  # where the word-by-word reader gave up
                return -2
            if up > ubits:
                return -1
            if rp + k > rbits:
                return -3
            rem = 0
            if k:
                rem = np.int64(_peek(rbuf, rp) >> _U64(64 - k))
                rp += k
            if q > (span >> k):  # the gap would reach past the segment (and q << k could overflow)
                return -2
            r += ((q << k) | rem) + 1
            if r >= span:
                return -2
            ranks_out[o] = r
            o += 1
    if (up + 7) // 8 != ulen or (rp + 7) // 8 != rlen:
        return -4
    return 0


def read(unary: memoryview, rem: memoryview, counts: np.ndarray, ks: np.ndarray, span: int,
         ranks_out: np.ndarray) -> int:
    """Inverse of :func:`write`. Returns 0, or a negative code if the streams are malformed."""
    ub = np.zeros(len(unary) + _PAD, dtype=np.uint8)
    ub[: len(unary)] = np.frombuffer(unary, dtype=np.uint8)
    rb = np.zeros(len(rem) + _PAD, dtype=np.uint8)
    rb[: len(rem)] = np.frombuffer(rem, dtype=np.uint8)
    return _read(ub, len(unary), rb, len(rem), counts, ks, span, ranks_out)
