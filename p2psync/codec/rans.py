"""Static rANS entropy coding of small symbols (numba), for residuals conditioned on context.

Why not zstd: residuals are mostly +-1 ULP, about 1.4 bits of information per
change given the base value's exponent; zstd's Huffman literals cannot go below
one bit per symbol and pay a table per frame, which cost about 2.6 bits. A
range-style coder with one frequency table per context gets within a few
percent of the conditional entropy.

Coder: 32-bit state, byte-wise renormalisation, 12-bit probabilities. The
encoder runs backwards over the symbols so the decoder reads forwards.
Frequency tables travel with the data: ``u32 mask`` of present symbols, then
``u16`` frequency per present symbol (they sum to 4096).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec.wire import Reader
from p2psync.errors import CodecError

SCALE_BITS = 12
M = 1 << SCALE_BITS
ALPHABET = 32
ESCAPE = ALPHABET - 1
_L = 1 << 23


@njit(nogil=True, cache=True)
def _encode(symbols, model_of, starts, freqs, out):
    """Encode backwards into ``out`` (filled from its end); returns the first used index or -1."""
    x = np.uint32(_L)
    o = out.shape[0]
    for j in range(symbols.shape[0] - 1, -1, -1):
        m = model_of[j]
        s = symbols[j]
        f = np.uint32(freqs[m, s])
        x_max = np.uint32(((_L >> SCALE_BITS) << 8)) * f
        while x >= x_max:
            o -= 1
            if o < 0:
                return -1
            out[o] = np.uint8(x & np.uint32(0xFF))
            x = x >> np.uint32(8)
        x = ((x // f) << np.uint32(SCALE_BITS)) + (x % f) + np.uint32(starts[m, s])
    for _ in range(4):
        o -= 1
        if o < 0:
            return -1
        out[o] = np.uint8(x & np.uint32(0xFF))
        x = x >> np.uint32(8)
    return o


@njit(nogil=True, cache=True)
def _decode(buf, model_of, starts, freqs, lookup, out):
    """Returns the number of bytes consumed, or -1 if the stream is malformed."""
    n_in = buf.shape[0]
    if n_in < 4:
        return -1
    x = np.uint32(0)
    for i in range(4):
        x = (x << np.uint32(8)) | np.uint32(buf[i])
    p = 4
    mask = np.uint32(M - 1)
    for j in range(out.shape[0]):
        m = model_of[j]
        slot = x & mask
        s = lookup[m, slot]
        out[j] = s
        x = np.uint32(freqs[m, s]) * (x >> np.uint32(SCALE_BITS)) + slot - np.uint32(starts[m, s])
        while x < np.uint32(_L):
            if p >= n_in:
                return -1
            x = (x << np.uint32(8)) | np.uint32(buf[p])
            p += 1
    if x != np.uint32(_L):
        return -1
    return p


@njit(nogil=True, cache=True)
def _decode_words(buf, old_w, shift, mask, lut, starts, freqs, lookup, new_out, esc_out):
    """:func:`_decode` fused with what surrounds it: the model of change ``j`` comes from the
    exponent of its base word ``old_w[j]``, and the new word is the base word plus the
    unzigzagged symbol (escapes are patched by the caller; their indices go to ``esc_out``).
    Returns (bytes consumed or -1 if malformed, number of escapes)."""
    n_in = buf.shape[0]
    if n_in < 4:
        return -1, 0
    x = np.uint32(0)
    for i in range(4):
        x = (x << np.uint32(8)) | np.uint32(buf[i])
    p = 4
    m12 = np.uint32(M - 1)
    sh = np.uint64(shift)
    mk = np.uint64(mask)
    one = np.uint64(1)
    ne = 0
    for j in range(old_w.shape[0]):
        w = old_w[j]
        m = lut[(np.uint64(w) >> sh) & mk]
        slot = x & m12
        s = lookup[m, slot]
        x = np.uint32(freqs[m, s]) * (x >> np.uint32(SCALE_BITS)) + slot - np.uint32(starts[m, s])
        while x < np.uint32(_L):
            if p >= n_in:
                return -1, ne
            x = (x << np.uint32(8)) | np.uint32(buf[p])
            p += 1
        z = np.uint64(s)
        if s == ESCAPE:
            esc_out[ne] = j
            ne += 1
        new_out[j] = np.uint64(w) + ((z >> one) ^ (np.uint64(0) - (z & one)))
    if x != np.uint32(_L):
        return -1, ne
    return p, ne


@njit(nogil=True, cache=True)
def _quantize_row(counts, out):
    """Frequencies summing to M with every present symbol >= 1 (``out``, one row)."""
    total = 0
    for s in range(counts.shape[0]):
        total += counts[s]
    acc = 0
    for s in range(counts.shape[0]):
        c = counts[s]
        f = 0
        if c > 0:
            f = max(1, np.int64(np.round(c * (M / total))))
        out[s] = f
        acc += f
    diff = M - acc
    if diff == 0:
        return
    order = np.argsort(-out, kind="mergesort")  # stable: the largest first, ties by symbol
    i = 0
    while diff != 0:
        s = order[i % order.shape[0]]
        if diff > 0:
            out[s] += diff
            diff = 0
        elif out[s] > 1:
            take = min(out[s] - 1, -diff)
            out[s] -= take
            diff += take
        i += 1


@njit(nogil=True, cache=True)
def quantize_all(hist):
    """:func:`quantize` of every row of ``hist`` (models x symbols)."""
    out = np.zeros(hist.shape, dtype=np.int64)
    for m in range(hist.shape[0]):
        _quantize_row(hist[m], out[m])
    return out


def quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to M with every present symbol >= 1."""
    out = np.zeros(counts.shape[0], dtype=np.int64)
    _quantize_row(np.ascontiguousarray(counts, dtype=np.int64), out)
    return out


