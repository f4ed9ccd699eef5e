"""The one-call segment encoder (``segencode``) writes the bytes of the step-by-step one.

The step-by-step encoder (``context.job_thresholds``, ``kernels.find_ranked_changes``,
``sparse.encode_changes``; ``encode._scan_job_reference``) is the statement of the format; the
compiled path must produce the same chunks, fingerprints and statistics for every input: every
word width, densities from 0.1 % to all elements, residuals that escape, one to four buckets, raw
and zstd escapes, jobs cut into several segments, and the sparse path (positions found
elsewhere). Its pieces are checked on their own too: thresholds (including the cases it hands
back to the reference), the Rice writer on huge gaps and parameters above 32, rANS with
reciprocals on frequencies 1 to 4096.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync import dtypes
from p2psync.codec import context, encode, kernels, rans, rice, segbits, segencode, sparse
from p2psync.codec.decode import split_chunk
from p2psync.codec.encode import CodecOptions, encode_delta, encode_delta_sparse
from p2psync.state import tensor_seed
from tests.unit.p2psync.helpers import state_from_words

_FLOATS = {"BF16": np.float32, "F16": np.float16, "F32": np.float32}


def _float_words(code: str, values: np.ndarray) -> np.ndarray:
    if code == "BF16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(_FLOATS[code]).view(dtypes.from_code(code).word)


def _step(rng, code: str, n: int, density: float, ulps: int) -> tuple[np.ndarray, np.ndarray]:
    """Base words of weights ~N(0, 0.02) and new words that move about ``density`` of them by up to
    ``ulps`` units in the last place, more often where the magnitude is small (as under an
    optimizer step)."""
    d = dtypes.from_code(code)
    if code in _FLOATS:
        old = _float_words(code, rng.normal(0, 0.02, n))
    else:
        old = rng.integers(0, 1 << (8 * d.width), n, dtype=np.uint64).astype(d.word)
    if d.exp_mask:
        e = ((old >> d.word.type(d.exp_shift)) & d.word.type(d.exp_mask)).astype(np.float64)
        p = density * np.exp2(-(e - e.min()) / 4) if density < 1 else np.ones(n)
    else:
        p = np.full(n, density)
    changed = rng.random(n) < np.minimum(1.0, p)
    step = rng.integers(1, ulps + 1, n) * rng.choice([-1, 1], n)
    new = old.copy()
    new[changed] = (old[changed].astype(np.int64) + step[changed]).astype(d.word)
    return old, new


def _reference(monkeypatch) -> None:
    """Make ``encode_delta`` and ``encode_delta_sparse`` run the step-by-step encoder."""
    monkeypatch.setattr(encode, "_scan_job", encode._scan_job_reference)
    monkeypatch.setattr(encode, "_encode_segment", sparse.encode_changes)
    monkeypatch.setattr(encode, "_thresholds", context.job_thresholds)
    monkeypatch.setattr(encode, "_thresholds_sparse", context.job_thresholds_sparse)


def _summary(art) -> tuple:
    return (art.chunks, art.base_fingerprint, art.target_fingerprint, art.target_sums, art.changed, art.stats)


CASES = st.tuples(
    st.sampled_from(["BF16", "F16", "F32", "U8"]),
    st.sampled_from([10, 700, 5000, 40000]),
    st.sampled_from([0.001, 0.02, 0.3, 0.97, 1.0]),  # changed share
    st.sampled_from([1, 8, 300]),  # step in ULPs: 300 makes most residuals escapes
    st.integers(1, 4),  # context buckets
    st.sampled_from([0, 3]),  # zstd level: 0 keeps escapes raw
    st.sampled_from([64 << 10, 1 << 20]),  # chunk size: 64 KiB cuts dense jobs into several segments
    st.integers(0, 2**31),
)


def _states(case):
    code, n, density, ulps, buckets, level, chunk, seed = case
    rng = np.random.default_rng(seed)
    old, new = _step(rng, code, n, density, ulps)
    # a second tensor, so segments name tensor 1 and the jobs of a tensor start past 0
    old2, new2 = _step(rng, code, 3 * n + 5, density, ulps)
    base = state_from_words({"a": (code, old), "b": (code, old2)})
    target = state_from_words({"a": (code, new), "b": (code, new2)})
    opts = CodecOptions(chunk_size=chunk, threads=1, segment_elements=max(1024, n), zstd_level=level,
                        context_buckets=buckets)
    return base, target, opts


@settings(max_examples=150, deadline=None)
@given(CASES)
def test_compiled_encoder_writes_the_reference_bytes(case):
    base, target, opts = _states(case)
    fast = encode_delta(base, target, opts)
    changes = {}
    for name in ("a", "b"):
        pos = np.flatnonzero(base.words(name) != target.words(name))
        changes[name] = (pos, target.words(name)[pos])
    fast_sparse = encode_delta_sparse(base, changes, opts)
    with pytest.MonkeyPatch.context() as m:
        _reference(m)
        ref = encode_delta(base, target, opts)
        ref_sparse = encode_delta_sparse(base, changes, opts)
    assert _summary(fast) == _summary(ref)
    assert _summary(fast_sparse) == _summary(ref_sparse)
    assert fast.chunks == fast_sparse.chunks


@pytest.mark.parametrize("threads", [1, 2])
def test_dense_jobs_cut_into_segments_match_the_reference(threads, monkeypatch):
    """Every element changes and a 64 KiB chunk holds ~5,900 changes: each job ends several
    segments early."""
    rng = np.random.default_rng(7)
    items_old, items_new = {}, {}
    for i, code in enumerate(["BF16", "F32", "U8", "F16"]):
        old, new = _step(rng, code, 30000 + 333 * i, 1.0, 40)
        items_old[f"t{i}"], items_new[f"t{i}"] = (code, old), (code, new)
    base, target = state_from_words(items_old), state_from_words(items_new)
    opts = CodecOptions(chunk_size=64 << 10, threads=threads, segment_elements=1 << 14, zstd_level=3)
    fast = encode_delta(base, target, opts)
    with monkeypatch.context() as m:
        _reference(m)
        ref = encode_delta(base, target, opts)
    assert _summary(fast) == _summary(ref)
    jobs = sum(-(-s.numel // opts.segment_elements) for s in base.specs)
    assert sum(len(split_chunk(c)) for c in fast.chunks) >= 2 * jobs


def test_segments_of_an_offset_range_match_the_reference():
    """A segment that starts inside a tensor, ranked by the caller or not."""
    rng = np.random.default_rng(3)
    d = dtypes.from_code("BF16")
    old, new = _step(rng, "BF16", 50000, 0.9, 3)
    start, stop = 1234, 48000
    pos = np.flatnonzero(old[start:stop] != new[start:stop]).astype(np.int64) + start
    thr = context.job_thresholds(d, old, new, start, stop, 4)
    assert thr.shape[0] >= 1
    seed = tensor_seed("w")
    bucket = np.empty(pos.shape[0], dtype=np.uint8)
    rank = np.empty(pos.shape[0], dtype=np.int64)
    kernels.rank_changes(old, start, context.consts_for(d, thr), pos, bucket, rank)
    for ranked in (None, (bucket, rank)):
        for level in (0, 3):
            ref = sparse.encode_changes(5, start, stop, old, pos, old[pos], new[pos], d, thr, level, seed, ranked)
            got = segencode.encode(5, start, stop, old, pos, old[pos], new[pos], d, thr, level, seed, ranked)
            assert got == ref


# --- thresholds -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["BF16", "F16", "F32", "F8_E4M3"]), st.integers(1, 200_000), st.floats(0.0, 1.0),
       st.integers(1, 4), st.integers(0, 2**31))
def test_thresholds_are_the_reference_thresholds(code, n, density, buckets, seed):
    rng = np.random.default_rng(seed)
    d = dtypes.from_code(code)
    if code == "F8_E4M3":
        old = rng.integers(0, 256, n, dtype=np.uint64).astype(d.word)
        new = old.copy()
        flip = rng.random(n) < density
        new[flip] ^= d.word.type(1)
    else:
        old, new = _step(rng, code, n, density, 2)
    start = int(rng.integers(0, max(1, n // 3)))
    stop = n
    pos = np.flatnonzero(old != new).astype(np.int64)
    assert np.array_equal(segencode.job_thresholds(d, old, new, start, stop, buckets),
                          context.job_thresholds(d, old, new, start, stop, buckets))
    assert np.array_equal(segencode.job_thresholds_sparse(d, old, pos, start, stop, buckets),
                          context.job_thresholds_sparse(d, old, pos, start, stop, buckets))


def test_thresholds_hand_the_close_and_the_coarsened_cases_to_the_reference():
    d = dtypes.from_code("F32")
    rng = np.random.default_rng(0)
    # random bits: every exponent occurs, more candidates than the reference keeps (it coarsens)
    old = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    new = old ^ np.uint32(1)
    thr = np.zeros(4, dtype=np.int64)
    k, _ = segencode._scan_thresholds(old, new, 0, old.shape[0], d.exp_shift, d.exp_mask, 4, thr)
    assert k == -1
    assert np.array_equal(segencode.job_thresholds(d, old, new, 0, old.shape[0], 4),
                          context.job_thresholds(d, old, new, 0, old.shape[0], 4))
    # exactly 64 estimated changes, the cut-off itself: 4 changes in sampled blocks (every 16th
    # block of 64), each standing for 16
    old = _float_words("F32", rng.normal(0, 0.02, 1 << 16))
    new = old.copy()
    new[::1 << 14] += np.uint32(1)
    assert segencode._scan_thresholds(old, new, 0, old.shape[0], d.exp_shift, d.exp_mask, 4, thr)[0] == -1
    assert np.array_equal(segencode.job_thresholds(d, old, new, 0, old.shape[0], 4),
                          context.job_thresholds(d, old, new, 0, old.shape[0], 4))


# --- Rice and rANS pieces ---------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**22), max_size=60, unique=True), min_size=1, max_size=4),
       st.data())
def test_rice_writer_writes_the_reference_streams(groups, data):
    groups = [sorted(g) for g in groups]
    ranks = np.array([r for g in groups for r in g], dtype=np.int64)
    counts = np.array([len(g) for g in groups], dtype=np.int64)
    ends = np.cumsum(counts)
    starts = ends - counts
    ks = np.empty(len(groups), dtype=np.int64)
    ubits, rbits = rice.plan(ranks, starts, ends, ks)
    ks2 = np.empty(len(groups), dtype=np.int64)
    assert segbits.rice_plan(ranks, starts, ends, ks2) == (ubits, rbits)
    assert np.array_equal(ks, ks2)
    # any parameter, not only the planned one: huge unary runs (k = 0) and remainders above 32 bits
    ks = np.array([data.draw(st.sampled_from([0, 1, 5, 31, 33, 40])) if data.draw(st.booleans()) else k
                   for k in ks], dtype=np.int64)
    ubits = rbits = 0
    for g, k in zip(groups, ks):
        gaps = np.diff(np.array([-1] + g, dtype=np.int64)) - 1
        ubits += int((gaps >> k).sum()) + len(g)
        rbits += len(g) * int(k)
    ulen, rlen = (ubits + 7) // 8, (rbits + 7) // 8
    unary = np.zeros(ulen, dtype=np.uint8)
    rem = np.zeros(rlen, dtype=np.uint8)
    rice.write(ranks, starts, ends, ks, unary, rem)
    out = np.full(ulen + rlen + 8, 0xAB, dtype=np.uint8)
    segbits.rice_write(ranks, starts, ends, ks, out, 0, ulen)
    assert out[:ulen].tobytes() == unary.tobytes()
    assert out[ulen:ulen + rlen].tobytes() == rem.tobytes()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3000), st.integers(0, 2**31))
def test_rans_with_reciprocals_writes_the_reference_stream(n_models, n, seed):
    rng = np.random.default_rng(seed)
    hist = np.zeros((n_models, rans.ALPHABET), dtype=np.int64)
    shape = rng.choice(["one", "skewed", "flat"])
    for m in range(n_models):
        if shape == "one":  # a single symbol: frequency 4096
            hist[m, rng.integers(0, rans.ALPHABET)] = 1
        elif shape == "skewed":  # frequencies down to 1
            hist[m] = (rng.pareto(0.7, rans.ALPHABET) * 10).astype(np.int64)
            hist[m, 0] += 1_000_000
        else:
            hist[m] = rng.integers(1, 50, rans.ALPHABET)
    freqs = rans.quantize_all(hist)
    model = rng.integers(0, n_models, n).astype(np.int64)
    sym = np.empty(n, dtype=np.uint8)
    for j in range(n):
        p = freqs[model[j]] / rans.M
        sym[j] = rng.choice(rans.ALPHABET, p=p)
    starts, f = rans._tables(freqs)
    ref = np.empty(2 * n + 16, dtype=np.uint8)
    o = rans._encode(sym, model, starts, f, ref)
    got = np.empty(2 * n + 4, dtype=np.uint8)
    o2 = segbits.rans_encode(sym, model.astype(np.uint8), n, freqs, got)
    assert got[o2:].tobytes() == ref[o:].tobytes()


def test_warm_up_compiles_the_encoder_too():
    from p2psync.codec.decode import warm_up

    warm_up(("BF16",))
    assert segencode.scan_encode.signatures
    assert segencode.encode_changes_body.signatures
