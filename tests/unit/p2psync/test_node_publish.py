"""Trainer node publishing: the artifact is announced before the trainer's own apply; a bad one is withdrawn."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import tlsutil
import torch

from p2psync import config, keys
from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
from p2psync.errors import FingerprintMismatch
from p2psync.node import Node
from p2psync.state import ModelState

pytestmark = pytest.mark.timeout(60)
TOKEN = "node-publish-test-token"
CHUNK = 64 << 10


def _configs(tmp_path):
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    common = {"cluster_token": TOKEN, "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 0.5, "sse_keepalive": 1.0, "retry_after": 0.2},
              "store": {"snapshot_interval": 0}}
    tr = config.load(overrides={**common, "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t")})
    return priv, tr, common


def _states() -> list[ModelState]:
    g = torch.Generator().manual_seed(5)
    w = {"a": torch.randn(200_000, generator=g).bfloat16(), "b": torch.randn(300, 7, generator=g).bfloat16()}
    out = [ModelState({k: v.clone() for k, v in w.items()})]
    for _ in range(3):
        for t in w.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
            flat[idx] = (flat[idx].float() * 1.01).bfloat16()
        out.append(ModelState({k: v.clone() for k, v in w.items()}))
    return out


def _artifacts(priv, states):
    opts = CodecOptions(chunk_size=CHUNK, segment_elements=8192)
    enc = encode_snapshot(states[0], opts)
    arts = [(build_manifest(enc, model_id="m", target_version=0, chunk_size=CHUNK, private_key=priv), enc.chunks)]
    for v in range(1, len(states)):
        enc = encode_delta(states[v - 1], states[v], opts)
        m = build_manifest(enc, model_id="m", target_version=v, base_version=v - 1, chunk_size=CHUNK,
                           private_key=priv)
        arts.append((m, enc.chunks))
    return arts


def _same(a: ModelState, b: ModelState) -> bool:
    return all(np.array_equal(a.words(n), b.words(n)) for n in b)


def test_children_fetch_an_artifact_while_the_trainer_still_applies_it(tmp_path):
    """A follower reaches version 1 while the trainer's own commit of version 1 is held back."""
    priv, tr_cfg, common = _configs(tmp_path)
    states = _states()
    arts = _artifacts(priv, states)

    async def go():
        tr = await Node.create(tr_cfg)
        fol_cfg = config.load(overrides={**common, "id": "r", "role": "rollout", "data_dir": str(tmp_path / "r"),
                                         "parents": [tr.address]})
        fol = await Node.create(fol_cfg)
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(fol.wait_version(0), 20)
            release = asyncio.Event()
            real_commit = tr.replica.commit

            async def held_commit(*a, **kw):
                await release.wait()
                await real_commit(*a, **kw)

            tr.replica.commit = held_commit
            pub = asyncio.create_task(tr.publish(*arts[1]))
            await asyncio.wait_for(fol.wait_version(1), 20)
            assert tr.version == 0 and not pub.done()  # the trainer has not applied it yet
            assert _same(fol.state, states[1])
            release.set()
            await asyncio.wait_for(pub, 20)
            assert tr.version == 1 and tr.fingerprint == fol.fingerprint
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())


def test_an_artifact_that_does_not_apply_on_the_trainer_is_withdrawn(tmp_path):
    """Signed by the trainer's key but with a wrong target: publish raises, nobody holds or applies it,
    and the correct artifact for that version goes through afterwards."""
    priv, tr_cfg, common = _configs(tmp_path)
    states = _states()
    arts = _artifacts(priv, states)
    good, chunks = arts[1]
    forged = dataclasses.replace(good, target_fingerprint=arts[2][0].target_fingerprint, signature=None).sign(priv)

    async def go():
        tr = await Node.create(tr_cfg)
        fol_cfg = config.load(overrides={**common, "id": "r", "role": "rollout", "data_dir": str(tmp_path / "r"),
                                         "parents": [tr.address]})
        fol = await Node.create(fol_cfg)
        committed: list[str] = []  # every artifact the follower applied, in order
        commit = fol.replica.commit

        async def recorded_commit(manifest, *a, **kw):
            out = await commit(manifest, *a, **kw)
            committed.append(manifest.artifact_id)
            return out
        fol.replica.commit = recorded_commit  # type: ignore[method-assign]
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(fol.wait_version(0), 20)
            fp0 = tr.fingerprint
            with pytest.raises(FingerprintMismatch):
                await tr.publish(forged, chunks)
            assert tr.version == 0 and tr.fingerprint == fp0
            assert _same(tr.state, states[0])
            assert forged.artifact_id not in tr.store.artifacts
            assert all(a.id != forged.artifact_id for a in tr.catalogue().artifacts)
            # The follower may have seen the forged artifact before the trainer withdrew it; whatever it
            # did with it is over once it follows the correct artifacts published after it, and every
            # commit it made is recorded: the forged one is not among them.
            for m, c in arts[1:]:
                await tr.publish(m, c)
            await asyncio.wait_for(fol.wait_version(3), 20)
            assert forged.artifact_id not in committed
            assert set(committed) <= {m.artifact_id for m, _ in arts} and committed[-1] == arts[3][0].artifact_id
            assert _same(fol.state, states[3]) and fol.fingerprint == tr.fingerprint
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())