@njit(nogil=True, cache=True)
def _tables(freqs):
    """(cumulative starts, frequencies) as u32 tables of the coder."""
    starts = np.zeros(freqs.shape, dtype=np.uint32)
    f = np.zeros(freqs.shape, dtype=np.uint32)
    for m in range(freqs.shape[0]):
        acc = 0
        for s in range(freqs.shape[1]):
            starts[m, s] = acc
            f[m, s] = freqs[m, s]
            acc += freqs[m, s]
    return starts, f


@njit(nogil=True, cache=True)
def _lookup(freqs):
    """Symbol of every slot of every model (models x M)."""
    lookup = np.zeros((freqs.shape[0], M), dtype=np.uint8)
    for m in range(freqs.shape[0]):
        o = 0
        for s in range(freqs.shape[1]):
            for _ in range(freqs[m, s]):
                lookup[m, o] = s
                o += 1
    return lookup


@njit(nogil=True, cache=True)
def _models_bytes(freqs):
    n = freqs.shape[0]
    out = np.empty(1 + n * (4 + 2 * ALPHABET), dtype=np.uint8)
    out[0] = n
    o = 1
    for m in range(n):
        mask = 0
        for s in range(ALPHABET):
            if freqs[m, s]:
                mask |= 1 << s
        for t in range(4):
            out[o + t] = (mask >> (8 * t)) & 0xFF
        o += 4
        for s in range(ALPHABET):
            f = freqs[m, s]
            if f:
                out[o] = f & 0xFF
                out[o + 1] = (f >> 8) & 0xFF
                o += 2
    return out[:o]


def encode_models(freqs: np.ndarray) -> bytes:
    """``u8 n``, then per model ``u32 mask`` of present symbols and their ``u16`` frequencies."""
    return _models_bytes(np.ascontiguousarray(freqs, dtype=np.int64)).tobytes()


@njit(nogil=True, cache=True)
def _parse_models(buf, at):
    """Inverse of :func:`_models_bytes` from ``buf[at:]``: (frequencies, offset after them, status);
    status -1: truncated, -2: no table, -3: a table does not sum to M or has a zero."""
    empty = np.zeros((0, ALPHABET), dtype=np.int64)
    if at >= buf.shape[0]:
        return empty, at, -1
    n = np.int64(buf[at])
    if n == 0:
        return empty, at, -2
    freqs = np.zeros((n, ALPHABET), dtype=np.int64)
    o = at + 1
    for m in range(n):
        if o + 4 > buf.shape[0]:
            return empty, o, -1
        mask = np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8) | (np.int64(buf[o + 2]) << 16) | \
            (np.int64(buf[o + 3]) << 24)
        o += 4
        total = 0
        for s in range(ALPHABET):
            if (mask >> s) & 1:
                if o + 2 > buf.shape[0]:
                    return empty, o, -1
                f = np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)
                o += 2
                if f == 0:
                    return empty, o, -3
                freqs[m, s] = f
                total += f
        if total != M:
            return empty, o, -3
    return freqs, o, 0


def read_models(r: Reader) -> np.ndarray:
    freqs, end, status = _parse_models(np.frombuffer(r.buf, dtype=np.uint8), r.pos)
    if status == -1:
        r.take(len(r.buf) - r.pos + 1)  # raises TruncatedError
    if status == -2:
        raise CodecError("residuals: no frequency table")
    if status == -3:
        raise CodecError("residuals: frequency table does not sum to 4096")
    r.pos = end
    return freqs


def encode(symbols: np.ndarray, model_of: np.ndarray, freqs: np.ndarray) -> bytes:
    starts, f = _tables(freqs)
    cap = 16 + symbols.shape[0] * 2
    while True:
        out = np.empty(cap, dtype=np.uint8)
        o = _encode(symbols.astype(np.uint8, copy=False), model_of.astype(np.int64, copy=False), starts, f, out)
        if o >= 0:
            return out[o:].tobytes()
        cap *= 2


def decode(buf: memoryview, model_of: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    starts, f = _tables(freqs)
    out = np.empty(model_of.shape[0], dtype=np.uint8)
    used = _decode(np.frombuffer(buf, dtype=np.uint8), model_of.astype(np.int64), starts, f, _lookup(freqs), out)
    if used != len(buf):
        raise CodecError("residuals: entropy-coded stream is malformed")
    return out


def decode_words(buf: memoryview, old_w: np.ndarray, shift: int, mask: int, lut: np.ndarray,
                 freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(new words with escapes unpatched, indices of escapes) of changes to the base words
    ``old_w``: symbol ``s`` means ``old + unzigzag(s)``, coded with model ``lut[exponent of old]``."""
    starts, f = _tables(freqs)
    n = old_w.shape[0]
    new_w = np.empty(n, dtype=old_w.dtype)
    esc = np.empty(n, dtype=np.int64)
    used, ne = _decode_words(np.frombuffer(buf, dtype=np.uint8), old_w, shift, mask, lut, starts, f,
                             _lookup(freqs), new_w, esc)
    if used != len(buf):
        raise CodecError("residuals: entropy-coded stream is malformed")
    return new_w, esc[:ne]
