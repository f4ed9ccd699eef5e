"""Bit-exact round trips: whatever changes, the receiver ends up with exactly the new words."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2psync import dtypes
from p2psync.codec.decode import Applier, decode_state
from p2psync.codec.encode import CodecOptions, encode_delta, encode_delta_sparse, encode_snapshot
from p2psync.state import ModelState
from tests.unit.p2psync.helpers import ALL_CODES, special_words, state_from_words

SMALL = CodecOptions(chunk_size=64 << 10, segment_elements=4096, threads=2)


def apply(base: ModelState, enc, threads: int = 2) -> ModelState:
    out = base.clone()
    ap = Applier(out, kind=enc.kind, specs=enc.specs, n_chunks=len(enc.chunks),
                 target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)
    ap.add_chunks(enumerate(enc.chunks), threads)
    ap.commit()
    return out


def assert_same_bits(a: ModelState, b: ModelState) -> None:
    assert a.specs == b.specs
    for name in a:
        assert np.array_equal(a.words(name), b.words(name)), name
    assert a.fingerprint == b.fingerprint == b.audit() == a.audit()


@st.composite
def change(draw):
    code = draw(st.sampled_from(ALL_CODES))
    d = dtypes.from_code(code)
    n = draw(st.integers(0, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = (1 << (d.width * 8)) - 1
    specials = special_words(code)
    base = rng.integers(0, top, size=n, dtype=np.uint64, endpoint=True).astype(d.word)
    if n and draw(st.booleans()):
        base[rng.integers(0, n, size=max(1, n // 4))] = rng.choice(specials, size=max(1, n // 4))
    new = base.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.2, 1.0]))
    k = int(n * density) if density < 1.0 else n
    if k:
        pos = rng.choice(n, size=k, replace=False)
        how = draw(st.sampled_from(["ulp", "special", "signflip", "random", "max"]))
        if how == "ulp":
            new[pos] = base[pos] + rng.choice(np.array([1, top], dtype=np.uint64), size=k).astype(d.word)
        elif how == "special":
            new[pos] = rng.choice(specials, size=k)
        elif how == "signflip":
            new[pos] = base[pos] ^ d.word.type(1 << (d.width * 8 - 1))
        elif how == "random":
            new[pos] = rng.integers(0, top, size=k, dtype=np.uint64, endpoint=True).astype(d.word)
        else:  # maximal jumps: every bit flips
            new[pos] = ~base[pos]
    return code, base, new


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change())
def test_delta_roundtrip_any_dtype_and_values(case):
    code, b, n = case
    base = state_from_words({"t": (code, b), "other": ("BF16", np.arange(10, dtype=np.uint16))})
    new = state_from_words({"t": (code, n), "other": ("BF16", np.arange(10, dtype=np.uint16))})
    enc = encode_delta(base, new, SMALL)
    assert sum(enc.changed) == int((b != n).sum())
    assert enc.target_fingerprint == new.fingerprint
    assert_same_bits(new, apply(base, enc))
    # Extraction done elsewhere (e.g. on a GPU) must give the same bytes.
    pos = np.flatnonzero(b != n)
    assert encode_delta_sparse(base, {"t": (pos, n[pos])}, SMALL).chunks == enc.chunks


@settings(max_examples=40, deadline=None)
@given(change())
def test_snapshot_roundtrip(case):
    code, _, n = case
    s = state_from_words({"t": (code, n)})
    enc = encode_snapshot(s, SMALL)
    out = decode_state(enc.specs, enumerate(enc.chunks), len(enc.chunks), enc.target_fingerprint)
    assert_same_bits(s, out)


def test_empty_delta_has_no_chunks_and_applies():
    s = state_from_words({"a": ("BF16", np.arange(100, dtype=np.uint16))})
    enc = encode_delta(s, s.clone())
    assert enc.chunks == [] and sum(enc.changed) == 0
    assert_same_bits(s, apply(s, enc))


def test_dense_delta_every_element_changes():
    rng = np.random.default_rng(1)
    b = rng.integers(0, 2**32, size=50_000, dtype=np.uint64).astype(np.uint32)
    base = state_from_words({"w": ("F32", b)})
    new = state_from_words({"w": ("F32", b + np.uint32(1))})
    enc = encode_delta(base, new, SMALL)
    assert sum(enc.changed) == 50_000
    assert all(len(c) <= SMALL.chunk_size for c in enc.chunks)
    assert_same_bits(new, apply(base, enc))


def test_zero_dim_and_single_element_tensors():
    base = ModelState({"scalar": torch.tensor(1.5, dtype=torch.bfloat16), "one": torch.tensor([2.0]),
                       "empty": torch.empty(0, 3, dtype=torch.float16)})
    new = ModelState({"scalar": torch.tensor(-0.0, dtype=torch.bfloat16), "one": torch.tensor([float("nan")]),
                      "empty": torch.empty(0, 3, dtype=torch.float16)})
    assert_same_bits(new, apply(base, encode_delta(base, new)))
    snap = encode_snapshot(new)
    assert_same_bits(new, decode_state(snap.specs, enumerate(snap.chunks), len(snap.chunks), snap.target_fingerprint))


def test_tensor_larger_than_a_chunk_spans_many_independent_chunks():
    rng = np.random.default_rng(2)
    b = (rng.standard_normal(400_000).astype(np.float32) * 0.02).view(np.uint32)
    n = b.copy()
    idx = rng.choice(b.size, size=100_000, replace=False)
    n[idx] = rng.integers(0, 2**32, size=idx.size, dtype=np.uint64).astype(np.uint32)
    base, new = state_from_words({"big": ("F32", b)}), state_from_words({"big": ("F32", n)})
    enc = encode_delta(base, new, SMALL)
    assert len(enc.chunks) > 3
    assert_same_bits(new, apply(base, enc))
    # Chunks decode on their own and in any order.
    out = base.clone()
    ap = Applier(out, kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                 target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)
    for i in reversed(range(len(enc.chunks))):
        ap.add_chunk(i, enc.chunks[i])
    ap.commit()
    assert_same_bits(new, out)


def test_thousands_of_tiny_tensors():
    rng = np.random.default_rng(3)
    items_b, items_n = {}, {}
    for i in range(3000):
        w = rng.integers(0, 2**16, size=int(rng.integers(1, 8)), dtype=np.uint64).astype(np.uint16)
        items_b[f"layer.{i}.w"] = ("BF16", w)
        items_n[f"layer.{i}.w"] = ("BF16", w + np.uint16(i % 3 == 0))
    base, new = state_from_words(items_b), state_from_words(items_n)
    enc = encode_delta(base, new)
    assert_same_bits(new, apply(base, enc))


def test_output_does_not_depend_on_thread_count():
    rng = np.random.default_rng(4)
    b = rng.integers(0, 2**16, size=200_000, dtype=np.uint64).astype(np.uint16)
    n = b.copy()
    n[rng.choice(b.size, 3000, replace=False)] += np.uint16(1)
    base, new = state_from_words({"w": ("BF16", b)}), state_from_words({"w": ("BF16", n)})
    one = encode_delta(base, new, CodecOptions(chunk_size=64 << 10, segment_elements=8192, threads=1))
    two = encode_delta(base, new, CodecOptions(chunk_size=64 << 10, segment_elements=8192, threads=2))
    assert one.chunks == two.chunks


def test_context_coding_beats_context_free_on_magnitude_dependent_changes():
    # Small weights have small ULPs and change more often: exactly what the exponent context predicts.
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(2_000_000) * 0.02).astype(np.float32)
    new_master = w + 1e-5 * np.sign(rng.standard_normal(w.size)).astype(np.float32)
    bf = lambda x: (torch.from_numpy(x).to(torch.bfloat16))  # noqa: E731
    base, new = ModelState({"w": bf(w)}), ModelState({"w": bf(new_master)})
    enc = encode_delta(base, new)
    n_changed = sum(enc.changed)
    p = n_changed / w.size
    context_free_bits = w.size * (-(p * np.log2(p) + (1 - p) * np.log2(1 - p)))
    assert 8 * enc.stats.positions < 0.95 * context_free_bits


@st.composite
def optimizer_step(draw):
    """Float weights moved by a small update: small magnitudes change more often (bucketed positions)."""
    dt = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]))
    n = draw(st.integers(1, 300_000))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.02, 1.0, 30.0]))
    step = draw(st.sampled_from([1e-17, 1e-13, 1e-9, 1e-6, 1e-4, 1e-2]))  # f64, f32 and 16-bit ULP scales
    moved = master + step * torch.randn(n, generator=g, dtype=torch.float64)
    return master.to(dt), moved.to(dt)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(optimizer_step(), st.integers(1, 4), st.sampled_from([1024, 5000, 1 << 16, 1 << 20]))
def test_bucketed_positions_roundtrip_and_match_the_sparse_path(case, buckets, seg):
    # Small chunks bound a segment's changes, so dense cases also split segments at unaligned
    # starts; tails shorter than a 64-word block and every bucket count are covered.
    opts = CodecOptions(chunk_size=64 << 10, segment_elements=seg, context_buckets=buckets)
    b, n = case
    base, new = ModelState({"w": b}), ModelState({"w": n})
    enc = encode_delta(base, new, opts)
    assert enc.target_fingerprint == new.fingerprint
    assert_same_bits(new, apply(base, enc))
    bw, nw = base.words("w"), new.words("w")
    pos = np.flatnonzero(bw != nw)
    assert encode_delta_sparse(base, {"w": (pos, nw[pos])}, opts).chunks == enc.chunks


def _bucket_counts(enc) -> list[int]:
    from p2psync.codec.decode import split_chunk
    from p2psync.codec.segment import parse_segment
    return [int(parse_segment(s).counts.shape[0]) for c in enc.chunks for s in split_chunk(c)]


def test_fast_mode_is_context_free_and_decodes_the_same_weights():
    g = torch.Generator().manual_seed(7)
    master = torch.randn(1_000_000, generator=g) * 0.02
    base = ModelState({"w": master.to(torch.bfloat16)})
    new = ModelState({"w": (master + 1e-5 * torch.randn(1_000_000, generator=g)).to(torch.bfloat16)})
    ctx = encode_delta(base, new, CodecOptions(context_buckets=4))
    fast = encode_delta(base, new, CodecOptions(context_buckets=1))
    assert set(_bucket_counts(fast)) == {1} and max(_bucket_counts(ctx)) > 1
    assert_same_bits(new, apply(base, ctx))
    assert_same_bits(new, apply(base, fast))
    # the context is what makes the smaller payload
    assert sum(map(len, ctx.chunks)) < 0.9 * sum(map(len, fast.chunks))


def test_context_buckets_is_validated():
    from p2psync.errors import ConfigError
    for bad in (0, 5):
        with pytest.raises(ConfigError, match="context_buckets"):
            CodecOptions(context_buckets=bad)


def test_one_big_chunk_decodes_on_every_thread_with_the_same_result():
    g = torch.Generator().manual_seed(8)
    base = ModelState({f"w{i}": (torch.randn(300_000, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)})
    new = ModelState({k: (base.tensor(k).float() + 1e-4 * torch.randn(300_000, generator=g)).to(torch.bfloat16)
                      for k in base})
    enc = encode_delta(base, new, CodecOptions(segment_elements=1 << 16))
    assert len(enc.chunks) == 1 and len(_bucket_counts(enc)) > 4
    assert_same_bits(new, apply(base, enc, threads=1))
    assert_same_bits(new, apply(base, enc, threads=2))


@pytest.mark.parametrize("code", ALL_CODES)
def test_words_view_shares_memory(code):
    d = dtypes.from_code(code)
    t = torch.zeros(4, dtype=d.torch_dtype())
    w = dtypes.words_of(t)
    w[1] = 1
    assert dtypes.words_of(t)[1] == 1 and w.dtype == d.word
