"""Encoding a whole delta segment in one compiled call.

The step-by-step encoder (``context.job_thresholds``, ``kernels.find_ranked_changes``,
:func:`~p2psync.codec.sparse.encode_changes`) builds a segment from Python: a dozen kernel
calls, some 15 numpy temporaries and as many Python steps per segment, and several passes
over the changes. Here the scan path (:func:`scan`, used by ``encode_delta``) is one ``nogil``
call per segment (:func:`scan_encode`: find and rank the changes, then :func:`change_stats`
and :func:`encode_body`), and the path from changes found elsewhere (:func:`encode`, used by
``encode_delta_sparse`` and the publisher) is one call too (:func:`encode_changes_body`).
Python keeps only what numba cannot do: zstd of the escape planes. The bytes are those of
the step-by-step encoder, which stays as the reference (``encode._scan_job_reference``);
tests hold the two to the same chunks on generated tensors of every word width, density,
bucket count and escape share.

Per change (benchmark model, lr 1e-6: 22-30 ns per change after the scan, one thread):

- Two passes over the changes. :func:`change_stats` counts changes and
  escapes per bucket in a loop that LLVM vectorises, the base exponents in four histograms
  taken in turn (one counter in memory would chain each change to the one before through a
  store and a load), and the fingerprint change in ``kernels.hash_change`` (vectorised).
  :func:`encode_body` then writes each change's rank, rANS symbol and model in bucket order
  and its escape straight into the byte planes.
- The Rice and rANS streams are written by :mod:`p2psync.codec.segbits` (~3.5 and ~3.8 ns
  per change).

:func:`job_thresholds` makes the bucket-threshold choice of ``context`` in one call too (same
numbers; it hands back to ``context.choose_thresholds`` the two cases where numpy's summation
order or its coarsening of many exponents could matter).

Numba caches this module's kernels keyed on this file alone, and they compile in
``kernels.find_ranked_changes``, ``kernels.find_changes``, ``kernels.hash_change``,
``kernels.change_sample(_sparse)``, ``kernels.exponent_sample``, ``sparse.model_bounds``,
``rans.quantize_all``, ``context._split``, ``segbits`` and ``simd``: after editing one of those,
delete ``p2psync/codec/__pycache__/segencode.*`` (a fresh clone has no cache; compiling this module
takes ~12 s once, in ``decode.warm_up``).
"""

from __future__ import annotations

import struct
import threading

import numpy as np
from numba import njit

from p2psync.codec import context, kernels, rans, segbits
from p2psync.codec.segment import KIND_DELTA, SegmentStats, pack_payload
from p2psync.codec.sparse import encode_changes, model_bounds
from p2psync.dtypes import DType

_U64 = np.uint64
_ONE = np.uint64(1)
_ESC = rans.ESCAPE
_HEAD_FIXED = 21 + 5 + 8  # common header, n and bucket count, the two Rice stream lengths


# --- little helpers -------------------------------------------------------------------------
@njit(nogil=True, cache=True, inline="always")
def _put_le(out, o, v, nbytes):
    for i in range(nbytes):
        out[o + i] = np.uint8((v >> (8 * i)) & 0xFF)
    return o + nbytes


# --- the segment ---------------------------------------------------------------------------
# ``stats`` arrays: changes in buckets >= 1, >= 2, >= 3 (buckets nest), then escapes in all
# buckets and in buckets >= 1, >= 2, >= 3.
_N_STATS = 7


@njit(nogil=True, cache=True, inline="always")
def _zigzag(wo, wn, wmask, top):
    """zigzag(wn - wo) in words of ``top + 1`` bits (u64 in, u64 out)."""
    dlt = (wn - wo) & wmask
    return ((dlt << _ONE) ^ (_U64(0) - ((dlt >> top) & _ONE))) & wmask


