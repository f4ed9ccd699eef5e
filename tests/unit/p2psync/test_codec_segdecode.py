"""The one-call segment decoder (``segdecode``) agrees with the step-by-step one (``sparse.decode_changes``).

Same positions, new words and fingerprint change for every segment an encoder writes (sparse and
dense, every bucket count, raw and zstd escapes, segments small enough for the scanning rANS loop
and big enough for the table one), and the same typed error, with the same message, for mutated
segments. The fast Rice reader is checked against a reader that peeks every code separately.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from numba import njit

from p2psync import dtypes
from p2psync.codec import context, dense, positions, rice, segdecode
from p2psync.codec.decode import split_chunk
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.codec.segment import parse_head, parse_segment
from p2psync.codec.simd import clz64, load_be64
from p2psync.codec.sparse import decode_changes
from p2psync.errors import CodecError, TruncatedError
from p2psync.state import ModelState, tensor_seed
from tests.unit.p2psync.helpers import state_from_words

_FLOATS = {"BF16": np.float32, "F16": np.float16, "F32": np.float32}


def _float_words(code: str, values: np.ndarray) -> np.ndarray:
    """Raw words of ``values`` in dtype ``code`` (bf16 by truncating f32: enough for a test)."""
    if code == "BF16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(_FLOATS[code]).view(dtypes.from_code(code).word)


def _step(rng, code: str, n: int, density: float, ulps: int) -> tuple[np.ndarray, np.ndarray]:
    """Base words of weights ~N(0, 0.02) and new words that move ``density`` of them by up to
    ``ulps`` units in the last place (more where the magnitude is small, as under an optimizer)."""
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


def _outcome(fn):
    try:
        pos, new, sums = fn()
    except CodecError as exc:
        # Truncation messages count bytes from different origins (segment vs residual section).
        return type(exc), re.sub(r"\(needs .*\)", "", str(exc))
    return "ok", pos.tolist(), new.tolist(), sums


def _both(seg: memoryview, state: ModelState):
    """(reference outcome, fast outcome) of decoding one segment against ``state``."""
    head = parse_head(seg)
    spec = state.specs[head.tensor]
    d, old, seed = dtypes.from_code(spec.dtype), state.words(spec.name), tensor_seed(spec.name)

    def reference():
        p = parse_segment(seg)
        if p.kind != 1:
            raise CodecError("not a delta")
        return decode_changes(p, d, old, seed)

    def fast():
        p = parse_head(seg)
        if p.kind != 1:
            raise CodecError("not a delta")
        return segdecode.decode(seg, p.body_at, p.start, p.stop, d, old, seed)

    return _outcome(reference), _outcome(fast)


CASES = st.tuples(
    st.sampled_from(["BF16", "F16", "F32", "U8"]),
    st.sampled_from([10, 700, 5000, 40000]),  # elements: the scanning rANS loop below ~256 changes per model
    st.sampled_from([0.001, 0.02, 0.3, 0.97, 1.0]),  # changed share (dense fast paths from ~0.5)
    st.sampled_from([1, 8, 300]),  # step in ULPs: 300 makes most residuals escapes
    st.integers(1, 4),  # context buckets
    st.sampled_from([0, 3]),  # zstd level: 0 keeps escapes raw (decoded in the kernel)
    st.integers(0, 2**31),
)


@contextlib.contextmanager
def _sparse_only() -> Iterator[None]:
    """The encoder writes sparse segments at any density: no dense swap, no all-changed shortcut."""
    from p2psync.codec import encode

    with mock.patch.object(dense, "smaller", lambda encoded, *a: encoded), \
            mock.patch.object(encode, "_all_changed", lambda *a: None):
        yield


def _encoded(case):
    code, n, density, ulps, buckets, level, seed = case
    rng = np.random.default_rng(seed)
    old, new = _step(rng, code, n, density, ulps)
    base, target = state_from_words({"w": (code, old)}), state_from_words({"w": (code, new)})
    opts = CodecOptions(chunk_size=1 << 20, threads=1, segment_elements=1 << 16, zstd_level=level,
                        context_buckets=buckets)
    # Sparse segments at every density, the dense ones' too (the encoder would code some of those
    # ranges densely: ``dense``, tested in test_codec_dense.py), so the sparse decoder's dense paths stay covered.
    with _sparse_only():
        segs = [s for c in encode_delta(base, target, opts).chunks for s in split_chunk(c)]
    return base, target, segs


@settings(max_examples=120, deadline=None)
@given(CASES)
def test_fast_decoder_gives_the_reference_result_for_every_encoded_segment(case):
    base, target, segs = _encoded(case)
    for seg in segs:
        ref, fast = _both(seg, base)
        assert ref[0] == "ok"
        assert fast == ref
    out = base.clone()
    for seg in segs:
        p = parse_head(seg)
        pos, new, _ = segdecode.decode(seg, p.body_at, p.start, p.stop, dtypes.from_code(base.specs[0].dtype),
                                       base.words("w"), tensor_seed("w"))
        out.words("w")[pos] = new
    assert np.array_equal(out.words("w"), target.words("w"))


@settings(max_examples=40, deadline=None)
@given(CASES)
def test_a_copy_of_the_range_with_its_origin_decodes_like_the_whole_tensor(case):
    """``origin``: decoded against a copy of its range only (a backend whose words are not stored in
    checkpoint order), a segment gives the tensor's positions and the same fingerprint change."""
    base, _, segs = _encoded(case)
    d, seed = dtypes.from_code(base.specs[0].dtype), tensor_seed("w")
    for seg in segs:
        p = parse_head(seg)
        whole = segdecode.decode(seg, p.body_at, p.start, p.stop, d, base.words("w"), seed)
        part = segdecode.decode(seg, p.body_at, p.start, p.stop, d, base.words("w")[p.start:p.stop].copy(), seed,
                                origin=p.start)
        assert np.array_equal(part[0], whole[0]) and np.array_equal(part[1], whole[1]) and part[2] == whole[2]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CASES, st.data())
