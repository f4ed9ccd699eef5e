"""The rollout worker against a real in-process node (versions published by the trainer node's real
apply path) and an in-memory WorkSource: batching, streaming, safe-point switches, staleness,
resume, lost leases, preemption, and the divergence check."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from rollout_helpers import MemoryWork, bits_equal, grant, trained_versions

from p2psync import keys
from p2psync.config import NodeConfig
from p2psync.control.api import RolloutRequest
from p2psync.errors import ConfigError
from p2psync.node import Node
from rollout import worker as worker_mod
from rollout.engines import build_engine
from rollout.engines.base import EngineConfig
from rollout.options import WorkerOptions
from rollout.worker import RolloutWorker

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def versions():
    return trained_versions(steps=3)


@pytest.fixture(scope="module")
def engine_factory():
    built = []

    def make():
        eng = build_engine(EngineConfig(preset="tiny", threads=1))
        built.append(eng)
        return eng
    return make


async def _node(tmp_path, versions) -> Node:
    kd = tmp_path / "keys"
    keys.write_pair(versions.private_key, kd)
    cfg = NodeConfig(id="t", role="trainer", data_dir=str(tmp_path / "t"), cluster_token="unit-test-token-42",
                     trainer_public_key=str(kd / "trainer.pub"), trainer_private_key=str(kd / "trainer.key"))
    node = await Node.create(cfg)
    await node.publish(*versions.snapshot)
    return node


def _payload(max_new=16, min_version=0, seed=7, temperature=1.0, stop=()):
    return RolloutRequest([5, 9, 17, 33], max_new, temperature=temperature, stop_token_ids=list(stop),
                          min_version=min_version, seed=seed).to_json()


def _opts(tmp_path, **kw) -> WorkerOptions:
    base = dict(preset="tiny", threads=1, max_batch=8, progress_every=4, request_wait=0.2,
                events_path=str(tmp_path / "events.jsonl"))
    return WorkerOptions(**{**base, **kw})


def _events(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]


async def _serve_until(worker, pred, timeout=120.0):
    task = asyncio.create_task(worker.serve(), name="test:serve")
    try:
        deadline = time.monotonic() + timeout
        while not pred():
            assert not task.done(), task.result()
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return task


def _contiguous_progress(work: MemoryWork, work_id: str, response: int, start: int, total: int) -> None:
    rows = [r for r in work.progress_log if r[0] == work_id and r[1] == response]
    at = start
    for _, _, off, toks, lps, vers in rows:
        assert off == at and len(toks) == len(lps) == len(vers) > 0
        at += len(toks)
    assert at == total


def test_serves_batched_grants_and_streams_progress(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        try:
            w = await RolloutWorker.create(node, _opts(tmp_path), engine_factory())
            work.add(grant("a", _payload(13), responses=2))
            work.add(grant("b", _payload(9, seed=8, stop=[3]), responses=3))
            await _serve_until(w, lambda: len(work.completed) == 2)
            assert work.requests >= 1
            # Each request states the version the engine generates with (the coordinator places by it).
            assert work.request_versions and set(work.request_versions) == {w.engine.version} != {None}
            for wid, n, cap in (("a", 2, 13), ("b", 3, 9)):
                res = work.completed[wid]
                assert sorted(res) == list(range(n))
                for r, rr in res.items():
                    assert len(rr.tokens) == len(rr.logprobs) == len(rr.versions) <= cap
                    assert rr.versions == [0] * len(rr.tokens)
                    assert (rr.finish_reason == "length") == (len(rr.tokens) == cap and rr.tokens[-1] != 3)
                    _contiguous_progress(work, wid, r, 0, len(rr.tokens))
            # The two responses of a group draw different samples (per-response seeds).
            assert work.completed["a"][0].tokens != work.completed["a"][1].tokens
            ev = _events(tmp_path)
            sw = [e for e in ev if e["event"] == "switch"]
            assert sw[0]["version"] == 0 and sw[0]["fingerprint"] == sw[0]["expected"] == node.fingerprint
            batches = [e for e in ev if e["event"] == "batch"]
            assert batches and batches[0]["grants"] == 2 and batches[0]["sequences"] == 5
            assert sum(b["tokens"] for b in batches) == sum(len(r.tokens) for g in work.completed.values()
                                                            for r in g.values())
        finally:
            await node.close()
    asyncio.run(go())


class _Overlap:
    """Records whether an apply ever ran while a generation step was running (it must not)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stepping = 0
        self.applying = 0
        self.bad = 0

    def wrap(self, obj, name, mine, other):
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            with self.lock:
                if getattr(self, other):
                    self.bad += 1
                setattr(self, mine, getattr(self, mine) + 1)
            try:
                return fn(*a, **kw)
            finally:
                with self.lock:
                    setattr(self, mine, getattr(self, mine) - 1)
        setattr(obj, name, wrapped)