@njit(nogil=True, cache=True)
def change_stats(pos, old_w, new_w, bucket, nt, shift, exp_mask, seed, stats, hist4):
    """Per-change statistics that :func:`encode_body` needs first: ``stats``, the base exponent
    histogram in ``hist4`` (four histograms to be summed), and the fingerprint change (returned;
    ``kernels.hash_change``, a loop LLVM vectorises). The counting loop has no memory-carried dependency,
    so LLVM vectorises it; the histogram is split four ways because a change usually has the
    exponent of the one before, and one counter in memory would chain them through a store and
    a load."""
    n = pos.shape[0]
    bits = 8 * old_w.itemsize
    wmask = ~_U64(0) >> _U64(64 - bits)
    top = _U64(bits - 1)
    esc = _U64(_ESC)
    c1 = c2 = c3 = 0
    x0 = x1 = x2 = x3 = 0
    for j in range(n):
        z = _zigzag(_U64(old_w[j]), _U64(new_w[j]), wmask, top)
        b = np.int64(bucket[j]) if nt else 0
        x = np.int64(z >= esc)
        c1 += b >= 1
        c2 += b >= 2
        c3 += b >= 3
        x0 += x
        x1 += x & (b >= 1)
        x2 += x & (b >= 2)
        x3 += x & (b >= 3)
    stats[0], stats[1], stats[2], stats[3], stats[4], stats[5], stats[6] = c1, c2, c3, x0, x1, x2, x3
    width_e = exp_mask + 1
    sh = _U64(shift)
    mk = _U64(exp_mask)
    hist4[:] = 0
    for j in range(n):
        hist4[(j & 3) * width_e + np.int64((_U64(old_w[j]) >> sh) & mk)] += 1
    return kernels.hash_change(pos, old_w, new_w, seed)


