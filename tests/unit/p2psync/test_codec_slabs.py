"""Decoded changes cut from kept slabs (``codec.slabs``): the bits of fresh arrays, on any thread.

``Applier`` takes each delta segment's positions and new words from memory kept between
decodes. Whatever a slab held before (a failed decode's half-written outputs, another delta's
changes), the result must be the one-thread, fresh-array result, and memory still reachable
from a kept result (``keep_changes``) must never be handed out again. The tests shrink the
slabs so that a small delta uses many of them, more than the pool keeps, and pieces larger
than a slab.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from p2psync import dtypes
from p2psync.codec import segdecode, slabs
from p2psync.codec.decode import Applier, split_chunk
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.codec.segment import parse_head
from p2psync.errors import P2PSyncError
from p2psync.state import ModelState, tensor_seed
from tests.unit.p2psync.helpers import state_from_words
from tests.unit.p2psync.test_codec_encode_threads import _pair
from tests.unit.p2psync.test_codec_threads import _rebuild

OPTS = CodecOptions(chunk_size=64 << 10, segment_elements=1 << 12, threads=1)


@pytest.fixture
def small_slabs(monkeypatch):
    """Slabs of 8 KiB, at most 4 kept: the deltas below need many more, and some pieces are
    larger than a slab."""
    slabs.release()
    monkeypatch.setattr(slabs, "SLAB_BYTES", 8 << 10)
    monkeypatch.setattr(slabs, "KEEP_BYTES", 32 << 10)
    yield
    gc.collect()
    slabs.release()


def _applier(state: ModelState, enc) -> Applier:
    return Applier(state, kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                   target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)


def _apply(base: ModelState, enc, threads: int, chunks=None) -> tuple[ModelState, dict]:
    out = base.clone()
    ap = _applier(out, enc)
    ap.add_chunks(enumerate(chunks if chunks is not None else enc.chunks), threads)
    ap.keep_changes = True
    ap.commit()
    assert ap.changes is not None
    return out, ap.changes


def _fresh_changes(base: ModelState, enc) -> dict:
    """Each segment decoded into arrays of its own (no arena), concatenated in range order."""
    parts: dict[int, list] = {}
    for chunk in enc.chunks:
        for seg in split_chunk(chunk):
            p = parse_head(seg)
            spec = base.specs[p.tensor]
            pos, new, _ = segdecode.decode(p.raw, p.body_at, p.start, p.stop, dtypes.from_code(spec.dtype),
                                           base.words(spec.name), tensor_seed(spec.name))
            parts.setdefault(p.tensor, []).append((p.start, pos.copy(), new.copy()))
    return {t: (np.concatenate([x[1] for x in sorted(ps, key=lambda x: x[0])]),
                np.concatenate([x[2] for x in sorted(ps, key=lambda x: x[0])])) for t, ps in parts.items()}


def _same_changes(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for t in a:
        assert np.array_equal(a[t][0], b[t][0]), t
        assert np.array_equal(a[t][1], b[t][1]), t
        assert a[t][1].dtype == b[t][1].dtype


def _dense_and_empty():
    rng = np.random.default_rng(3)
    words = {f"t{i}": ("BF16", rng.integers(0, 2**16, size=20_000 + 7 * i, dtype=np.uint64).astype(np.uint16))
             for i in range(3)}
    words["w32"] = ("F32", rng.integers(0, 2**32, size=9000, dtype=np.uint64).astype(np.uint32))
    base = state_from_words(words)
    dense = state_from_words({k: (c, w ^ rng.integers(1, 2**15, size=w.size).astype(w.dtype))
                              for k, (c, w) in words.items()})
    return base, dense, state_from_words(words)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("big_first", [True, False])
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_and_slabs_give_the_fresh_one_thread_bits(request, threads, big_first, small):
    if small:
        request.getfixturevalue("small_slabs")
    base, new = _pair(21, big_first)  # BF16, F16, F32, U8, F8; unchanged to fully dense; escapes
    base.tensor_sums()
    enc = encode_delta(base, new, OPTS)
    assert len(enc.chunks) >= 2
    one, ch1 = _apply(base, enc, 1)
    many, chn = _apply(base, enc, threads)
    for name in new:
        assert np.array_equal(one.words(name), new.words(name)), name
        assert np.array_equal(many.words(name), new.words(name)), name
    assert many.fingerprint == one.fingerprint == enc.target_fingerprint == many.audit()
    fresh = _fresh_changes(base, enc)
    _same_changes(ch1, fresh)
    _same_changes(chn, fresh)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_empty_and_fully_dense_deltas_apply_the_same_on_any_thread_count(small_slabs, threads):
    base, dense, same = _dense_and_empty()
    base.tensor_sums()
    for new in (dense, same, dense):
        enc = encode_delta(base, new, OPTS)
        out, changes = _apply(base, enc, threads)
        for name in new:
            assert np.array_equal(out.words(name), new.words(name)), name
        assert out.fingerprint == enc.target_fingerprint == out.audit()
        _same_changes(changes, _fresh_changes(base, enc))
        if new is same:
            assert sum(c[0].size for c in changes.values()) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_failed_decode_leaves_nothing_stale_for_the_next(small_slabs, threads):
    base, new = _pair(21, True)
    base.tensor_sums()
    other = base.clone()  # another delta from the same base: other positions and words
    rng = np.random.default_rng(9)
    for name in other:
        w = other.words(name)
        k = max(1, w.size // 7)
        idx = rng.choice(w.size, size=k, replace=False)
        w[idx] = (w[idx].astype(np.int64) + 1).astype(w.dtype)
    other.invalidate()
    good = encode_delta(base, new, OPTS)
    bad = encode_delta(base, other, OPTS)
    chunks = list(bad.chunks)
    last = [bytes(x) for x in split_chunk(chunks[-1])]
    chunks[-1] = _rebuild(chunks[-1], len(last) - 1, last[-1][:-3])  # every other segment decodes first
    for _ in range(3):
        state = base.clone()
        before = {n: state.words(n).copy() for n in state}
        ap = _applier(state, bad)
        with pytest.raises(P2PSyncError):
            ap.add_chunks(enumerate(chunks), threads)
            ap.commit()
        for n in state:
            assert np.array_equal(state.words(n), before[n]), n
        assert state.fingerprint == base.fingerprint == state.audit()
        del ap
        gc.collect()
        assert len(slabs._free) == 4  # the failed decode's slabs are free again, holding its outputs
        out, changes = _apply(base, good, threads)
        for name in new:
            assert np.array_equal(out.words(name), new.words(name)), name
        assert out.audit() == good.target_fingerprint
        _same_changes(changes, _fresh_changes(base, good))
        del changes
        gc.collect()


def test_kept_changes_are_never_handed_out_again(small_slabs):
    base, new = _pair(21, False)
    base.tensor_sums()
    enc = encode_delta(base, new, OPTS)
    _, kept = _apply(base, enc, 2)
    gc.collect()
    # The kept changes are arrays of their own: every slab of the decode is free again.
    assert slabs.kept_bytes() > 0 and sum(x.shape[0] for x in slabs._free) == slabs.kept_bytes()
    copies = {t: (p.copy(), w.copy()) for t, (p, w) in kept.items()}
    for _ in range(4):  # other decodes, which reuse every free slab
        b2, d2, _ = _dense_and_empty()
        b2.tensor_sums()
        _apply(b2, encode_delta(b2, d2, OPTS), 2)
        gc.collect()
    _same_changes(kept, copies)
    assert slabs.kept_bytes() <= slabs.KEEP_BYTES


def test_a_slab_comes_back_once_its_last_piece_is_gone(small_slabs):
    arena = slabs.Arena()
    pos, words = arena.take(100, np.uint16)  # slab A
    assert pos.dtype == np.int64 and words.dtype == np.uint16 and pos.size == words.size == 100
    pos2, words2 = arena.take(200, np.uint32)  # still A
    assert not any(np.shares_memory(x, y) for x, y in [(pos, words), (pos, pos2), (words, words2), (pos2, words2)])
    pos3, words3 = arena.take(1000, np.uint8)  # 8,000 bytes of positions: slab B; the words: slab C
    big, big_w = arena.take(5000, np.uint32)  # larger than a slab: allocated on their own
    assert big.size == big_w.size == 5000 and big.base is None
    assert slabs.kept_bytes() == 3 * slabs.SLAB_BYTES and not slabs._free
    pos3[:] = 7
    held = words[5:]  # a view of a piece holds its slab (A)
    del pos, words, pos2, words2, pos3, words3, big, big_w
    gc.collect()
    assert len(slabs._free) == 1  # C: the arena still cuts from it
    arena.close()
    gc.collect()
    assert len(slabs._free) == 2  # B and C; A is held
    again = slabs.Arena()
    p4, w4 = again.take(512, np.uint8)
    p5, w5 = again.take(512, np.uint8)
    assert not np.shares_memory(p4, held) and not np.shares_memory(p5, held)
    assert len(slabs._free) == 0
    p6, _ = again.take(512, np.uint8)  # A is held and the pool is at 3 of 4 slabs: a new pooled slab
    assert slabs.kept_bytes() == 4 * slabs.SLAB_BYTES
    p7, _ = again.take(1024, np.uint8)  # the pool is full: a plain slab
    assert slabs.kept_bytes() == 4 * slabs.SLAB_BYTES
    del held, p4, w4, p5, w5, p6, p7, again
    gc.collect()
    assert len(slabs._free) == 4 and slabs.kept_bytes() == 4 * slabs.SLAB_BYTES
    slabs.release()
    assert slabs.kept_bytes() == 0 and not slabs._free


def _mapping(x: np.ndarray):
    """The memory mapping a fresh arena's piece lives in."""
    b = x
    while isinstance(b, np.ndarray):
        b = b.base
    return b.obj if isinstance(b, memoryview) else b