def test_the_trainers_event_stream_tells_when_its_own_copy_reached_the_version(tmp_path):
    """Watchers (status pages, the WAN benchmark's observer) learn the trainer's version from its events."""
    from p2psync.transport.client import PeerClient

    priv, tr_cfg, common = _configs(tmp_path)
    arts = _artifacts(priv, _states())

    async def go():
        tr = await Node.create(tr_cfg)
        client = await PeerClient.create(TOKEN, "watcher", stall_timeout=5.0, sse_keepalive=1.0, parallel_streams=1,
                                         tls=tlsutil.node_tls("watcher"))
        try:
            await tr.publish(*arts[0])
            seen = []

            async def watch():
                async for cat in client.call_events(tr.address):
                    seen.append(cat.version)
                    if cat.version == 2:
                        return
            task = asyncio.create_task(watch())
            await asyncio.sleep(0.3)
            for m, c in arts[1:3]:
                await tr.publish(m, c)
            await asyncio.wait_for(task, 10)
            assert seen[0] == 0 and 1 in seen and seen[-1] == 2
        finally:
            await client.close()
            await tr.close()

    asyncio.run(go())


def _changes(old: ModelState, new: ModelState) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for i, name in enumerate(new):
        pos = np.flatnonzero(old.words(name) != new.words(name)).astype(np.int64)
        out[i] = (pos, new.words(name)[pos].copy())
    return out