@njit(nogil=True, cache=True)
def encode_body(tensor, start, stop, pos, old_w, new_w, bucket, rank, thr, shift, exp_mask, stats, hist4,
                ranks_g, sym, mdl, planes, sbuf):
    """A delta segment (all of it up to the escape section) for the changes ``pos`` (sorted, in
    ``[start, stop)``) from the words ``old_w`` to ``new_w``, with bucket thresholds ``thr``, each
    change's ``bucket`` and ``rank`` (ignored with no thresholds: ranks are then positions), and
    their :func:`change_stats`.

    Scratch: ``ranks_g``, ``sym``, ``mdl`` (n slots), ``planes`` (n words of bytes), ``sbuf``
    (2n + 4 bytes). Returns ``(segment bytes, header length, Rice bytes, escapes)``; the escapes'
    byte planes are ``planes[:escapes * width]``."""
    n = pos.shape[0]
    nt = thr.shape[0]
    n_b = nt + 1
    width = old_w.itemsize
    bits = 8 * width
    wmask = ~_U64(0) >> _U64(64 - bits)
    top = _U64(bits - 1)
    sh = _U64(shift)
    mk = _U64(exp_mask)
    esc = _U64(_ESC)
    c1, c2, c3, x0, x1, x2, x3 = stats[0], stats[1], stats[2], stats[3], stats[4], stats[5], stats[6]
    width_e = exp_mask + 1
    hist = np.empty(width_e, dtype=np.int64)
    for e in range(width_e):
        hist[e] = hist4[e] + hist4[width_e + e] + hist4[2 * width_e + e] + hist4[3 * width_e + e]
    counts = np.zeros(4, dtype=np.int64)
    counts[0] = n - c1
    counts[1] = c1 - c2
    counts[2] = c2 - c3
    counts[3] = c3
    bounds = model_bounds(hist)
    nm = bounds.shape[0] + 1
    lut = np.zeros(width_e, dtype=np.int64)
    for bd in bounds:
        for e in range(bd, width_e):
            lut[e] += 1
    # In bucket order: each change's rank, symbol and model, and its escape straight into the
    # byte planes. The next slot of each bucket is in memory: selecting among four registers
    # compiled to branches, 3x slower on the mixed buckets of real segments (measured).
    off = np.empty(4, dtype=np.int64)
    off[0] = 0
    off[1] = counts[0]
    off[2] = off[1] + counts[1]
    off[3] = off[2] + counts[2]
    ne = x0
    eoff = np.empty(4, dtype=np.int64)
    eoff[0] = 0
    eoff[1] = x0 - x1
    eoff[2] = eoff[1] + x1 - x2
    eoff[3] = eoff[2] + x2 - x3
    mh4 = np.zeros(4 * nm * rans.ALPHABET, dtype=np.int64)
    for j in range(n):
        wo = _U64(old_w[j])
        z = _zigzag(wo, _U64(new_w[j]), wmask, top)
        if nt:
            b = np.int64(bucket[j])
            r = rank[j]
        else:
            b = 0
            r = pos[j] - start
        k = off[b]
        off[b] = k + 1
        ranks_g[k] = r
        s = np.int64(min(z, esc))
        m = lut[np.int64((wo >> sh) & mk)]
        sym[k] = s
        mdl[k] = m
        mh4[((j & 3) * nm + m) * rans.ALPHABET + s] += 1
        if z >= esc:
            t = eoff[b]
            eoff[b] = t + 1
            for c in range(width):
                planes[c * ne + t] = np.uint8((z >> _U64(8 * c)) & _U64(0xFF))
    mh = np.empty((nm, rans.ALPHABET), dtype=np.int64)
    stride = nm * rans.ALPHABET
    for m in range(nm):
        for s in range(rans.ALPHABET):
            i = m * rans.ALPHABET + s
            mh[m, s] = mh4[i] + mh4[stride + i] + mh4[2 * stride + i] + mh4[3 * stride + i]
    # positions: Rice per bucket
    starts = np.zeros(n_b, dtype=np.int64)
    ends = np.zeros(n_b, dtype=np.int64)
    acc = 0
    for b in range(n_b):
        starts[b] = acc
        acc += counts[b]
        ends[b] = acc
    ks = np.zeros(n_b, dtype=np.int64)
    ubits, rbits = segbits.rice_plan(ranks_g[:n], starts, ends, ks)
    ulen = (ubits + 7) // 8
    rlen = (rbits + 7) // 8
    # residuals: tables, then the rANS stream (written backwards into ``sbuf``)
    freqs = rans.quantize_all(mh)
    so = segbits.rans_encode(sym, mdl, n, freqs, sbuf)
    slen = sbuf.shape[0] - so
    present = 0
    for m in range(nm):
        for s in range(rans.ALPHABET):
            present += np.int64(freqs[m, s] != 0)
    head = _HEAD_FIXED + 2 * nt + 5 * n_b
    total = head + ulen + rlen + 1 + 4 * nm + 2 * present + 2 * (nm - 1) + 4 + slen
    out = np.empty(total + 8, dtype=np.uint8)  # the Rice writer stores 8 bytes at a time
    o = _put_le(out, 0, KIND_DELTA, 1)
    o = _put_le(out, o, tensor, 4)
    o = _put_le(out, o, start, 8)
    o = _put_le(out, o, stop, 8)
    o = _put_le(out, o, n, 4)
    o = _put_le(out, o, n_b, 1)
    for i in range(nt):
        o = _put_le(out, o, thr[i], 2)
    for b in range(n_b):
        o = _put_le(out, o, counts[b], 4)
        o = _put_le(out, o, ks[b], 1)
    o = _put_le(out, o, ulen, 4)
    o = _put_le(out, o, rlen, 4)
    segbits.rice_write(ranks_g, starts, ends, ks, out, o, o + ulen)
    o += ulen + rlen
    o = _put_le(out, o, nm, 1)
    for m in range(nm):
        mask = 0
        for s in range(rans.ALPHABET):
            if freqs[m, s]:
                mask |= 1 << s
        o = _put_le(out, o, mask, 4)
        for s in range(rans.ALPHABET):
            if freqs[m, s]:
                o = _put_le(out, o, freqs[m, s], 2)
    for bd in bounds:
        o = _put_le(out, o, bd, 2)
    o = _put_le(out, o, slen, 4)
    out[o:o + slen] = sbuf[so:]
    return out[:total], head, ulen + rlen, ne