def test_a_fresh_arena_keeps_nothing_and_its_memory_goes_back_with_its_last_piece(monkeypatch):
    monkeypatch.setattr(slabs, "FRESH_SLAB_BYTES", 64 << 10)
    kept = slabs.kept_bytes()
    a, b = slabs.Arena(fresh=True), slabs.Arena(fresh=True)
    pieces = [a.take(1000, np.uint16), a.take(3000, np.uint32), b.take(1000, np.uint16),
              a.take(20_000, np.uint16)]  # the last positions are larger than a slab: a mapping of their own
    flat = [x for p in pieces for x in p]
    assert [x.size for x in flat] == [1000, 1000, 3000, 3000, 1000, 1000, 20_000, 20_000]
    assert not any(np.shares_memory(x, y) for i, x in enumerate(flat) for y in flat[i + 1:])
    assert pieces[0][0].ctypes.data % (2 << 20) == 0  # a slab starts on a huge page
    assert slabs.kept_bytes() == kept  # nothing joined the pool
    for k, x in enumerate(flat):
        x[:] = k
    assert all((x == k).all() for k, x in enumerate(flat))
    maps = [weakref.ref(m) for m in {id(m): m for m in map(_mapping, flat)}.values()]
    assert len(maps) == 4  # a's slab, b's slab, the large positions, a's second slab (for their words)
    held = pieces[1][1][10:]  # a view of a piece holds its mapping
    del a, b, pieces, flat, x
    gc.collect()
    assert sum(r() is not None for r in maps) == 1
    assert (held == 3).all()
    del held
    gc.collect()
    assert all(r() is None for r in maps)


