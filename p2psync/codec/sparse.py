"""Coding one segment's changes: positions by magnitude bucket and rank, residuals by exponent.

Layout of a delta segment's body (after the common header of ``segment``)::

    u32 n                changed elements in [start, stop)
    u8  n_buckets        1..4 (1: context-free positions)
    u16 threshold * (n_buckets - 1)
                         exponent values, strictly increasing, 1..exp_mask: bucket b holds
                         the base words whose exponent field is in [t_b, t_(b+1))
    (u32 count, u8 k) * n_buckets
                         changes per bucket, Rice parameter of its rank gaps
    u32 unary_len, u32 rem_len, unary bytes, rem bytes
                         Rice code of each bucket's ranks, bucket after bucket (``rice``)
    u8 n_models, then per model a frequency table (``rans``)
    u16 bound * (n_models - 1)
                         exponent values, strictly increasing, 1..exp_mask: model m codes the
                         residuals of changes whose base exponent is in [bound_m, bound_(m+1))
    u32 len, bytes       rANS stream of min(zigzag(new - old), 31), in bucket-then-rank order
    u8 codec, u32 len    escapes: zigzag residuals >= 31 in the same order, as byte planes

A change's *rank* is the number of elements of its bucket before it in the
segment (``kernels``). The receiver recomputes buckets from its base words, so
the positions cost only the gaps between ranks of one bucket, whose rate that
bucket's magnitude predicts. Residuals are coded in the order in which the
decoder finds positions, so it never sorts.
"""

from __future__ import annotations

import struct

import numpy as np
from numba import njit

from p2psync.codec import context, kernels, positions, rans, rice
from p2psync.codec.segment import (
    BUCKET_TABLE,
    CODEC_RAW,
    CODEC_ZSTD,
    KIND_DELTA,
    ParsedSegment,
    SegmentStats,
    encode_header,
    pack_payload,
    planes,
    unpack_payload,
    unplanes,
    unzigzag,
)
from p2psync.codec.segrans import model_lut
from p2psync.codec.wire import Reader
from p2psync.dtypes import DType
from p2psync.errors import CodecError

# Exponents are merged (neighbours first) until a residual table covers this many changes: a
# table costs up to ~70 bytes, so smaller groups would pay more than they save.
MIN_CHANGES_PER_MODEL = 4096


@njit(nogil=True, cache=True)
def model_bounds(counts):
    """Residual model boundaries: runs of neighbouring exponents holding >= 4096 changes each
    (``counts``: changes per exponent)."""
    bounds = np.empty(254, dtype=np.int64)
    nb = 0
    acc = 0
    for e in range(counts.shape[0]):
        c = counts[e]
        if c == 0:
            continue
        if acc >= MIN_CHANGES_PER_MODEL and nb < 254:
            bounds[nb] = e
            nb += 1
            acc = 0
        acc += c
    if nb and acc < MIN_CHANGES_PER_MODEL:  # fold a small tail into its neighbour
        nb -= 1
    return bounds[:nb].copy()


def _check_exponents(values: list[int] | np.ndarray, d: DType, what: str) -> None:
    prev = 0
    for v in values:
        if not prev < int(v) <= d.exp_mask:
            raise CodecError(f"segment: {what} out of range or out of order for {d.code}")
        prev = int(v)


