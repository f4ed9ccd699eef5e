"""The receive path made fast: snapshots decoded and hashed chunk by chunk (still all-or-nothing
and audited), decoding overlapped with the download, the store's memory copy of recent chunks,
and the node's background warm-up."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch

from p2psync import dtypes, keys
from p2psync.artifact import build_manifest
from p2psync.codec.decode import Applier, _unplanes_into, decode_state
from p2psync.codec.encode import CodecOptions, encode_snapshot
from p2psync.codec.segment import planes, unplanes
from p2psync.errors import CodecError, FingerprintMismatch
from p2psync.state import ModelState
from p2psync.store import VersionStore
from p2psync.transport.fetch import Pipeline
from p2psync.transport.warm import in_daemon_thread
from tests.unit.p2psync.helpers import ALL_CODES, special_words, state_from_words

OPTS = CodecOptions(chunk_size=64 << 10, segment_elements=4096, zstd_level=0)


def _mixed_state(seed: int) -> ModelState:
    """Every dtype (one empty tensor), special words first; the table depends on nothing, the
    words on ``seed``."""
    sizes = np.random.default_rng(0).integers(1, 20_000, len(ALL_CODES))
    rng = np.random.default_rng(seed)
    items = {}
    for i, code in enumerate(ALL_CODES):
        d = dtypes.from_code(code)
        n = int(sizes[i]) if i else 0
        w = rng.integers(0, 1 << (8 * d.width), n, dtype=np.uint64).astype(d.word)
        w[: len(special_words(code))] = special_words(code)[: n]
        items[f"t{i}.{code}"] = (code, w)
    return state_from_words(items)


def _words(state: ModelState) -> dict[str, np.ndarray]:
    return {n: state.words(n).copy() for n in state}


def _feed(ap: Applier, chunks: list[bytes], order_seed: int) -> None:
    items = list(enumerate(chunks))
    random.Random(order_seed).shuffle(items)
    threads = [threading.Thread(target=lambda part: [ap.add_chunk(i, c) for i, c in part], args=(items[k::3],))
               for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("code", ["BF16", "F32", "F64", "F8_E4M3"])
def test_unplanes_into_matches_the_reference_layout(code):
    d = dtypes.from_code(code)
    w = np.random.default_rng(1).integers(0, 1 << (8 * d.width), 1001, dtype=np.uint64).astype(d.word)
    out = np.zeros(1001 + 6, dtype=d.word)
    _unplanes_into(planes(w), out[3:-3])
    assert np.array_equal(out[3:-3], unplanes(planes(w), 1001, np.dtype(d.word)))
    assert not out[:3].any() and not out[-3:].any()  # nothing written outside the slice
    with pytest.raises(CodecError):
        _unplanes_into(planes(w)[:-1], out[3:-3])


@pytest.mark.parametrize("scratch", [False, True])
def test_snapshot_hashed_per_chunk_lands_bit_exact_and_agrees_with_a_full_audit(scratch):
    src = _mixed_state(2)
    enc = encode_snapshot(src, OPTS)
    assert len(enc.chunks) > 3
    dest = ModelState.empty_like(src.specs) if scratch else _mixed_state(3)
    ap = Applier(dest, kind="snapshot", specs=enc.specs, n_chunks=len(enc.chunks),
                 target_fingerprint=enc.target_fingerprint, scratch=scratch)
    _feed(ap, enc.chunks, 4)
    fp = ap.commit()
    assert fp == src.fingerprint == dest.fingerprint == dest.audit()
    for name in src:
        assert np.array_equal(dest.words(name), src.words(name)), name


def test_snapshot_that_is_incomplete_overlapping_or_wrong_leaves_the_state_untouched():
    src = _mixed_state(5)
    other = _mixed_state(6)
    enc = encode_snapshot(src, OPTS)
    wrong = encode_snapshot(other, OPTS)
    coarse = encode_snapshot(src, CodecOptions(chunk_size=256 << 10, segment_elements=1 << 15, zstd_level=0))
    dest = _mixed_state(7)
    before, fp_before = _words(dest), dest.fingerprint

    def applier() -> Applier:
        return Applier(dest, kind="snapshot", specs=enc.specs, n_chunks=len(enc.chunks),
                       target_fingerprint=enc.target_fingerprint)

    cases = []
    ap = applier()  # a chunk missing
    ap.add_chunks(list(enumerate(enc.chunks))[1:], 2)
    cases.append((ap, CodecError))
    ap = applier()  # one chunk from a different snapshot of the same table: hashes fine, sum wrong
    ap.add_chunks([(i, wrong.chunks[i] if i == 1 else c) for i, c in enumerate(enc.chunks)], 2)
    cases.append((ap, FingerprintMismatch))
    ap = applier()  # chunk 0 replaced by a bigger one covering what later chunks cover too
    ap.add_chunks([(i, coarse.chunks[0] if i == 0 else c) for i, c in enumerate(enc.chunks)], 2)
    cases.append((ap, CodecError))
    for ap, error in cases:
        with pytest.raises(error):
            ap.commit()
        assert dest.fingerprint == fp_before
        for name, w in before.items():
            assert np.array_equal(dest.words(name), w), name


def test_decode_state_uses_the_fresh_buffer_and_still_checks_the_fingerprint():
    src = _mixed_state(8)
    enc = encode_snapshot(src, OPTS)
    got = decode_state(enc.specs, enumerate(enc.chunks), len(enc.chunks), enc.target_fingerprint)
    assert got.fingerprint == got.audit() == src.fingerprint
    with pytest.raises(FingerprintMismatch):
        decode_state(enc.specs, enumerate(enc.chunks), len(enc.chunks), "0" * 32)


def test_pipeline_overlaps_bounds_and_reports_the_first_failure():
    running = 0
    peak = 0
    lock = threading.Lock()
    done: list[int] = []

    def work(i: int, data: bytes) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        if data == b"bad":
            raise CodecError(f"chunk {i} does not decode")
        done.append(i)

    async def main() -> None:
        pipe = Pipeline(work, 3)
        for i in range(12):
            await pipe.submit(i, b"ok")
        await pipe.drain()
        assert sorted(done) == list(range(12)) and 2 <= peak <= 3
        pipe = Pipeline(work, 2)
        await pipe.submit(0, b"bad")
        with pytest.raises(CodecError, match="chunk 0"):
            for i in range(1, 50):
                await pipe.submit(i, b"ok")
            await pipe.drain()

    asyncio.run(main())


def test_store_keeps_recent_verified_chunks_in_memory_within_its_budget(tmp_path):
    priv = keys.generate()
    g = torch.Generator().manual_seed(9)
    state = ModelState({"w": torch.randn(200_000, generator=g).to(torch.bfloat16)})
    enc = encode_snapshot(state, CodecOptions(chunk_size=64 << 10, zstd_level=0))
    m = build_manifest(enc, model_id="m", target_version=0, chunk_size=64 << 10, private_key=priv)
    budget = 3 * (64 << 10)
    store = VersionStore.open(tmp_path, priv.public_key(), cache_bytes=budget)
    store.add_manifest(m)
    aid = m.artifact_id
    for i, c in enumerate(enc.chunks):
        store.put_chunk(aid, i, c)
    n = len(enc.chunks)
    cached = [i for i in range(n) if store.cached_chunk(aid, i) is not None]
    assert cached and cached == list(range(n - len(cached), n))  # the newest ones
    assert sum(len(store.cached_chunk(aid, i)) for i in cached) <= budget
    for i in range(n):  # cached or not, every read gives the verified bytes
        assert bytes(store.read_chunk(aid, i)) == enc.chunks[i]
    store.remove(aid)
    assert all(store.cached_chunk(aid, i) is None for i in range(n))


def test_daemon_thread_helper_returns_results_and_raises_failures():
    async def main() -> None:
        assert await in_daemon_thread(lambda: threading.current_thread().daemon, "t") is True
        with pytest.raises(CodecError, match="boom"):
            await in_daemon_thread(lambda: (_ for _ in ()).throw(CodecError("boom")), "t")

    asyncio.run(main())