@pytest.mark.parametrize("origin", [False, True])
def test_segments_decoded_into_a_fresh_arena_give_the_bits_of_arrays_of_their_own(monkeypatch, origin):
    monkeypatch.setattr(slabs, "FRESH_SLAB_BYTES", 16 << 10)  # many slabs, and pieces larger than one
    base, new = _pair(21, True)
    base.tensor_sums()
    enc = encode_delta(base, new, OPTS)
    arena = slabs.Arena(fresh=True)
    parts: dict[int, list] = {}
    for chunk in enc.chunks:
        for seg in split_chunk(chunk):
            p = parse_head(seg)
            spec = base.specs[p.tensor]
            old = base.words(spec.name)
            if origin:  # a copy of the segment's range, as a rank decodes a strided or rebuilt range
                old = old[p.start:p.stop].copy()
            pos, words, _ = segdecode.decode(p.raw, p.body_at, p.start, p.stop, dtypes.from_code(spec.dtype),
                                             old, tensor_seed(spec.name), arena, origin=p.start if origin else 0)
            parts.setdefault(p.tensor, []).append((p.start, pos, words))
    got = {t: (np.concatenate([x[1] for x in sorted(ps, key=lambda x: x[0])]),
               np.concatenate([x[2] for x in sorted(ps, key=lambda x: x[0])])) for t, ps in parts.items()}
    _same_changes(got, _fresh_changes(base, enc))


def test_a_fresh_arena_cuts_chunk_buffers_and_undo_logs_of_their_own(monkeypatch):
    monkeypatch.setattr(slabs, "FRESH_SLAB_BYTES", 64 << 10)
    arena = slabs.Arena(fresh=True)
    got = [arena.array(1000, np.uint8), arena.array(700, np.uint16), arena.array(50_000, np.uint16),
           arena.array(3, np.uint8)] + list(arena.take(100, np.uint16))
    assert [(x.dtype, x.size) for x in got] == [(np.uint8, 1000), (np.uint16, 700), (np.uint16, 50_000),
                                               (np.uint8, 3), (np.int64, 100), (np.uint16, 100)]
    assert all(x.flags.writeable and x.flags.c_contiguous and x.ctypes.data % 64 == 0 for x in got)
    assert not any(np.shares_memory(x, y) for i, x in enumerate(got) for y in got[i + 1:])
    for k, x in enumerate(got):
        x[:] = k
    assert all((x == k).all() for k, x in enumerate(got))
    maps = [weakref.ref(m) for m in {id(m): m for m in map(_mapping, got)}.values()]
    del arena, got, x
    gc.collect()
    assert all(r() is None for r in maps)  # an update's buffers go back with the update
