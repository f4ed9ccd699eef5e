"""The codec's building blocks agree with their plain definitions on every input the format allows.

The round-trip tests go through whole deltas of realistic sizes; these reach corners those cannot
(Rice parameters above 32, unary runs longer than a word, both set-bit selects) and check the
typed errors of the residual tables byte by byte.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from p2psync.codec import rans, rice, simd
from p2psync.codec.wire import Reader
from p2psync.errors import CodecError, TruncatedError
from tests.unit.p2psync.helpers import state_from_words


@njit
def _both_selects(m, j):
    return simd._select_search(m, j), simd.select64(m, j)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2**64 - 1), st.data())
def test_select_finds_the_jth_set_bit(mask, data):
    bits = [i for i in range(64) if mask >> i & 1]
    j = data.draw(st.integers(0, len(bits) - 1))
    assert _both_selects(np.uint64(mask), j) == (bits[j], bits[j])


@njit
def _be64(buf, i):
    return simd.load_be64(buf, i)


def test_load_be64_reads_unaligned_big_endian_words():
    buf = np.arange(1, 40, dtype=np.uint8)
    for i in range(31):
        assert _be64(buf, i) == int.from_bytes(bytes(buf[i:i + 8]), "big")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_rice_streams_round_trip_for_every_parameter(data):
    groups = data.draw(st.integers(1, 4))
    ranks, counts, ks = [], [], []
    for _ in range(groups):
        k = data.draw(st.integers(0, rice.MAX_K))
        gaps = data.draw(st.lists(st.integers(0, (1 << min(k + 7, 45)) - 1), max_size=40))
        r = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
        ranks.append(r)
        counts.append(r.shape[0])
        ks.append(k)
    all_ranks = np.concatenate(ranks).astype(np.int64)
    counts_a = np.array(counts, dtype=np.int64)
    ks_a = np.array(ks, dtype=np.int64)
    ends = np.cumsum(counts_a)
    starts = ends - counts_a
    ubits = sum(int(((np.diff(np.concatenate([[-1], r])) - 1) >> k).sum()) + r.shape[0] for r, k in zip(ranks, ks))
    rbits = sum(r.shape[0] * k for r, k in zip(ranks, ks))
    unary = np.zeros((ubits + 7) // 8, dtype=np.uint8)
    rem = np.zeros((rbits + 7) // 8, dtype=np.uint8)
    rice.write(all_ranks, starts, ends, ks_a, unary, rem)
    span = int(max((r[-1] for r in ranks if r.shape[0]), default=0)) + 1
    back = np.empty(all_ranks.shape[0], dtype=np.int64)
    assert rice.read(unary.tobytes(), rem.tobytes(), counts_a, ks_a, span, back) == 0
    assert np.array_equal(back, all_ranks)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=rans.ALPHABET, max_size=rans.ALPHABET).filter(any))
def test_quantized_tables_sum_to_the_scale_and_keep_every_present_symbol(counts):
    f = rans.quantize(np.array(counts, dtype=np.int64))
    assert int(f.sum()) == rans.M
    assert np.array_equal(f > 0, np.array(counts) > 0)


def test_frequency_tables_round_trip_and_bad_tables_are_typed_errors():
    rng = np.random.default_rng(0)
    freqs = np.stack([rans.quantize(rng.integers(0, 50, rans.ALPHABET) * (rng.random(rans.ALPHABET) < 0.6)
                                    + np.eye(rans.ALPHABET, dtype=np.int64)[i]) for i in range(3)])
    blob = rans.encode_models(freqs)
    r = Reader(blob + b"tail", "residuals")
    assert np.array_equal(rans.read_models(r), freqs)
    assert r.pos == len(blob)
    for cut in range(len(blob)):
        with pytest.raises(TruncatedError):
            rans.read_models(Reader(blob[:cut], "residuals"))
    with pytest.raises(CodecError, match="no frequency table"):
        rans.read_models(Reader(b"\x00", "residuals"))
    bad_sum = bytearray(blob)
    bad_sum[5] ^= 1  # first frequency of the first table
    with pytest.raises(CodecError, match="does not sum"):
        rans.read_models(Reader(bytes(bad_sum), "residuals"))
    zero = bytearray(b"\x01" + (3).to_bytes(4, "little") + (0).to_bytes(2, "little") + (4096).to_bytes(2, "little"))
    with pytest.raises(CodecError, match="does not sum"):
        rans.read_models(Reader(bytes(zero), "residuals"))


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_parts_writes_every_part_and_adopts_the_sums(threads):
    rng = np.random.default_rng(1)
    words = {f"t{i}": rng.integers(0, 2**16, 5000 + i, dtype=np.uint64).astype(np.uint16) for i in range(3)}
    state = state_from_words({n: ("BF16", w) for n, w in words.items()})
    expect = {n: w.copy() for n, w in words.items()}
    parts = []
    for i, name in enumerate(words):
        for lo, hi in ((0, 2000), (2000, 5000 + i)):  # two disjoint parts of one tensor, as two segments
            pos = np.sort(rng.choice(np.arange(lo, hi), 300, replace=False)).astype(np.int64)
            new = rng.integers(0, 2**16, 300, dtype=np.uint64).astype(np.uint16)
            expect[name][pos] = new
            parts.append((i, pos, new))
    target = state_from_words({n: ("BF16", w) for n, w in expect.items()})
    state.apply_parts(parts, target.tensor_sums(), threads)
    for n in words:
        assert np.array_equal(state.words(n), expect[n])
    assert state.fingerprint == state.audit()


def test_apply_parts_refuses_positions_out_of_range():
    state = state_from_words({"t": ("BF16", np.zeros(10, dtype=np.uint16))})
    with pytest.raises(IndexError):
        state.apply_parts([(0, np.array([3, 10], dtype=np.int64), np.ones(2, dtype=np.uint16))],
                          state.tensor_sums(), 2)
    assert not state.words("t").any()
