"""Decoding on several threads: the same weights, changes and errors as on one.

``Applier.add_chunks`` hands the segments to its threads longest first, not in chunk order,
and ``commit`` writes the decoder's positions without a second range check. Neither may show:
the result, the kept changes, the error a bad segment gives and the untouched state on failure
are those of the one-thread path, whichever thread decoded which segment.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from p2psync.codec.decode import Applier, split_chunk
from p2psync.codec.encode import CHUNK_MAGIC, CodecOptions, encode_delta
from p2psync.codec.segment import span_of
from p2psync.errors import P2PSyncError
from p2psync.state import ModelState
from tests.unit.p2psync.helpers import state_from_words

OPTS = CodecOptions(chunk_size=64 << 10, segment_elements=1 << 15, threads=1)


def _case():
    """Base and new states whose biggest segments sit in the last chunks (the big tensor comes
    last in the table, as an untied output embedding does), with several tensors, dtypes and
    densities, so that longest-first order differs from chunk order."""
    rng = np.random.default_rng(11)
    items_b, items_n = {}, {}
    sizes = [(f"small.{i}", "BF16", 3000 + 500 * i, 0.3) for i in range(6)]
    sizes += [("mid.f32", "F32", 60_000, 0.3), ("mid.f16", "F16", 300_000, 0.6), ("head", "BF16", 400_000, 0.02)]
    for name, code, n, density in sizes:
        x = (rng.standard_normal(n) * 0.02).astype(np.float32)
        words = {"F32": x.view(np.uint32), "F16": x.astype(np.float16).view(np.uint16),
                 "BF16": (x.view(np.uint32) >> 16).astype(np.uint16)}[code]
        new = words.copy()
        idx = rng.choice(n, size=max(1, int(n * density)), replace=False)
        new[idx] += rng.integers(1, 40, size=idx.size).astype(new.dtype)
        new[idx[:3]] ^= new.dtype.type(0x4000)  # a few large jumps: escaped residuals
        items_b[name] = (code, words)
        items_n[name] = (code, new)
    return state_from_words(items_b), state_from_words(items_n)


@pytest.fixture(scope="module")
def case():
    base, new = _case()
    base.tensor_sums()
    enc = encode_delta(base, new, OPTS)
    spans = [[span_of(s) for s in split_chunk(c)] for c in enc.chunks]
    assert len(enc.chunks) >= 4
    assert max(spans[-1]) > max(spans[0])  # the longest segments are not the first ones
    return base, new, enc


def _applier(state: ModelState, enc) -> Applier:
    return Applier(state, kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                   target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)


def _apply(base: ModelState, enc, threads: int, chunks=None) -> tuple[ModelState, dict]:
    out = base.clone()
    ap = _applier(out, enc)
    ap.add_chunks(chunks if chunks is not None else enumerate(enc.chunks), threads)
    ap.keep_changes = True
    ap.commit()
    assert ap.changes is not None
    return out, ap.changes


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_one_thread_weights_and_changes(case, threads):
    base, new, enc = case
    one, ch1 = _apply(base, enc, 1)
    many, chn = _apply(base, enc, threads)
    for name in new:
        assert np.array_equal(one.words(name), new.words(name)), name
        assert np.array_equal(many.words(name), new.words(name)), name
    assert many.fingerprint == one.fingerprint == enc.target_fingerprint == many.audit()
    assert ch1.keys() == chn.keys()
    for t in ch1:  # same positions and words, in the same order (segments in range order)
        assert np.array_equal(ch1[t][0], chn[t][0]) and np.array_equal(ch1[t][1], chn[t][1])


def test_chunks_given_in_any_order_decode_the_same_on_two_threads(case):
    base, new, enc = case
    order = list(range(len(enc.chunks)))
    np.random.default_rng(5).shuffle(order)
    out, _ = _apply(base, enc, 2, [(i, enc.chunks[i]) for i in order])
    for name in new:
        assert np.array_equal(out.words(name), new.words(name)), name


def _rebuild(chunk: bytes, k: int, seg: bytes) -> bytes:
    segs = [bytes(s) for s in split_chunk(chunk)]
    segs[k] = seg
    return b"".join([CHUNK_MAGIC, struct.pack("<I", len(segs))] + [struct.pack("<I", len(s)) + s for s in segs])


def _mutations(seg: bytes) -> list[bytes]:
    """A truncated segment, a flipped byte in the stream area, and trailing garbage."""
    flipped = bytearray(seg)
    flipped[len(seg) - max(2, len(seg) // 5)] ^= 0x5A
    return [seg[:-3], bytes(flipped), seg + b"\x00\x01"]


def _outcome(base: ModelState, enc, chunks: list[bytes], threads: int):
    state = base.clone()
    before = {n: state.words(n).copy() for n in state}
    fp = state.fingerprint
    ap = _applier(state, enc)
    try:
        ap.add_chunks(enumerate(chunks), threads)
        ap.commit()
        result = ("applied", state.fingerprint)
    except P2PSyncError as exc:
        result = (type(exc), str(exc))
        for n, w in before.items():  # nothing written
            assert np.array_equal(state.words(n), w), n
        assert state.fingerprint == fp == state.audit()
    return result


def test_bad_segment_anywhere_gives_the_one_thread_error_with_state_untouched(case):
    base, _, enc = case
    # Every position in the two-thread order: the first segments taken (the longest, in the last
    # chunk), the middle and the last taken (short ones), each decoded beside another segment.
    where = [(c, k) for c, chunk in enumerate(enc.chunks) for k in range(len(split_chunk(chunk)))]
    where.sort(key=lambda ck: -span_of(split_chunk(enc.chunks[ck[0]])[ck[1]]))
    picks = {where[0], where[1], where[len(where) // 2], where[-2], where[-1]}
    failures = 0
    for c, k in sorted(picks):
        seg = bytes(split_chunk(enc.chunks[c])[k])
        for bad in _mutations(seg):
            chunks = list(enc.chunks)
            chunks[c] = _rebuild(chunks[c], k, bad)
            one = _outcome(base, enc, chunks, 1)
            assert _outcome(base, enc, chunks, 2) == one
            failures += one[0] != "applied"
    assert failures >= 2 * len(picks)


def test_two_bad_segments_report_the_first_in_chunk_order(case):
    base, _, enc = case
    # The last chunk holds the longest segment, which two threads decode first; the first chunk's
    # error must still be the one reported, as on one thread.
    first = bytes(split_chunk(enc.chunks[0])[0])
    last_segs = split_chunk(enc.chunks[-1])
    k = max(range(len(last_segs)), key=lambda j: span_of(last_segs[j]))
    chunks = list(enc.chunks)
    chunks[0] = _rebuild(chunks[0], 0, first[:-3])
    chunks[-1] = _rebuild(chunks[-1], k, bytes(last_segs[k]) + b"\x00")
    one = _outcome(base, enc, chunks, 1)
    assert one[0] != "applied"
    assert _outcome(base, enc, chunks, 2) == one
    alone = list(enc.chunks)
    alone[0] = chunks[0]
    assert _outcome(base, enc, alone, 1) == one  # it is the first chunk's error


def test_span_of_reads_the_header_alone():
    from p2psync.codec.segment import encode_header

    assert span_of(memoryview(encode_header(1, 3, 10, 4106))) == 4096
    assert span_of(memoryview(encode_header(1, 3, 10, 4106))[:-1]) == 0  # short header
    assert span_of(memoryview(encode_header(1, 3, 50, 10))) == 0  # inverted range


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_parts_in_range_writes_what_the_checked_path_writes(threads):
    rng = np.random.default_rng(7)
    words = {f"t{i}": ("BF16", rng.integers(0, 2**16, size=300_000 + i, dtype=np.uint64).astype(np.uint16))
             for i in range(4)}
    a, b = state_from_words(words), state_from_words(words)
    parts = []
    for i in range(4):
        pos = np.sort(rng.choice(300_000, size=100_000, replace=False)).astype(np.int64)
        parts.append((i, pos[::2], rng.integers(0, 2**16, size=pos[::2].size, dtype=np.uint64).astype(np.uint16)))
        parts.append((i, pos[1::2], rng.integers(0, 2**16, size=pos[1::2].size, dtype=np.uint64).astype(np.uint16)))
    sums = a.updated_sums({})  # any sums: apply_parts adopts them as given
    assert sum(p[1].size for p in parts) > 2**18  # enough changes for the threaded scatter
    a.apply_parts(parts, sums, threads)
    b.apply_parts(parts, sums, threads, in_range=True)
    for name in a:
        assert np.array_equal(a.words(name), b.words(name)), name


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_run_ordered_reports_the_first_failure_by_index_whatever_the_order(threads):
    from p2psync.workers import run_ordered

    ran = set()

    def work(i: int) -> int:
        ran.add(i)
        if i in (7, 30):
            raise ValueError(f"item {i}")
        return i * i

    order = list(range(50))[::-1]  # the failing 30 is taken before 7
    results, failed, error = run_ordered(50, order, work, threads)
    assert failed == 7 and isinstance(error, ValueError) and str(error) == "item 7"
    assert set(range(8)) <= ran  # every item before the first failure ran
    assert results[:7] == [i * i for i in range(7)]
    results, failed, error = run_ordered(5, range(5), lambda i: -i, threads)
    assert (results, failed, error) == ([0, -1, -2, -3, -4], 5, None)
