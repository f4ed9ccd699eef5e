"""Encoding on several threads: the bytes of the one-thread encode, with a bounded look-ahead.

``encode_delta`` runs its jobs on the calling thread and helper threads (``workers.in_order``)
and packs their segments in job order as they come. Whatever thread ran which job, and however
far the look-ahead reached, the chunks and every manifest field must be those of one thread.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from p2psync.codec.encode import (
    CodecOptions,
    encode_delta,
    encode_delta_sparse,
    encode_snapshot,
)
from p2psync.workers import in_order
from tests.unit.p2psync.helpers import special_words, state_from_words

WORDS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32, "U8": np.uint8, "F8_E4M3": np.uint8}


def _pair(seed: int, big_first: bool):
    """Base and new states over several dtypes and densities: empty and fully dense tensors
    (random words in the dense one: several chunks), escapes (large jumps, specials), a 0-d-like single element, and one tensor much longer than
    the others (first or last in the table) so that jobs differ in length by 100x."""
    rng = np.random.default_rng(seed)
    plan = [("unchanged", "BF16", 5000, 0.0), ("dense", "F16", 60_000, 1.0), ("sparse", "BF16", 40_000, 0.01),
            ("mid.f32", "F32", 30_000, 0.3), ("bytes", "U8", 7000, 0.5), ("fp8", "F8_E4M3", 6000, 0.2),
            ("one", "BF16", 1, 1.0), ("specials", "F32", 64, 0.5)]
    big = ("big", "BF16", 300_000, 0.02)
    plan = [big] + plan if big_first else plan + [big]
    items_b, items_n = {}, {}
    for name, code, n, density in plan:
        w = WORDS[code]
        if name == "specials":
            sp = special_words(code)
            words = np.resize(sp, n).astype(w)
        else:
            words = rng.integers(0, np.iinfo(w).max, size=n, dtype=np.uint64).astype(w)
        new = words.copy()
        k = round(n * density)
        if k:
            idx = rng.choice(n, size=k, replace=False)
            new[idx] = (new[idx].astype(np.int64) + rng.integers(1, 3, size=k)).astype(w)
            jumps = idx[: max(1, k // 50)]
            new[jumps] ^= w(1 << (8 * np.dtype(w).itemsize - 2))  # large jumps: escaped residuals
            if name == "dense":  # every word replaced at random: mostly escapes
                new ^= rng.integers(1, np.iinfo(w).max, size=n, dtype=np.uint64).astype(w)
        items_b[name] = (code, words)
        items_n[name] = (code, new)
    return state_from_words(items_b), state_from_words(items_n)


def _same(a, b) -> None:
    assert a.chunks == b.chunks
    assert a.base_fingerprint == b.base_fingerprint
    assert a.target_fingerprint == b.target_fingerprint
    assert a.target_sums == b.target_sums
    assert a.changed == b.changed
    assert a.stats == b.stats
    assert a.specs == b.specs


@pytest.mark.parametrize("big_first", [True, False])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("buckets", [1, 4])
def test_threaded_encode_is_byte_identical_to_one_thread(threads, big_first, buckets):
    base, new = _pair(21, big_first)
    opts = {"chunk_size": 64 << 10, "segment_elements": 1 << 12, "context_buckets": buckets}
    one = encode_delta(base, new, CodecOptions(threads=1, **opts))
    many = encode_delta(base, new, CodecOptions(threads=threads, **opts))
    _same(one, many)
    assert len(one.chunks) >= 2 and sum(one.changed) > 0
    assert new.fingerprint == one.target_fingerprint


def test_empty_and_fully_dense_deltas_encode_the_same_on_two_threads():
    rng = np.random.default_rng(5)
    words = {f"t{i}": ("BF16", rng.integers(0, 2**16, size=20_000 + 999 * i, dtype=np.uint64).astype(np.uint16))
             for i in range(6)}
    base = state_from_words(words)
    dense = state_from_words({k: (c, (w + np.uint16(1))) for k, (c, w) in words.items()})
    opts = {"chunk_size": 64 << 10, "segment_elements": 1 << 13}
    for new in (state_from_words(words), dense):
        _same(encode_delta(base, new, CodecOptions(threads=1, **opts)),
              encode_delta(base, new, CodecOptions(threads=2, **opts)))
    empty = encode_delta(base, state_from_words(words), CodecOptions(threads=2, **opts))
    assert sum(empty.changed) == 0 and empty.target_fingerprint == empty.base_fingerprint


def test_sparse_path_and_snapshots_encode_the_same_on_two_threads():
    base, new = _pair(8, big_first=True)
    changes = {}
    for spec in base.specs:
        pos = np.flatnonzero(base.words(spec.name) != new.words(spec.name)).astype(np.int64)
        if pos.size:
            changes[spec.name] = (pos, new.words(spec.name)[pos])
    opts = {"chunk_size": 64 << 10, "segment_elements": 1 << 12}
    one = encode_delta_sparse(base, changes, CodecOptions(threads=1, **opts))
    _same(one, encode_delta_sparse(base, changes, CodecOptions(threads=2, **opts)))
    _same(one, encode_delta(base, new, CodecOptions(threads=2, **opts)))
    _same(encode_snapshot(new, CodecOptions(threads=1, **opts)), encode_snapshot(new, CodecOptions(threads=2, **opts)))


# --- workers.in_order -------------------------------------------------------------------------
def _held_at_starts(sizes: list[int], threads: int, window: int, slow: set[int] = frozenset()):
    """Run ``in_order`` and record, at every item's start, the sizes started and not yet yielded."""
    lock = threading.Lock()
    started: set[int] = set()
    yielded: set[int] = set()
    held_seen: list[tuple[int, int, int]] = []
    def work(i: int) -> int:
        with lock:
            started.add(i)
            oldest = min(set(range(len(sizes))) - yielded)
            held_seen.append((i, oldest, sum(sizes[j] for j in started - yielded)))
        if i in slow:  # others run ahead meanwhile, up to the window
            time.sleep(0.01)
        return i * i

    out = []
    for r in in_order(work, sizes, threads, window):
        with lock:
            yielded.add(len(out))
        out.append(r)
    return out, held_seen


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_in_order_yields_in_index_order_within_the_window(threads):
    rng = np.random.default_rng(threads)
    sizes = [int(x) for x in rng.integers(0, 50, size=300)]
    window = 120
    out, held = _held_at_starts(sizes, threads, window, slow=set(range(0, 300, 37)))
    assert out == [i * i for i in range(len(sizes))]
    for i, oldest, h in held:
        # The oldest item may always start. The consumer notes an item as yielded just after the
        # generator handed it out (and let another item start), so it may count one item too many.
        assert h - sizes[oldest] <= window or i == oldest


