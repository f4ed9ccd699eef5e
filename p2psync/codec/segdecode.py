"""Decoding a whole delta segment body in one compiled call.

:func:`~p2psync.codec.sparse.decode_changes` decodes a segment step by step
from Python (parse, Rice, locate, residual tables, rANS, escapes, hash): some
40 Python-level operations and a dozen kernel calls per segment. On a model of
many small tensors that fixed cost is about half of all decoding (the tiny demo
model: 24 segments of 10 to 33,000 changes). :func:`decode_body` does the same
work in one ``nogil`` call: it validates the header and the residual tables,
reads the Rice streams, locates the positions, and then runs one loop over the
changes that decodes the rANS symbol, takes the escape value where the symbol
is the escape, and adds the change to the fingerprint sums. zstd-compressed
escapes are the one thing numba cannot read: the first call then stops after
parsing (:data:`NEED_ZSTD`, nothing decoded yet), Python decompresses them, and
a second call decodes with them.

Same bytes in, same words out, same typed errors, checked in the same order as
the step-by-step decoder (``sparse`` documents the layout; ``_error`` maps the
status codes to its messages).

The rANS loop over the changes, with the escapes merged in, is
:func:`p2psync.codec.segrans.new_words`.

Numba caches this module's kernels keyed on this file alone, and they compile in
``positions.locate``, ``positions.locate_grouped``, ``kernels.hash_change``, ``rice._read``,
``rans._parse_models`` and ``segrans``: after editing one of those, delete ``p2psync/codec/__pycache__/segdecode.*``
(a fresh clone has no cache; compiling this module takes ~11 s once).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from p2psync.codec import dense, kernels, positions, rans, rice, segrans, slabs
from p2psync.codec.segment import KIND_DENSE, MAX_BUCKETS, decompress
from p2psync.dtypes import DType
from p2psync.errors import CodecError, TruncatedError

OK = 0
NEED_ZSTD = 1
"""Escapes are zstd-compressed: decompress them and call :func:`finish_escapes`."""
# Errors (negative); ``info`` carries the number a message needs.
TRUNC_SEGMENT = -1  # info: bytes needed
TRUNC_RESIDUALS = -2  # info: bytes needed
BAD_BUCKETS = -3  # info: bucket count
COUNTS = -4
TOO_MANY = -5
BAD_TABLE = -6
NO_EXPONENT = -7
THRESHOLD_RANGE = -8
RICE = -9  # info: rice status
OUTSIDE = -10  # info: changes not found
NO_TABLE = -11
TABLE_SUM = -12
BOUND_RANGE = -13
TRAILING = -14  # info: trailing bytes
STREAM = -15
ESCAPE_SMALL = -16
NO_ESCAPE = -17
PAYLOAD_LEN = -18  # info: payload bytes
PAYLOAD_CODEC = -19  # info: codec
ZSTD_FAILED = -20
ZSTD_LEN = -21  # info: decompressed bytes

GROUPED_LOCATE = 2
"""Segments with at most one change per this many elements find their positions with
:func:`~p2psync.codec.positions.locate_grouped` (a fixed cost per change: ~5 ns), denser ones with
:func:`~p2psync.codec.positions.locate`, whose whole-block path is cheaper when most of a bucket
changes (measured: the two cross near half the elements changed)."""

_U64 = np.uint64
_NO_PLANES = np.zeros(0, dtype=np.uint8)
_NO_PLANES.setflags(write=False)  # the type of every planes array (numba compiles per array type)
_NO_POS = np.empty(0, dtype=np.int64)  # no positions array given: decode_body allocates


@njit(nogil=True, cache=True, inline="always")
def _u16(a, o):
    return np.int64(a[o]) | (np.int64(a[o + 1]) << 8)


@njit(nogil=True, cache=True, inline="always")
def _u32(a, o):
    return _u16(a, o) | (_u16(a, o + 2) << 16)


@njit(nogil=True, cache=True)
def decode_body(seg, at, start, stop, old, shift, exp_mask, seed, planes, planes_state, pos_out, new_out,
                origin=0):
    """Decode the delta body that starts at ``seg[at]`` (the segment runs to the end of ``seg``)
    against the base words ``old`` of ``[start, stop)``; ``old[i]`` is the word at position
    ``origin + i`` of the tensor, and the positions returned and hashed are the tensor's.

    ``planes_state`` 0: the escapes have not been decompressed; if they are zstd-compressed the
    call returns :data:`NEED_ZSTD` (and where they are) before decoding anything. 1: ``planes``
    holds them, decompressed. 2: they did not decompress (:data:`ZSTD_FAILED` if they are needed).

    ``pos_out`` and ``new_out`` (int64 and ``old.dtype``) become the positions and new words when
    they hold exactly as many elements as the segment has changes (every element is written
    before they are returned); otherwise those arrays are allocated here.

    Returns ``(status, info, positions, new words, (escape offset, length), (hash lane a, b))``.
    A negative status is an error (``info``: a number for its message); the checks run in the
    order of the step-by-step decoder, so a segment with several defects reports the same one."""
    size = seg.shape[0]
    span = stop - start
    e_i = np.empty(0, dtype=np.int64)
    e_w = np.empty(0, dtype=old.dtype)
    z = _U64(0)
    nil = (0, 0)
    # --- header: counts, thresholds, bucket table (``segment.parse_segment``) ---
    o = at
    if o + 5 > size:
        return TRUNC_SEGMENT, o + 5, e_i, e_w, nil, (z, z)
    n = _u32(seg, o)
    n_b = np.int64(seg[o + 4])
    o += 5
    if n_b < 1 or n_b > 4:
        return BAD_BUCKETS, n_b, e_i, e_w, nil, (z, z)
    nt = n_b - 1
    if o + 2 * nt > size:
        return TRUNC_SEGMENT, o + 2 * nt, e_i, e_w, nil, (z, z)
    thr = np.zeros(3, dtype=np.int64)
    for i in range(nt):
        thr[i] = _u16(seg, o + 2 * i)
    o += 2 * nt
    if o + 5 * n_b > size:
        return TRUNC_SEGMENT, o + 5 * n_b, e_i, e_w, nil, (z, z)
    counts = np.zeros(4, dtype=np.int64)
    ks = np.zeros(n_b, dtype=np.int64)
    total = 0
    kmax = 0
    for b in range(n_b):
        counts[b] = _u32(seg, o)
        ks[b] = seg[o + 4]
        total += counts[b]
        kmax = max(kmax, ks[b])
        o += 5
    if total != n:
        return COUNTS, 0, e_i, e_w, nil, (z, z)
    if n > span:
        return TOO_MANY, 0, e_i, e_w, nil, (z, z)
    bad = kmax > rice.MAX_K or (nt > 0 and thr[0] < 1)
    for i in range(1, nt):
        bad |= thr[i] <= thr[i - 1]
    if bad:
        return BAD_TABLE, 0, e_i, e_w, nil, (z, z)
    if o + 8 > size:
        return TRUNC_SEGMENT, o + 8, e_i, e_w, nil, (z, z)
    ulen = _u32(seg, o)
    rlen = _u32(seg, o + 4)
    o += 8
    if o + ulen > size:
        return TRUNC_SEGMENT, o + ulen, e_i, e_w, nil, (z, z)
    if o + ulen + rlen > size:
        return TRUNC_SEGMENT, o + ulen + rlen, e_i, e_w, nil, (z, z)
    if nt and exp_mask == 0:
        return NO_EXPONENT, 0, e_i, e_w, nil, (z, z)
    prev = 0
    for i in range(nt):
        if not prev < thr[i] <= exp_mask:
            return THRESHOLD_RANGE, 0, e_i, e_w, nil, (z, z)
        prev = thr[i]
    uo = o
    ro = o + ulen
    # --- residual section (``sparse._decode_residuals``): parsed now, its errors reported after
    # the positions', as the step-by-step decoder does ---
    res_status = OK
    res_info = 0
    freqs, o, st = rans._parse_models(seg, ro + rlen)
    nm = freqs.shape[0]
    bounds = np.empty(max(0, nm - 1), dtype=np.int64)
    so = slen = esc_codec = eo = esc_len = 0
    if st == -1:
        res_status, res_info = TRUNC_RESIDUALS, size + 1
    elif st == -2:
        res_status = NO_TABLE
    elif st == -3:
        res_status = TABLE_SUM
    elif o + 2 * (nm - 1) > size:
        res_status, res_info = TRUNC_RESIDUALS, o + 2 * (nm - 1)
    else:
        prev = 0
        for i in range(nm - 1):
            v = _u16(seg, o + 2 * i)
            if not prev < v <= exp_mask:
                res_status = BOUND_RANGE
                break
            bounds[i] = v
            prev = v
        o += 2 * (nm - 1)
        if res_status != OK:
            pass
        elif o + 4 > size:
            res_status, res_info = TRUNC_RESIDUALS, o + 4
        else:
            slen = _u32(seg, o)
            o += 4
            so = o
            o += slen
            if o > size:
                res_status, res_info = TRUNC_RESIDUALS, o
            elif o + 5 > size:
                res_status, res_info = TRUNC_RESIDUALS, o + 5
            else:
                esc_codec = np.int64(seg[o])
                esc_len = _u32(seg, o + 1)
                o += 5
                eo = o
                o += esc_len
                if o > size:
                    res_status, res_info = TRUNC_RESIDUALS, o
                elif o != size:
                    res_status, res_info = TRAILING, size - o
    if res_status == OK and esc_codec == 1 and esc_len and planes_state == 0:
        return NEED_ZSTD, 0, e_i, e_w, (eo, esc_len), (z, z)
    # --- positions: Rice-coded ranks per bucket, then their places among the base words ---
    ub = np.zeros(ulen + 8, dtype=np.uint8)
    ub[:ulen] = seg[uo:uo + ulen]
    rb = np.zeros(rlen + 8, dtype=np.uint8)
    rb[:rlen] = seg[ro:ro + rlen]
    ranks = np.empty(n, dtype=np.int64)
    st = rice._read(ub, ulen, rb, rlen, counts[:n_b], ks, span, ranks)
    if st != 0:
        return RICE, st, e_i, e_w, nil, (z, z)
    pos = pos_out if pos_out.shape[0] == n else np.empty(n, dtype=np.int64)
    old_w = np.empty(n, dtype=old.dtype)
    if nt == 0:
        for j in range(n):
            p = ranks[j] + start
            pos[j] = p
            old_w[j] = old[p]
    else:
        consts = np.empty(4, dtype=old.dtype)
        km = (exp_mask << shift) | ((1 << shift) - 1)
        consts[:] = km
        for i in range(nt):
            consts[1 + i] = (thr[i] << shift) - 1
        if n * GROUPED_LOCATE <= span:
            found = positions.locate_grouped(old, start, stop, consts, counts, ranks, pos, old_w)
        else:
            found = positions.locate(old, start, stop, consts, counts, ranks, pos, old_w)
        if found != n:
            return OUTSIDE, n - found, e_i, e_w, nil, (z, z)
    if res_status != OK:
        return res_status, res_info, e_i, e_w, nil, (z, z)
    # --- residuals: rANS symbols with the escapes merged in, then the fingerprint change ---
    width = old.itemsize
    n_planes = planes.shape[0]
    src = np.zeros(width, dtype=np.uint8)  # the kernels read a value whatever the symbol
    if esc_codec != 1:
        n_planes = esc_len
        if esc_len >= width:
            src = np.ascontiguousarray(seg[eo:eo + esc_len])
    elif n_planes >= width:
        src = planes
    lut = segrans.model_lut(bounds, exp_mask + 1)
    new_w = new_out if new_out.shape[0] == n else np.empty(n, dtype=old.dtype)
    used = -1
    ne = small = 0
    if slen >= 4:
        buf = np.zeros(slen + 2, dtype=np.uint8)
        buf[:slen] = seg[so:so + slen]
        used, ne, small = segrans.new_words(buf, slen, old_w, _U64(shift), _U64(exp_mask), lut, freqs, src, new_w)
    if used != slen:
        return STREAM, 0, e_i, e_w, nil, (z, z)
    if ne == 0:
        if esc_len != 0 or esc_codec > 1:
            return NO_ESCAPE, 0, e_i, e_w, nil, (z, z)
    elif esc_codec > 1:
        return PAYLOAD_CODEC, esc_codec, e_i, e_w, nil, (z, z)
    elif esc_codec == 1 and planes_state == 2:
        return ZSTD_FAILED, 0, e_i, e_w, nil, (z, z)
    elif n_planes != ne * width:
        return PAYLOAD_LEN if esc_codec == 0 else ZSTD_LEN, n_planes, e_i, e_w, (ne, 0), (z, z)
    elif small:
        return ESCAPE_SMALL, 0, e_i, e_w, nil, (z, z)
    if origin != 0:
        for j in range(n):
            pos[j] += origin
    a, b = kernels.hash_change(pos, old_w, new_w, seed)
    return OK, 0, pos, new_w, (eo, esc_len), (a, b)


def _error(status: int, info: int, d: DType, size: int) -> CodecError:
    if status == TRUNC_SEGMENT:
        return TruncatedError(f"segment: truncated (needs {info} bytes, has {size})")
    if status == TRUNC_RESIDUALS:
        return TruncatedError(f"residuals: truncated (needs {info} bytes of the segment, has {size})")
    messages = {
        BAD_BUCKETS: f"segment: {info} buckets (1 to {MAX_BUCKETS} allowed)",
        COUNTS: "segment: bucket counts do not add up",
        TOO_MANY: "segment: more changes than elements",
        BAD_TABLE: "segment: bad bucket table",
        NO_EXPONENT: f"segment: {d.code} has no exponent to bucket by",
        THRESHOLD_RANGE: f"segment: bucket threshold out of range or out of order for {d.code}",
        RICE: f"segment: position streams are malformed (code {info})",
        OUTSIDE: f"segment: {info} changes fall outside the range",
        NO_TABLE: "residuals: no frequency table",
        TABLE_SUM: "residuals: frequency table does not sum to 4096",
        BOUND_RANGE: f"segment: residual model bound out of range or out of order for {d.code}",
        TRAILING: f"residuals: {info} trailing bytes",
        STREAM: "residuals: entropy-coded stream is malformed",
        ESCAPE_SMALL: "residuals: escaped value is small enough to be a symbol",
        NO_ESCAPE: "residuals: escapes present but no escape symbol",
        PAYLOAD_CODEC: f"segment: unknown payload codec {info}",
    }
    return CodecError(messages.get(status, f"segment: decode status {status}"))


def decode(seg: bytes | memoryview, at: int, start: int, stop: int, d: DType, old: np.ndarray, seed: np.uint64,
           out: slabs.Arena | None = None, origin: int = 0) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(positions, new words, fingerprint sum change) of the delta segment ``seg`` whose body
    starts at byte ``at``, against the base words ``old`` of its tensor: the result and the error
    of :func:`~p2psync.codec.sparse.decode_changes` of the parsed segment, for every input.

    With ``out``, the positions and new words are cut from that arena (kept memory, no page
    faults) instead of allocated: for as many changes as the header declares, when that is no
    more than the range holds (otherwise decoding fails before it writes anything).

    With ``origin``, ``old`` holds the tensor's words from position ``origin`` on (a copy of the
    segment's range, ``origin = start``); positions and fingerprint are the tensor's all the same.
    A dense segment (``seg`` of kind :data:`~p2psync.codec.segment.KIND_DENSE`) is decoded by
    :func:`p2psync.codec.dense.decode`, with the same result shape."""
    if len(seg) and seg[0] == KIND_DENSE:
        return dense.decode(seg, start, stop, d, old, seed, origin)
    buf = np.frombuffer(seg, dtype=np.uint8)
    buf.setflags(write=False)  # one compiled specialisation whether the chunk was bytes or a bytearray
    pos_out = _NO_POS
    new_out = np.empty(0, dtype=old.dtype)
    if out is not None and buf.shape[0] >= at + 4:
        n = int.from_bytes(buf[at:at + 4].tobytes(), "little")
        if n <= stop - start:
            pos_out, new_out = out.take(n, old.dtype)
    status, info, pos, new_w, (off, length), (a, b) = decode_body(
        buf, at, start - origin, stop - origin, old, d.exp_shift, d.exp_mask, seed, _NO_PLANES, 0, pos_out, new_out,
        origin)
    if status == NEED_ZSTD:
        # at most one escape per change: the count of changes bounds the planes
        bound = int.from_bytes(buf[at:at + 4].tobytes(), "little") * d.width
        failed = None
        try:
            planes, state = np.frombuffer(decompress(buf[off:off + length], bound), dtype=np.uint8), 1
        except CodecError as exc:
            failed, planes, state = exc, _NO_PLANES, 2
        status, info, pos, new_w, (off, length), (a, b) = decode_body(
            buf, at, start - origin, stop - origin, old, d.exp_shift, d.exp_mask, seed, planes, state, pos_out,
            new_out, origin)
        if status == ZSTD_FAILED:
            assert failed is not None
            raise failed
    if status == PAYLOAD_LEN:
        raise CodecError(f"segment: payload has {info} bytes, expected {off * d.width}")
    if status == ZSTD_LEN:
        raise CodecError(f"segment: payload decompresses to {info} bytes, expected {off * d.width}")
    if status != OK:
        raise _error(status, info, d, buf.shape[0])
    return pos, new_w, (int(a), int(b))