# --- encoding ------------------------------------------------------------------------------
def encode_changes(
    tensor: int, start: int, stop: int, old: np.ndarray, pos: np.ndarray, old_w: np.ndarray, new_w: np.ndarray,
    d: DType, thresholds: np.ndarray, level: int, seed: np.uint64,
    ranked: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """A delta segment for the changes ``pos`` (sorted, in ``[start, stop)``) from ``old_w`` (the
    words of ``old`` there) to ``new_w``, with the bucket ``thresholds`` of its job
    (``context.choose_thresholds``). ``ranked``: each change's (bucket, rank) if the caller found
    them already (``kernels.find_ranked_changes``). Keeps no reference to its array arguments.

    Returns the segment, its statistics and what it adds to the tensor's fingerprint sums."""
    n = int(pos.shape[0])
    zres = np.empty(n, dtype=d.word)
    exps = np.empty(n, dtype=np.int64)
    hist = np.empty(d.exp_mask + 1, dtype=np.int64)
    da, db = kernels.prepare_changes(pos, old_w, new_w, d.exp_shift, d.exp_mask, 8 * d.width, seed, zres, exps, hist)
    thr = thresholds
    n_b = thr.shape[0] + 1
    if n_b == 1:
        ranks = pos - start
        counts = np.array([n], dtype=np.int64)
    else:
        if ranked is None:
            bucket = np.empty(n, dtype=np.uint8)
            rank = np.empty(n, dtype=np.int64)
            kernels.rank_changes(old, start, context.consts_for(d, thr), pos, bucket, rank)
        else:
            bucket, rank = ranked
        counts = np.empty(4, dtype=np.int64)
        ranks = np.empty(n, dtype=np.int64)
        zres_g = np.empty_like(zres)
        exps_g = np.empty_like(exps)
        kernels.group_by_bucket(bucket, rank, zres, exps, counts, ranks, zres_g, exps_g)
        counts, zres, exps = counts[:n_b], zres_g, exps_g
    ends = np.cumsum(counts)
    starts = ends - counts
    ks = np.empty(n_b, dtype=np.int64)
    ubits, rbits = rice.plan(ranks, starts, ends, ks)
    unary = np.zeros((ubits + 7) // 8, dtype=np.uint8)
    rem = np.zeros((rbits + 7) // 8, dtype=np.uint8)
    rice.write(ranks, starts, ends, ks, unary, rem)

    res = _encode_residuals(exps, zres, hist, d, level)

    table = np.zeros(n_b, dtype=BUCKET_TABLE)
    table["count"] = counts
    table["k"] = ks
    head = encode_header(KIND_DELTA, tensor, start, stop) + struct.pack("<IB", n, n_b)
    head += thr.astype("<u2").tobytes() + table.tobytes() + struct.pack("<II", unary.shape[0], rem.shape[0])
    stats = SegmentStats(header=len(head), positions=unary.shape[0] + rem.shape[0], residuals=len(res), changed=n)
    return b"".join((head, unary.tobytes(), rem.tobytes(), res)), stats, (int(da), int(db))


def _encode_residuals(exps: np.ndarray, zres: np.ndarray, exp_hist: np.ndarray, d: DType, level: int) -> bytes:
    bounds = model_bounds(exp_hist)
    n_models = bounds.shape[0] + 1
    n = zres.shape[0]
    symbols = np.empty(n, dtype=np.uint8)
    model_of = np.empty(n, dtype=np.int64)
    hist = np.empty((n_models, rans.ALPHABET), dtype=np.int64)
    n_esc = kernels.residual_symbols(zres, exps, model_lut(bounds, d.exp_mask + 1), rans.ESCAPE, symbols, model_of,
                                     hist)
    freqs = rans.quantize_all(hist)
    stream = rans.encode(symbols, model_of, freqs)
    escaped = zres[zres >= rans.ESCAPE] if n_esc else zres[:0]
    esc_codec, esc = pack_payload(planes(escaped), level)
    return b"".join((rans.encode_models(freqs), bounds.astype("<u2").tobytes(), struct.pack("<I", len(stream)),
                     stream, struct.pack("<BI", esc_codec, len(esc)), esc))


# --- decoding ------------------------------------------------------------------------------
def decode_changes(p: ParsedSegment, d: DType, old: np.ndarray, seed: np.uint64
                   ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(positions, new words, fingerprint sum change) of a parsed delta segment against ``old``.

    Positions come bucket after bucket (each bucket's in increasing order), all distinct.

    The step-by-step decoder, one stage per call: the readable statement of what decoding a
    segment means. :func:`p2psync.codec.segdecode.decode` does the same in one compiled call and is
    what appliers use; tests hold the two to the same results and errors on every input."""
    assert p.thresholds is not None and p.counts is not None and p.ks is not None
    assert p.unary is not None and p.rem is not None and p.res is not None
    if p.thresholds.shape[0] and d.exp_mask == 0:
        raise CodecError(f"segment: {d.code} has no exponent to bucket by")
    _check_exponents(p.thresholds, d, "bucket threshold")
    span = p.stop - p.start
    ranks = np.empty(p.n, dtype=np.int64)
    status = rice.read(p.unary, p.rem, p.counts, p.ks, span, ranks)
    if status != 0:
        raise CodecError(f"segment: position streams are malformed (code {status})")
    if p.thresholds.shape[0] == 0:
        pos = ranks + p.start
        old_w = old[pos]
    else:
        pos = np.empty(p.n, dtype=np.int64)
        old_w = np.empty(p.n, dtype=old.dtype)
        counts = np.zeros(4, dtype=np.int64)
        counts[: p.counts.shape[0]] = p.counts
        found = positions.locate(old, p.start, p.stop, context.consts_for(d, p.thresholds), counts, ranks, pos, old_w)
        if found != p.n:
            raise CodecError(f"segment: {p.n - found} changes fall outside the range")
    new_w = _decode_residuals(p.res, old_w, d)
    a, b = kernels.hash_change(pos, old_w, new_w, seed)
    return pos, new_w, (int(a), int(b))


def _decode_residuals(res: memoryview, old_w: np.ndarray, d: DType) -> np.ndarray:
    """New words of the changes to the base words ``old_w``."""
    r = Reader(res, "residuals")
    freqs = rans.read_models(r)
    bounds = np.frombuffer(r.take(2 * (freqs.shape[0] - 1)), dtype="<u2").astype(np.int64)
    _check_exponents(bounds, d, "residual model bound")
    stream = r.take(r.u32())
    esc_codec, esc_len = r.unpack("BI")
    esc = r.take(esc_len)
    r.done()
    new_w, big = rans.decode_words(stream, old_w, d.exp_shift, d.exp_mask, model_lut(bounds, d.exp_mask + 1), freqs)
    if big.shape[0]:
        vals = unplanes(unpack_payload(esc_codec, esc, big.shape[0] * d.width), big.shape[0], d.word)
        if int(vals.min()) < rans.ESCAPE:
            raise CodecError("residuals: escaped value is small enough to be a symbol")
        new_w[big] = old_w[big] + unzigzag(vals)
    elif esc_len or esc_codec not in (CODEC_RAW, CODEC_ZSTD):
        raise CodecError("residuals: escapes present but no escape symbol")
    return new_w