def test_fast_decoder_fails_like_the_reference_on_mutated_segments(case, data):
    base, _, segs = _encoded(case)
    assume(segs)
    raw = bytearray(segs[data.draw(st.integers(0, len(segs) - 1))])
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "byte", "cut", "grow"]))
        if kind == "flip":
            i = data.draw(st.integers(21, len(raw) - 1))  # past the common header (its checks are Python's)
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "byte":
            raw[data.draw(st.integers(21, len(raw) - 1))] = data.draw(st.integers(0, 255))
        elif kind == "cut" and len(raw) > 22:
            del raw[data.draw(st.integers(22, len(raw) - 1)):]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=6))
    ref, fast = _both(memoryview(bytes(raw)), base)
    assert fast == ref


# --- Rice: the windowed reader against one that peeks every code --------------------------
@njit
def _peek(buf, bitpos):
    return load_be64(buf, bitpos >> 3) << np.uint64(bitpos & 7)


@njit
def _read_per_code(ubuf, ulen, rbuf, rlen, counts, ks, span, ranks_out):
    """The reader before the window and the run of zero codes: a 64-bit peek per code."""
    up = 0
    rp = 0
    ubits = ulen * 8
    rbits = rlen * 8
    o = 0
    for g in range(counts.shape[0]):
        k = ks[g]
        r = -1
        for _ in range(counts[g]):
            q = 0
            while True:
                if up >= ubits:
                    return -1
                ones = np.int64(clz64(~_peek(ubuf, up)))
                if ones < 57:
                    q += ones
                    up += ones + 1
                    break
                q += 56
                up += 56
                if q > span:
                    return -2
            if up > ubits:
                return -1
            if rp + k > rbits:
                return -3
            rem = 0
            if k:
                rem = np.int64(_peek(rbuf, rp) >> np.uint64(64 - k))
                rp += k
            if q > (span >> k):
                return -2
            r += ((q << k) | rem) + 1
            if r >= span:
                return -2
            ranks_out[o] = r
            o += 1
    if (up + 7) // 8 != ulen or (rp + 7) // 8 != rlen:
        return -4
    return 0


def _padded(b: bytes) -> np.ndarray:
    out = np.zeros(len(b) + 8, dtype=np.uint8)
    out[: len(b)] = np.frombuffer(b, dtype=np.uint8)
    return out


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=40), st.lists(st.integers(0, 80), min_size=1, max_size=4),
       st.data())
def test_rice_reader_matches_a_per_code_reader_on_any_bytes(unary, rem, counts, data):
    ks = np.array([data.draw(st.sampled_from([0, 0, 1, 3, 7, 40])) for _ in counts], dtype=np.int64)
    counts_a = np.array(counts, dtype=np.int64)
    span = data.draw(st.sampled_from([1, 50, 300, 10**6, 2**40]))
    if data.draw(st.booleans()):  # mostly zero bits: long runs of gap-0 codes, as in dense segments
        unary = bytes(b & data.draw(st.sampled_from([0, 0x10, 0x81])) for b in unary)
    out_a = np.full(int(counts_a.sum()), -7, dtype=np.int64)
    out_b = out_a.copy()
    sa = rice._read(_padded(unary), len(unary), _padded(rem), len(rem), counts_a, ks, span, out_a)
    sb = _read_per_code(_padded(unary), len(unary), _padded(rem), len(rem), counts_a, ks, span, out_b)
    assert sa == sb
    if sa == 0:
        assert np.array_equal(out_a, out_b)


