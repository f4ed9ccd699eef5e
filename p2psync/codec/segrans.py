"""The residual half of a delta segment's decode: rANS symbols to new words (numba, ``nogil``).

:func:`new_words` runs one loop over a segment's changes: it decodes each change's rANS symbol in
the residual model of its base word's exponent, takes the next escape value where the symbol is
the escape, and writes the new word. :func:`p2psync.codec.segdecode.decode_body` calls it once
the positions and their base words are known.

Per change the loop is bound by the rANS state's dependency chain (a table
load, a multiply, renormalisation): ~15 cycles. The escape and hash work does
not depend on the state, so it runs in that chain's shadow instead of in
passes of its own. The chain itself is shorter than in
:func:`~p2psync.codec.rans._decode_words` (same bitstream): one 32-bit table
entry per slot packs symbol, frequency and bias (one load instead of three), and
renormalisation takes its one or two bytes without a loop. That relies on the
coder's invariant that the state stays in ``[2**23, 2**31)``, which holds for
every stream whose first four bytes are in that range (every stream an encoder
writes); any other stream goes through the general loop, so the result is the
same for every input.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec import rans

SMALL_PER_MODEL = 256
"""Below this many changes per residual model, rANS looks symbols up by scanning the cumulative
frequencies instead of building a 4096-slot table per model (~2 us each)."""

_M = rans.M
_L = np.uint32(1 << 23)
_HI = np.uint32(1 << 31)
_U64 = np.uint64
_ONE = np.uint64(1)


@njit(nogil=True, cache=True)
def model_lut(bounds, width):
    """Residual model of every exponent value (``bounds``: first exponent of models 1, 2, ...)."""
    lut = np.zeros(width, dtype=np.int64)
    for b in bounds:
        for e in range(b, width):
            lut[e] += 1
    return lut


@njit(nogil=True, cache=True)
def _slot_table(freqs):
    """Per model, per slot: symbol | frequency << 5 | (slot - cumulative start) << 18."""
    nm = freqs.shape[0]
    t = np.empty(nm * _M, dtype=np.uint32)
    for m in range(nm):
        o = m * _M
        for s in range(freqs.shape[1]):
            f = freqs[m, s]
            e = np.uint32(s) | (np.uint32(f) << np.uint32(5))
            for k in range(f):
                t[o + k] = e | (np.uint32(k) << np.uint32(18))
            o += f
    return t


@njit(nogil=True, cache=True, inline="always")
def _plane_word(planes, npl, i, width):
    """Word ``i`` of ``npl`` words stored as byte planes (``width`` is a compile-time constant)."""
    v = _U64(planes[i])
    if width >= 2:
        v |= _U64(planes[npl + i]) << _U64(8)
    if width >= 4:
        v |= (_U64(planes[2 * npl + i]) << _U64(16)) | (_U64(planes[3 * npl + i]) << _U64(24))
    if width == 8:
        for k in range(4, 8):
            v |= _U64(planes[k * npl + i]) << _U64(8 * k)
    return v


@njit(nogil=True, cache=True, inline="always")
def _new_word(s, w, planes, npl, ne, width):
    """(new word, is an escape, is a too small escape) of a change decoded to symbol ``s`` from
    base word ``w``; an escape takes escape value ``ne``. Branch-free: the next escape value is
    read whatever the symbol (an index past the planes reads the last value; the caller's length
    check then fails), so neither the escape share nor its pattern costs mispredictions."""
    v = _plane_word(planes, npl, min(ne, npl - 1), width)
    esc = np.int64(s == rans.ESCAPE)
    z = v if esc else _U64(s)
    wn = w + ((z >> _ONE) ^ (_U64(0) - (z & _ONE)))
    return wn, esc, esc & np.int64(z < _U64(rans.ESCAPE))


@njit(nogil=True, cache=True)
def _rans_table(buf, n_in, x, old_w, sh, mk, lut, table, planes, new_out):
    """The rANS loop with a slot table, the escapes merged in; ``x`` (the state after the first 4
    bytes) is in ``[2**23, 2**31)``, ``buf`` has 2 bytes of padding and ``planes`` at least one
    word. Returns (bytes used or -1, escapes, escapes too small). The escape work does not depend
    on the coder state, so it runs in the shadow of the state's dependency chain (the hash does
    not: it vectorises in a pass of its own, and fused here it cost more)."""
    p = 4
    ne = 0
    small = 0
    width = new_out.itemsize
    npl = planes.shape[0] // width
    m12 = np.uint32(_M - 1)
    lo8 = np.uint32(1 << 15)
    for j in range(old_w.shape[0]):
        if p > n_in:
            return -1, ne, small
        w = _U64(old_w[j])
        e = table[(lut[(w >> sh) & mk] << 12) | np.int64(x & m12)]
        x = ((e >> np.uint32(5)) & np.uint32(0x1FFF)) * (x >> np.uint32(12)) + (e >> np.uint32(18))
        # x >= 2**11 here (frequency >= 1, x was >= 2**23): at most two bytes bring it back up
        b0 = np.uint32(buf[p])
        if x < lo8:
            x = (x << np.uint32(16)) | (b0 << np.uint32(8)) | np.uint32(buf[p + 1])
            p += 2
        elif x < _L:
            x = (x << np.uint32(8)) | b0
            p += 1
        wn, esc, sm = _new_word(np.int64(e & np.uint32(31)), w, planes, npl, ne, width)
        new_out[j] = wn
        ne += esc
        small += sm
    if p > n_in or x != _L:
        return -1, ne, small
    return p, ne, small


@njit(nogil=True, cache=True)
def _rans_scan(buf, n_in, x, old_w, sh, mk, lut, freqs, planes, new_out):
    """The general rANS loop (any state), finding each symbol by a scan of the cumulative
    frequencies: for small segments, and for streams outside the coder's invariant."""
    p = 4
    ne = 0
    small = 0
    width = new_out.itemsize
    npl = planes.shape[0] // width
    m12 = np.uint32(_M - 1)
    for j in range(old_w.shape[0]):
        w = _U64(old_w[j])
        m = lut[(w >> sh) & mk]
        slot = x & m12
        s = 0
        start = np.uint32(0)
        while True:  # the frequencies of a model sum to M, so some symbol holds the slot
            f = np.uint32(freqs[m, s])
            if slot < start + f:
                break
            start += f
            s += 1
        x = f * (x >> np.uint32(12)) + slot - start
        while x < _L:
            if p >= n_in:
                return -1, ne, small
            x = (x << np.uint32(8)) | np.uint32(buf[p])
            p += 1
        wn, esc, sm = _new_word(s, w, planes, npl, ne, width)
        new_out[j] = wn
        ne += esc
        small += sm
    if x != _L:
        return -1, ne, small
    return p, ne, small


@njit(nogil=True, cache=True)
def new_words(buf, n_in, old_w, sh, mk, lut, freqs, planes, new_out):
    """New words of the changes to the base words ``old_w`` from the rANS stream ``buf[:n_in]``
    (at least 4 bytes, then 2 bytes of padding): ``lut`` maps an exponent (``(w >> sh) & mk``) to
    its model, ``freqs`` holds each model's frequencies, ``planes`` the escape values (at least
    one word). Returns (bytes used or -1, escapes, escapes too small to be escapes)."""
    x = np.uint32(0)
    for i in range(4):
        x = (x << np.uint32(8)) | np.uint32(buf[i])
    if old_w.shape[0] >= SMALL_PER_MODEL * freqs.shape[0] and _L <= x < _HI:
        return _rans_table(buf, n_in, x, old_w, sh, mk, lut, _slot_table(freqs), planes, new_out)
    return _rans_scan(buf, n_in, x, old_w, sh, mk, lut, freqs, planes, new_out)