def test_the_trainer_takes_the_publishers_changes_and_refuses_wrong_ones_untouched(tmp_path):
    """With the changes the publisher extracted, the trainer's copy takes them without decoding its own
    chunks: bit-exact when they are right; a changed word, an extra or out-of-range position or an
    unknown tensor is refused with a typed error, the trainer's weights untouched and the artifact
    withdrawn, and the follower (which decodes the chunks) never applies a wrong version."""
    from p2psync.errors import CodecError

    priv, tr_cfg, common = _configs(tmp_path)
    states = _states()
    arts = _artifacts(priv, states)

    async def go():
        tr = await Node.create(tr_cfg)
        fol_cfg = config.load(overrides={**common, "id": "r", "role": "rollout", "data_dir": str(tmp_path / "r"),
                                         "parents": [tr.address]})
        fol = await Node.create(fol_cfg)
        try:
            await tr.publish(*arts[0])
            ch = _changes(states[0], states[1])
            pos, vals = ch[0]
            wrong_word = {**ch, 0: (pos, np.concatenate([vals[:1] ^ np.uint16(1), vals[1:]]))}
            extra_pos = {**ch, 0: (np.append(pos, pos[:1]), np.append(vals, vals[:1]))}
            outside = {**ch, 0: (np.append(pos, 200_000), np.append(vals, vals[:1]))}
            unknown = {**ch, 5: (pos[:1], vals[:1])}
            for bad, err in ((wrong_word, FingerprintMismatch), (extra_pos, FingerprintMismatch),
                             (outside, CodecError), (unknown, CodecError)):
                with pytest.raises(err):
                    await tr.publish(arts[1][0], arts[1][1], bad)
                assert tr.version == 0 and _same(tr.state, states[0]) and tr.state.audit() == tr.fingerprint
                assert arts[1][0].artifact_id not in tr.store.artifacts
            applied = 0

            def count_decodes(*a, **k):
                nonlocal applied
                applied += 1
                return real(*a, **k)

            from p2psync.codec import decode as dec

            real = dec.Applier.add_chunks
            dec.Applier.add_chunks = count_decodes
            try:
                await tr.publish(*arts[1], ch)
            finally:
                dec.Applier.add_chunks = real
            assert applied == 0  # the trainer decoded nothing of its own artifact
            assert tr.version == 1 and _same(tr.state, states[1]) and tr.state.audit() == tr.fingerprint
            for v in (2, 3):
                await tr.publish(*arts[v], _changes(states[v - 1], states[v]))
            await asyncio.wait_for(fol.wait_version(3), 20)
            assert _same(fol.state, states[3]) and fol.fingerprint == tr.fingerprint == arts[3][0].target_fingerprint
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread nice is Linux")
def test_decode_threads_run_below_the_node_and_pass_it_on_to_threads_they_start(tmp_path):
    """A node's decode/apply threads run the chosen ``nice`` steps below its other threads (so that on shared
    cores receiving and forwarding come first), threads they start inherit it, and the loop's are unchanged."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    _, tr_cfg, _ = _configs(tmp_path)

    async def go():
        tr = await Node.create(tr_cfg)
        try:
            mine = nice()
            for steps in (tr.replica.decode_order().nice, 7):
                pool = tr.replica.pool(steps, 1)
                inner = pool.submit(lambda: (nice(), ThreadPoolExecutor(1).submit(nice).result())).result()
                assert inner == (min(19, mine + steps),) * 2
            assert nice() == mine
        finally:
            await tr.close()

    base = os.getpriority(os.PRIO_PROCESS, 0)
    asyncio.run(go())
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_checkpoints_never_write_at_once_and_the_saved_state_loads(tmp_path):
    """A stop checkpoints while an interval checkpoint may still be writing in its thread (the
    stop cancels the task awaiting it, not the thread): the two must not race for the temporary
    file (that made the node exit 1 with FileNotFoundError); the saved weights load back."""
    import threading
    import time

    _, tr_cfg, _ = _configs(tmp_path)
    async def go():
        tr = await Node.create(tr_cfg)
        try:
            import torch

            tr.replica.state, tr.replica.version = ModelState({"w": torch.arange(1000, dtype=torch.float32)}), 4
            inside, most = [0], [0]
            real = tr.store.save_state

            def slow_save(state, version):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.2)
                try:
                    real(state, version)
                finally:
                    inside[0] -= 1

            tr.store.save_state = slow_save
            ts = [threading.Thread(target=tr.replica.checkpoint) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert most[0] == 1
            assert tr.replica.checkpointed == 4
            loaded = tr.store.load_state()
            assert loaded is not None and loaded[1] == 4
            assert loaded[0].fingerprint == tr.state.fingerprint
        finally:
            await tr.close()

    asyncio.run(go())


def test_a_delta_from_another_base_is_refused_before_it_is_announced(tmp_path):
    """Right base version, wrong base fingerprint: refused against the trainer's own copy, so no child is
    ever told about it (it was announced, then withdrawn), and the right delta goes through afterwards."""
    from p2psync.errors import WrongBase

    priv, tr_cfg, _ = _configs(tmp_path)
    states = _states()
    arts = _artifacts(priv, states)
    other = states[0].clone()
    other.words("b")[0] ^= 1
    other.invalidate()
    enc = encode_delta(other, states[1], CodecOptions(chunk_size=CHUNK, segment_elements=8192))
    wrong = build_manifest(enc, model_id="m", target_version=1, base_version=0, chunk_size=CHUNK, private_key=priv)

    async def go():
        tr = await Node.create(tr_cfg)
        try:
            await tr.publish(*arts[0])
            announced = []
            real_begin = tr.origin.board.begin
            tr.origin.board.begin = lambda aid, n: (announced.append(aid), real_begin(aid, n))[1]
            with pytest.raises(WrongBase):
                await tr.publish(wrong, enc.chunks)
            assert announced == [] and wrong.artifact_id not in tr.store.artifacts
            assert tr.version == 0 and _same(tr.state, states[0])
            await tr.publish(*arts[1])
            assert announced == [arts[1][0].artifact_id] and tr.version == 1
        finally:
            await tr.close()

    asyncio.run(go())