def test_dense_segments_take_the_fast_paths_and_decode_exactly():
    """Every element changes, with 4 buckets: runs of zero Rice codes and whole-bucket blocks."""
    rng = np.random.default_rng(5)
    old, new = _step(rng, "BF16", 1 << 15, 1.0, 300)
    base, target = state_from_words({"w": ("BF16", old)}), state_from_words({"w": ("BF16", new)})
    with _sparse_only():  # sparse, however large
        enc = encode_delta(base, target, CodecOptions(threads=1, context_buckets=4))
    segs = [s for c in enc.chunks for s in split_chunk(c)]
    assert len(parse_segment(segs[0]).thresholds) >= 1
    for seg in segs:
        ref, fast = _both(seg, base)
        assert ref[0] == "ok" and fast == ref


@pytest.mark.parametrize("cut", [5, 12, 30])
def test_truncated_body_is_a_truncated_error(cut):
    rng = np.random.default_rng(1)
    old, new = _step(rng, "BF16", 4096, 0.3, 8)
    base, target = state_from_words({"w": ("BF16", old)}), state_from_words({"w": ("BF16", new)})
    seg = split_chunk(encode_delta(base, target, CodecOptions(threads=1)).chunks[0])[0]
    p = parse_head(seg)
    with pytest.raises(TruncatedError):
        segdecode.decode(seg[: p.body_at + cut], p.body_at, p.start, p.stop, dtypes.from_code("BF16"),
                         base.words("w"), tensor_seed("w"))


# --- locate: the two-phase grouped kernel against the per-block one ------------------------
_G = 64 * positions.GROUP_BLOCKS  # elements per group


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["BF16", "F16", "F32", "U8"]),
       st.one_of(st.sampled_from([1, 63, 64, 65, _G - 1, _G, _G + 1, 2 * _G + 64 * 3 + 5, 3 * _G - 64]),
                 st.integers(1, 3 * _G)),
       st.integers(0, 3), st.sampled_from([0.0005, 0.01, 0.05, 0.3, 1.0]), st.booleans(), st.integers(0, 2**31))
def test_grouped_locate_finds_what_locate_finds(code, span, n_thr, density, misfit, seed):
    """Same count found, and the same positions and base words in the same slots, for any sorted
    ranks per bucket: sparse and dense blocks, a segment shorter than one group, groups cut short
    at a block count that is not a multiple of 64, a last block shorter than 64, every bucket,
    and ranks past a bucket's count (they do not fit the base: both stop short by as many)."""
    rng = np.random.default_rng(seed)
    d = dtypes.from_code(code)
    start = int(rng.integers(0, 100))
    old, _ = _step(rng, code, start + span + int(rng.integers(0, 100)), 0.0, 1)
    if not d.exp_mask:
        n_thr = 0
    exps = np.unique((old >> d.word.type(d.exp_shift)) & d.word.type(d.exp_mask)) if d.exp_mask else []
    exps = np.sort(rng.choice(exps[exps > 0], size=min(n_thr, int((exps > 0).sum())), replace=False)) if n_thr else []
    consts = context.consts_for(d, np.array(exps, dtype=np.int64))
    key = old[start:start + span] & consts[0]
    bucket = (key > consts[1]).astype(np.int64) + (key > consts[2]) + (key > consts[3])
    counts = np.zeros(4, dtype=np.int64)
    ranks = []
    for b in range(4):
        size = int((bucket == b).sum()) + (int(rng.integers(1, 5)) if misfit and b <= len(exps) else 0)
        chosen = np.flatnonzero(rng.random(size) < density)
        counts[b] = chosen.shape[0]
        ranks.append(chosen)
    ranks = np.concatenate(ranks).astype(np.int64)
    n = ranks.shape[0]
    pos_a, old_a = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=old.dtype)
    pos_b, old_b = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=old.dtype)
    found = positions.locate(old, start, start + span, consts, counts, ranks, pos_a, old_a)
    assert positions.locate_grouped(old, start, start + span, consts, counts, ranks, pos_b, old_b) == found
    if found == n:  # slots of ranks that do not fit hold nothing defined
        assert np.array_equal(pos_b, pos_a) and np.array_equal(old_b, old_a)
        assert np.array_equal(old[pos_a], old_a)
        assert np.all((pos_a >= start) & (pos_a < start + span))
    else:
        assert misfit


def test_sparse_segments_take_the_grouped_locate():
    """A sparse segment with thresholds (a few changes per block of 64, three buckets, a group cut
    short) decodes through ``locate_grouped`` and gives the reference result."""
    rng = np.random.default_rng(7)
    old, new = _step(rng, "BF16", 3 * _G + 1000, 0.6, 8)
    base, target = state_from_words({"w": ("BF16", old)}), state_from_words({"w": ("BF16", new)})
    enc = encode_delta(base, target, CodecOptions(threads=1, context_buckets=4))
    segs = [s for c in enc.chunks for s in split_chunk(c)]
    p = parse_segment(segs[0])
    assert len(p.thresholds) >= 1 and p.n * segdecode.GROUPED_LOCATE <= p.stop - p.start
    for seg in segs:
        ref, fast = _both(seg, base)
        assert ref[0] == "ok" and fast == ref