def test_new_version_mid_generation_switches_between_steps(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        eng = engine_factory()
        ov = _Overlap()
        ov.wrap(eng, "apply", "applying", "stepping")
        start = eng.start

        def start_wrapped(reqs):
            gen = start(reqs)
            ov.wrap(gen, "step", "stepping", "applying")
            return gen
        eng.start = start_wrapped
        published = asyncio.Event()

        async def on_progress(work_id, response, offset, n):
            if not published.is_set():
                published.set()
                await node.publish(*versions.deltas[0])  # arrives while the batch is generating
        work.on_progress = on_progress
        try:
            w = await RolloutWorker.create(node, _opts(tmp_path), eng)
            work.add(grant("a", _payload(40), responses=2))
            await _serve_until(w, lambda: "a" in work.completed)
            assert ov.bad == 0
            for rr in work.completed["a"].values():
                k = rr.versions.index(1)
                assert k >= 4 and rr.versions == [0] * k + [1] * (len(rr.versions) - k)
            assert eng.version == 1 and bits_equal(versions.states[1], eng.model.state_dict()) == []
            sw = [e for e in _events(tmp_path) if e["event"] == "switch"]
            assert [e["version"] for e in sw] == [0, 1]
            assert sw[1]["ok"] and sw[1]["fingerprint"] == versions.deltas[0][0].target_fingerprint
            assert sw[1]["switch_s"] >= 0
            assert sw[1]["how"] == "node-decoded"  # adopted from the node's own decode
            (b,) = [e for e in _events(tmp_path) if e["event"] == "batch"]
            assert b["versions"] == [0, 1] and b["switches"] == 1
        finally:
            await node.close()
    asyncio.run(go())


def test_switch_batch_mode_keeps_a_batch_on_one_version(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        published = asyncio.Event()

        async def on_progress(*_):
            if not published.is_set():
                published.set()
                await node.publish(*versions.deltas[0])
        work.on_progress = on_progress
        try:
            w = await RolloutWorker.create(node, _opts(tmp_path, switch="batch"), engine_factory())
            work.add(grant("a", _payload(20)))
            await _serve_until(w, lambda: "a" in work.completed and w.engine.version == 1)
            assert work.completed["a"][0].versions == [0] * 20
        finally:
            await node.close()
    asyncio.run(go())


def test_min_version_waits_for_the_newer_version(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        seen_before: list[int] = []

        async def on_progress(*_):
            seen_before.append(node.version)
        work.on_progress = on_progress
        # The worker holding the grant back: it waits for version 2 on the node (an event, not a sleep).
        waiting: list[int] = []
        wait_version = node.wait_version

        async def recorded_wait(version: int) -> None:
            waiting.append(version)
            await wait_version(version)
        node.wait_version = recorded_wait  # type: ignore[method-assign]
        try:
            w = await RolloutWorker.create(node, _opts(tmp_path), engine_factory())
            work.add(grant("late", _payload(8, min_version=2)))
            task = asyncio.create_task(w.serve())
            deadline = time.monotonic() + 60
            while 2 not in waiting and not work.progress_log:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            assert not work.progress_log and "late" not in work.completed  # held back: only version 0 here
            assert work.held.keys() == {"late"} and w.engine.version == 0
            await node.publish(*versions.deltas[0])
            await wait_version(1)
            assert not work.progress_log and "late" not in work.completed  # version 1 is not enough either
            await node.publish(*versions.deltas[1])
            deadline = time.monotonic() + 60
            while "late" not in work.completed:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert min(work.completed["late"][0].versions) >= 2
            assert all(v >= 2 for v in seen_before)
        finally:
            await node.close()
    asyncio.run(go())


def test_resume_continues_and_done_responses_are_kept(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        try:
            w = await RolloutWorker.create(node, _opts(tmp_path, max_batch=1), engine_factory())
            work.add(grant("full", _payload(12), responses=2))
            await _serve_until(w, lambda: "full" in work.completed)
            ref = work.completed["full"]
            r0 = ref[0]
            resume = {0: (r0.tokens[:5], r0.logprobs[:5], r0.versions[:5])}
            done = {1: ref[1].to_json()}
            work.add(grant("again", _payload(12), responses=2, resume=resume, done=done))
            await _serve_until(w, lambda: "again" in work.completed)
            got = work.completed["again"]
            assert got[1] == ref[1]  # taken from grant.done, not regenerated
            assert got[0].tokens == r0.tokens  # prefix kept, continuation identical (same stream seed)
            assert got[0].logprobs[:5] == r0.logprobs[:5]
            assert max(abs(a - b) for a, b in zip(got[0].logprobs, r0.logprobs)) < 0.05
            assert not [p for p in work.progress_log if p[0] == "again" and p[1] == 1]
            _contiguous_progress(work, "again", 0, 5, 12)
        finally:
            await node.close()
    asyncio.run(go())


def test_lost_lease_drops_only_that_grant(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work

        async def on_progress(work_id, *_):
            work.expire.add("gone")
        work.on_progress = on_progress
        try:
            w = await RolloutWorker.create(node, _opts(tmp_path), engine_factory())
            work.add(grant("gone", _payload(30)))
            work.add(grant("kept", _payload(30, seed=9)))
            await _serve_until(w, lambda: "kept" in work.completed)
            assert "gone" not in work.completed
            assert len(work.completed["kept"][0].tokens) == 30
            b = [e for e in _events(tmp_path) if e["event"] == "batch"][0]
            assert b["tokens"] < 60  # the dropped sequence stopped early
        finally:
            await node.close()
    asyncio.run(go())


def test_cancel_hands_back_every_grant(tmp_path, versions, monkeypatch, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        eng = engine_factory()
        monkeypatch.setattr(worker_mod, "build_engine", lambda cfg: eng)
        try:
            work.add(grant("long", _payload(400), responses=2))
            options = {"preset": "tiny", "threads": 1, "progress_every": 2, "request_wait": 0.2}
            job = asyncio.create_task(worker_mod.run(node, options), name="test:job")
            deadline = time.monotonic() + 60
            while not work.progress_log:
                assert time.monotonic() < deadline and not job.done()
                await asyncio.sleep(0.02)
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
            assert work.released_all == 1 and work.released == ["long"] and not work.completed
        finally:
            await node.close()
    asyncio.run(go())


def test_engine_that_diverges_exits_nonzero(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        work = MemoryWork()
        node.work = work
        try:
            eng = engine_factory()
            w = await RolloutWorker.create(node, _opts(tmp_path), eng)
            with torch.no_grad():  # bit rot behind the engine's back (its cached fingerprint does not see it)
                p = dict(eng.model.named_parameters())["model.norm.weight"]
                p.view(torch.int16)[0] ^= 1
            await node.publish(*versions.deltas[0])
            rc = await asyncio.wait_for(w.serve(), 60)
            assert rc == worker_mod.EXIT_DIVERGED
            sw = [e for e in _events(tmp_path) if e["event"] == "switch"]
            assert sw[-1]["version"] == 1 and not sw[-1]["ok"] and sw[-1]["fingerprint"] != sw[-1]["expected"]
            assert work.released_all == 1
        finally:
            await node.close()
    asyncio.run(go())


def test_options_are_validated():
    with pytest.raises(ConfigError) as info:
        WorkerOptions.from_dict({"max_bacth": 4})
    assert info.value.field == "max_bacth"
    with pytest.raises(ConfigError):
        WorkerOptions.from_dict({"switch": "sometimes"})
    with pytest.raises(ConfigError):
        WorkerOptions.from_dict({"engine": "tgi"}).engine_config()


def test_engine_changed_before_an_apply_exits_nonzero(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        node.work = MemoryWork()
        try:
            eng = engine_factory()
            w = await RolloutWorker.create(node, _opts(tmp_path), eng)
            with torch.no_grad():
                dict(eng.model.named_parameters())["model.norm.weight"].view(torch.int16)[3] ^= 4
            eng.state.invalidate()  # the engine notices at the next delta's base check
            await node.publish(*versions.deltas[0])
            assert await asyncio.wait_for(w.serve(), 60) == worker_mod.EXIT_DIVERGED
            assert eng.version == 0  # nothing applied
            sw = [e for e in _events(tmp_path) if e["event"] == "switch"]
            assert sw[-1]["how"] == "base-check" and not sw[-1]["ok"]
        finally:
            await node.close()
    asyncio.run(go())


def test_versions_the_node_no_longer_keeps_decoded_are_decoded_from_its_store(tmp_path, versions, engine_factory):
    async def go():
        node = await _node(tmp_path, versions)
        node.work = MemoryWork()
        try:
            eng = engine_factory()
            w = await RolloutWorker.create(node, _opts(tmp_path), eng)
            node.keep_decoded(0)
            for m, chunks in versions.deltas[:2]:
                await node.publish(m, chunks)
            node.keep_decoded(1)
            await node.publish(*versions.deltas[2])
            await w.reach(3)
            await w._audit_done()  # the last switch is recorded once its audit finished
            assert bits_equal(versions.states[3], eng.model.state_dict()) == []
            sw = [e for e in _events(tmp_path) if e["event"] == "switch"]
            assert [(e["version"], e["how"], e["ok"]) for e in sw] == [
                (0, "copy", True), (1, "delta", True), (2, "delta", True), (3, "node-decoded", True)]
        finally:
            await node.close()
    asyncio.run(go())


def test_copy_of_the_node_weights_is_one_version_while_the_node_applies_the_next(tmp_path, versions,
                                                                                  engine_factory):
    """A rollout joining while its node applies versions (a late joiner catching up) copies one
    version's words: the node's in-place commit waits for the copy instead of mixing into it."""
    async def go():
        node = await _node(tmp_path, versions)
        node.work = MemoryWork()
        loop = asyncio.get_running_loop()
        try:
            eng = engine_factory()
            real_load = eng.load
            calls = []

            def load(state, version, fp):
                calls.append(version)
                if len(calls) == 1:  # the node commits version 1 while this copy runs
                    asyncio.run_coroutine_threadsafe(node.publish(*versions.deltas[0]), loop)
                    time.sleep(0.5)  # ample for the tiny model's commit, were it not held off
                return real_load(state, version, fp)

            eng.load = load
            await RolloutWorker.create(node, _opts(tmp_path), eng)
            assert calls == [0]  # the first copy was consistent: no retry
            assert eng.version == 0 and bits_equal(versions.states[0], eng.model.state_dict()) == []
            await node.wait_version(1)  # and the node's commit went ahead once the copy was done
            assert node.fingerprint == versions.deltas[0][0].target_fingerprint
        finally:
            await node.close()
    asyncio.run(go())


def test_behind_a_rollout_node_the_engine_keeps_the_only_copy_and_rebuilds_from_the_store(tmp_path, versions,
                                                                                         engine_factory):
    """The worker's node drops its weights once the engine holds them; the engine then follows from the
    node's store, and where it cannot replay it rebuilds from the newest snapshot the store keeps."""
    async def go():
        tr = await _node(tmp_path, versions)
        kd = tmp_path / "keys"
        cfg = NodeConfig(id="r", role="rollout", data_dir=str(tmp_path / "r"), cluster_token="unit-test-token-42",
                         trainer_public_key=str(kd / "trainer.pub"), parents=[tr.address])
        node = await Node.create(cfg)
        try:
            eng = engine_factory()
            w = await RolloutWorker.create(node, _opts(tmp_path), eng)
            assert node.state is None  # dropped: the engine holds the weights
            for m, chunks in versions.deltas[:2]:
                await tr.publish(m, chunks)
            await asyncio.wait_for(node.wait_version(2), 30)
            await w.reach(2)
            assert node.state is None and bits_equal(versions.states[2], eng.model.state_dict()) == []
            await tr.publish(*versions.deltas[2])
            await asyncio.wait_for(node.wait_version(3), 30)
            await w._load_from_node()  # the fallback: snapshot 0 from the store, then deltas 1-3
            await w._audit_done()
            assert eng.version == 3 and bits_equal(versions.states[3], eng.model.state_dict()) == []
            sw = [e for e in _events(tmp_path) if e["event"] == "switch"]
            assert all(e["ok"] for e in sw) and sw[-1]["version"] == 3
        finally:
            w.close()
            await node.close()
            await tr.close()
    asyncio.run(go())