def test_a_long_item_at_the_head_does_not_stop_the_other_thread():
    # Item 0 waits until the last item has started: only a look-ahead that lets the helper run
    # every other item while item 0 runs finishes without timing out. The window is the one
    # ``encode_delta`` uses (4 * threads + 1 of the largest item; a count of 4 * threads items
    # past the oldest, as before, would stop the helper after 8 items).
    n = 40
    sizes = [10] + [1] * (n - 1)
    last_started = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            assert last_started.wait(10), "the helper stopped behind the long head item"
        if i == n - 1:
            last_started.set()
        return i

    assert list(in_order(work, sizes, 2, window=(4 * 2 + 1) * max(sizes))) == list(range(n))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_in_order_raises_the_first_failure_by_index_after_the_results_before_it(threads):
    n, bad = 60, {17, 40}
    ran: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            ran.append(i)
        if i in bad:
            raise ValueError(f"item {i}")
        return i

    got = []
    with pytest.raises(ValueError, match="item 17"):
        got.extend(in_order(work, [1] * n, threads, window=8))
    assert got == list(range(17))
    assert max(ran) < 17 + 8 + threads  # items far past the failure never started


def test_closing_in_order_early_stops_the_helpers():
    n = 200
    ran: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            ran.append(i)
        return i

    gen = in_order(work, [1] * n, 3, window=4)
    assert [next(gen) for _ in range(5)] == list(range(5))
    gen.close()  # returns once the helpers have finished their current item
    count = len(ran)
    time.sleep(0.05)
    assert len(ran) == count < n