@njit(nogil=True, cache=True)
def scan_encode(tensor, old, new, start, end, cap, thr, shift, exp_mask, seed, pos_b, old_b, new_b, bkt_b, rank_b,
                ranks_g, sym, mdl, planes, sbuf):
    """The next segment of a job in one call: ``kernels.find_ranked_changes`` from ``start`` (up to
    ``cap`` changes; ``find_changes`` with no thresholds), then :func:`change_stats` and
    :func:`encode_body`. Returns ``(stop, n, segment bytes, header length, Rice bytes, escapes,
    (hash lane a, b))``; with no change in ``[start, end)``, ``n`` is 0 and the rest is empty.

    The statistics are a loop of their own, not gathered in the scan while each change's words
    are in registers: that makes the scan of the benchmark model ~15 % slower (it is not purely
    waiting on memory, and its per-change code loses its shape)."""
    nt = thr.shape[0]
    if nt:
        consts = np.empty(4, dtype=old.dtype)  # ``context.consts_for``
        consts[:] = (exp_mask << shift) | ((1 << shift) - 1)
        for i in range(nt):
            consts[1 + i] = (thr[i] << shift) - 1
        stop, n = kernels.find_ranked_changes(old, new, start, end, cap, consts, pos_b, old_b, new_b, bkt_b, rank_b)
    else:
        stop, n = kernels.find_changes(old, new, start, end, cap, pos_b, old_b, new_b)
    z = _U64(0)
    if n == 0:
        return stop, 0, np.empty(0, dtype=np.uint8), 0, 0, 0, (z, z)
    stats = np.empty(_N_STATS, dtype=np.int64)
    hist4 = np.empty(4 * (exp_mask + 1), dtype=np.int64)
    h = change_stats(pos_b[:n], old_b[:n], new_b[:n], bkt_b[:n], nt, shift, exp_mask, seed, stats, hist4)
    out, head, rice_len, ne = encode_body(tensor, start, stop, pos_b[:n], old_b[:n], new_b[:n], bkt_b[:n],
                                          rank_b[:n], thr, shift, exp_mask, stats, hist4, ranks_g, sym, mdl,
                                          planes, sbuf[:2 * n + 4])
    return stop, n, out, head, rice_len, ne, h


# --- threshold choice ----------------------------------------------------------------------
@njit(nogil=True, cache=True)
def _choose(chist, old, start, stop, shift, exp_mask, max_buckets, thr_out):
    """``context.choose_thresholds`` from the change sample ``chist``: writes the thresholds to
    ``thr_out`` and returns how many, or -1 where the reference must decide (the estimated change
    count within 1e-9 of the cut-off, where numpy's pairwise sum could round the other way; more
    candidate exponents than the reference coarsens to)."""
    width = exp_mask + 1
    span = stop - start
    f = span / max(1, kernels.sampled_elements(start, stop))
    c = np.empty(width, dtype=np.float64)
    tot = 0.0
    for e in range(width):
        c[e] = np.float64(chist[e]) * f
        tot += c[e]
    lim = np.float64(context._MIN_CHANGES)
    if tot < lim * (1.0 - 1e-9):
        return 0
    if tot < lim * (1.0 + 1e-9):
        return -1
    hist = np.empty(width, dtype=np.int64)
    counted = kernels.exponent_sample(old, start, stop, shift, exp_mask, hist)
    g = span / max(1, counted)
    cand = np.empty(width, dtype=np.int64)
    ns = np.empty(width, dtype=np.float64)
    cs = np.empty(width, dtype=np.float64)
    nc = 0
    for e in range(width):
        v = np.float64(hist[e]) * g
        v = max(v, c[e])
        if v > 0:
            cand[nc] = e
            ns[nc] = v
            cs[nc] = c[e]
            nc += 1
    if nc <= 1:
        return 0
    if nc > context._MAX_CANDIDATES:
        return -1
    starts = np.zeros(max_buckets, dtype=np.int64)
    k = context._split(ns[:nc], cs[:nc], max_buckets, context._BUCKET_BITS, starts)
    for i in range(k):
        thr_out[i] = cand[starts[i]]
    return k


@njit(nogil=True, cache=True)
def _scan_thresholds(old, new, start, stop, shift, exp_mask, max_buckets, thr_out):
    hist = np.empty(exp_mask + 1, dtype=np.int64)
    kernels.change_sample(old, new, start, stop, shift, exp_mask, hist)
    return _choose(hist, old, start, stop, shift, exp_mask, max_buckets, thr_out), hist


@njit(nogil=True, cache=True)
def _sparse_thresholds(old, positions, start, stop, shift, exp_mask, max_buckets, thr_out):
    hist = np.empty(exp_mask + 1, dtype=np.int64)
    kernels.change_sample_sparse(old, positions, start, stop, shift, exp_mask, hist)
    return _choose(hist, old, start, stop, shift, exp_mask, max_buckets, thr_out), hist


def job_thresholds(d: DType, old: np.ndarray, new: np.ndarray, start: int, stop: int, max_buckets: int
                   ) -> np.ndarray:
    """``context.job_thresholds`` (the same thresholds) in one compiled call."""
    if d.exp_mask == 0 or max_buckets <= 1:
        return np.zeros(0, dtype=np.int64)
    thr = np.zeros(max_buckets, dtype=np.int64)
    k, hist = _scan_thresholds(old, new, start, stop, d.exp_shift, d.exp_mask, max_buckets, thr)
    if k < 0:
        return context.choose_thresholds(d, old, start, stop, hist, max_buckets)
    return thr[:k]


def job_thresholds_sparse(d: DType, old: np.ndarray, positions: np.ndarray, start: int, stop: int,
                          max_buckets: int) -> np.ndarray:
    """``context.job_thresholds_sparse`` (the same thresholds) in one compiled call."""
    if d.exp_mask == 0 or max_buckets <= 1:
        return np.zeros(0, dtype=np.int64)
    thr = np.zeros(max_buckets, dtype=np.int64)
    k, hist = _sparse_thresholds(old, positions, start, stop, d.exp_shift, d.exp_mask, max_buckets, thr)
    if k < 0:
        return context.choose_thresholds(d, old, start, stop, hist, max_buckets)
    return thr[:k]


# --- Python side ---------------------------------------------------------------------------
_local = threading.local()
_NO_BUCKETS = np.zeros(0, dtype=np.uint8)
_NO_RANKS = np.zeros(0, dtype=np.int64)


def _scratch(n: int, width: int) -> tuple[np.ndarray, ...]:
    """Per-thread scratch of :func:`encode_body` (ranks, symbols, models, escape planes, rANS
    stream), reused across segments and sized by the largest segment the thread met: encoding
    memory does not grow with the model."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None or bufs[0].shape[0] < n or bufs[3].shape[0] < n * width:
        size = max(n, 1024, 0 if bufs is None else bufs[0].shape[0])
        pw = max(width, 0 if bufs is None else bufs[3].shape[0] // bufs[0].shape[0])
        bufs = new_scratch(size, pw)
        _local.bufs = bufs
    return bufs


def new_scratch(size: int, width: int) -> tuple[np.ndarray, ...]:
    """Scratch of :func:`encode_body` for up to ``size`` changes of ``width``-byte words."""
    return (np.empty(size, dtype=np.int64), np.empty(size, dtype=np.uint8), np.empty(size, dtype=np.uint8),
            np.empty(size * width, dtype=np.uint8), np.empty(2 * size + 4, dtype=np.uint8))


@njit(nogil=True, cache=True)
def encode_changes_body(tensor, start, stop, pos, old_w, new_w, bucket, rank, thr, shift, exp_mask, seed,
                        ranks_g, sym, mdl, planes, sbuf):
    """:func:`change_stats` and :func:`encode_body` of changes found elsewhere, in one call.
    Returns ``(segment bytes, header length, Rice bytes, escapes, (hash lane a, b))``."""
    stats = np.empty(_N_STATS, dtype=np.int64)
    hist4 = np.empty(4 * (exp_mask + 1), dtype=np.int64)
    h = change_stats(pos, old_w, new_w, bucket, thr.shape[0], shift, exp_mask, seed, stats, hist4)
    out, head, rice_len, ne = encode_body(tensor, start, stop, pos, old_w, new_w, bucket, rank, thr, shift, exp_mask,
                                          stats, hist4, ranks_g, sym, mdl, planes, sbuf)
    return out, head, rice_len, ne, h


def _finish(out: np.ndarray, head: int, rice_len: int, ne: int, n: int, planes: np.ndarray, width: int, level: int,
            h: tuple) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """The segment with its escape section (zstd when it saves bytes), its statistics and hash
    change."""
    esc_codec, esc = pack_payload(planes[:ne * width].data, level) if ne else (0, b"")
    seg = b"".join((out.data, struct.pack("<BI", esc_codec, len(esc)), esc))
    stats = SegmentStats(header=head, positions=rice_len, residuals=len(seg) - head - rice_len, changed=n)
    return seg, stats, (int(h[0]), int(h[1]))


def encode(
    tensor: int, start: int, stop: int, old: np.ndarray, pos: np.ndarray, old_w: np.ndarray, new_w: np.ndarray,
    d: DType, thresholds: np.ndarray, level: int, seed: np.uint64,
    ranked: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """:func:`~p2psync.codec.sparse.encode_changes` (same arguments, same bytes) in one compiled
    call, plus zstd of the escapes. Keeps no reference to its array arguments."""
    n = int(pos.shape[0])
    if n == 0:  # no caller makes an empty segment; the reference covers it
        return encode_changes(tensor, start, stop, old, pos, old_w, new_w, d, thresholds, level, seed, ranked)
    thr = np.ascontiguousarray(thresholds, dtype=np.int64)
    if thr.shape[0] == 0:
        bucket, rank = _NO_BUCKETS, _NO_RANKS
    elif ranked is None:
        bucket = np.empty(n, dtype=np.uint8)
        rank = np.empty(n, dtype=np.int64)
        kernels.rank_changes(old, start, context.consts_for(d, thr), pos, bucket, rank)
    else:
        bucket, rank = ranked
    ranks_g, sym, mdl, planes, sbuf = _scratch(n, d.width)
    out, head, rice_len, ne, h = encode_changes_body(tensor, start, stop, pos, old_w, new_w, bucket, rank, thr,
                                                     d.exp_shift, d.exp_mask, seed, ranks_g, sym, mdl, planes,
                                                     sbuf[:2 * n + 4])
    return _finish(out, head, rice_len, ne, n, planes, d.width, level, h)


def scan(tensor: int, d: DType, old: np.ndarray, new: np.ndarray, at: int, end: int, cap: int, thresholds: np.ndarray,
         level: int, seed: np.uint64, bufs: tuple[np.ndarray, ...]
         ) -> tuple[int, tuple[bytes, SegmentStats, tuple[int, int]] | None]:
    """The next segment of a job from ``at``: ``(stop, (segment, statistics, hash change))``, or
    ``(end, None)`` when ``[at, end)`` holds no change. ``bufs``: the scan's buffers (positions,
    old and new words, buckets, ranks; ``cap + 64`` slots) followed by :func:`new_scratch` for
    ``cap + 64`` changes, used by one thread at a time. The same segments as
    ``kernels.find_ranked_changes`` and :func:`~p2psync.codec.sparse.encode_changes`."""
    thr = np.ascontiguousarray(thresholds, dtype=np.int64)
    pos_b, old_b, new_b, bkt_b, rank_b, ranks_g, sym, mdl, planes, sbuf = bufs
    stop, n, out, head, rice_len, ne, h = scan_encode(
        tensor, old, new, at, end, cap, thr, d.exp_shift, d.exp_mask, seed, pos_b, old_b, new_b, bkt_b, rank_b,
        ranks_g, sym, mdl, planes, sbuf)
    if n == 0:
        return stop, None
    return stop, _finish(out, head, rice_len, ne, n, planes, d.width, level, h)
