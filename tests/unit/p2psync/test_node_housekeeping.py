"""Housekeeping after a commit (signed snapshot, checkpoint, retention) runs beside the next
version's announcement, never under a commit, and its failure loses nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest

from p2psync import config
from p2psync.node import Node
from tests.unit.p2psync.test_node_publish import _artifacts, _configs, _same, _states

pytestmark = pytest.mark.timeout(60)


def _trainer_cfg(tmp_path, **store):
    priv, cfg, _ = _setup(tmp_path, **store)
    return priv, cfg


def _setup(tmp_path, **store):
    """A key pair, the trainer's config and the settings every node shares."""
    priv, _, common = _configs(tmp_path)
    cfg = config.load(overrides={**common, "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"),
                                 "trainer_private_key": str(tmp_path / "keys" / "trainer.key"),
                                 "store": {**common["store"], **store}})
    return priv, cfg, common


def _snapshot(node: Node, version: int):
    return node.store.find("snapshot", version, complete=True)


def test_next_version_is_announced_while_the_snapshot_is_signed_and_applied_after_it(tmp_path):
    priv, cfg = _trainer_cfg(tmp_path, snapshot_interval=1, checkpoint_interval=1)
    states = _states()
    arts = _artifacts(priv, states)
    gate, inside = threading.Event(), threading.Event()

    async def go():
        tr = await Node.create(cfg)
        real_sign = tr.origin.sign_snapshot

        def held_sign(model_id):
            inside.set()
            assert gate.wait(20)
            return real_sign(model_id)

        tr.origin.sign_snapshot = held_sign
        try:
            await tr.publish(*arts[0])
            # Version 1's snapshot is due: publish returns with the trainer at version 1 while
            # the snapshot is still being made.
            await asyncio.wait_for(tr.publish(*arts[1]), 20)
            assert tr.version == 1 and _same(tr.state, states[1])
            assert await asyncio.to_thread(inside.wait, 20)
            assert _snapshot(tr, 1) is None
            # Version 2 is stored and announced at once; its commit waits for the snapshot,
            # which reads version 1's weights.
            pub = asyncio.create_task(tr.publish(*arts[2]))
            aid2 = arts[2][0].artifact_id
            for _ in range(200):
                art = tr.store.artifacts.get(aid2)
                if art is not None and art.complete:
                    break
                await asyncio.sleep(0.02)
            assert tr.store.artifacts[aid2].complete
            assert any(a.id == aid2 for a in tr.catalogue().artifacts)
            await asyncio.sleep(0.2)
            assert tr.version == 1 and not pub.done()
            gate.set()
            await asyncio.wait_for(pub, 20)
            assert tr.version == 2 and _same(tr.state, states[2])
            snap = _snapshot(tr, 1)
            assert snap is not None
            # The snapshot holds version 1's bits, not version 2's.
            assert snap.manifest.target_fingerprint == arts[1][0].target_fingerprint
            snap.manifest.verify(tr.public_key)
            await tr.settle()
        finally:
            gate.set()
            await tr.close()
        # The checkpoint made on the way (or on exit) loads back as the last version.
        loaded = tr.store.load_state()
        assert loaded is not None and loaded[1] == 2 and _same(loaded[0], states[2])

    asyncio.run(go())


def test_a_failed_snapshot_is_logged_and_the_versions_go_on(tmp_path, caplog):
    priv, cfg = _trainer_cfg(tmp_path, snapshot_interval=1, checkpoint_interval=0)
    states = _states()
    arts = _artifacts(priv, states)

    async def go():
        tr = await Node.create(cfg)

        def broken(model_id):
            raise OSError(28, "No space left on device")

        tr.origin.sign_snapshot = broken
        try:
            for m, chunks in arts:
                await asyncio.wait_for(tr.publish(m, chunks), 20)
            await tr.settle()
            assert tr.version == 3 and _same(tr.state, states[3])
            assert tr.fingerprint == arts[3][0].target_fingerprint
            assert all(_snapshot(tr, v) is None for v in (1, 2, 3))
            assert tr.metrics.total("p2psync_housekeeping_errors_total") == 3
        finally:
            await tr.close()

    with caplog.at_level(logging.ERROR, logger="p2psync"):
        asyncio.run(go())
    assert sum("housekeeping after version" in r.getMessage() and "No space left" in r.getMessage()
               for r in caplog.records) == 3


def test_close_waits_for_a_snapshot_in_progress(tmp_path):
    priv, cfg = _trainer_cfg(tmp_path, snapshot_interval=1, checkpoint_interval=0)
    states = _states()
    arts = _artifacts(priv, states)
    inside = threading.Event()

    async def go():
        tr = await Node.create(cfg)
        real_sign = tr.origin.sign_snapshot

        def slow_sign(model_id):
            inside.set()
            threading.Event().wait(0.5)
            return real_sign(model_id)

        tr.origin.sign_snapshot = slow_sign
        await tr.publish(*arts[0])
        await tr.publish(*arts[1])
        assert await asyncio.to_thread(inside.wait, 20)
        await tr.close()
        snap = _snapshot(tr, 1)
        assert snap is not None and snap.complete
        assert snap.manifest.target_fingerprint == arts[1][0].target_fingerprint

    asyncio.run(go())


def _relay_cfg(tmp_path, common, parent: Node):
    return config.load(overrides={**common, "id": "relay", "role": "relay", "data_dir": str(tmp_path / "relay"),
                                  "parents": [parent.address]})


def test_a_relay_waits_for_a_snapshot_still_being_signed_and_rebuilds_it(tmp_path):
    """The trainer announces version 2 while it still signs version 1's snapshot. The relay
    forwards version 2 at once (its child applies it), but commits it only after it rebuilt the
    signed snapshot of version 1 from the weights it held: a late joiner can start from it."""
    priv, cfg, common = _setup(tmp_path, snapshot_interval=1, checkpoint_interval=0)
    states = _states()
    arts = _artifacts(priv, states)
    gate, inside, later = threading.Event(), threading.Event(), threading.Event()

    async def go():
        tr = await Node.create(cfg)
        real_sign = tr.origin.sign_snapshot

        def held_sign(model_id):
            if tr.version == 1:
                inside.set()
                assert gate.wait(30)
            elif tr.version == 2:  # not before the relay asked for version 1's: the trainer's
                assert later.wait(30)  # snapshot of 2 would retire it (a race, not what is tested)
            return real_sign(model_id)

        tr.origin.sign_snapshot = held_sign
        relay = await Node.create(_relay_cfg(tmp_path, common, tr))
        kid = await Node.create(config.load(overrides={**common, "id": "kid", "role": "rollout",
                                                       "data_dir": str(tmp_path / "kid"),
                                                       "parents": [relay.address]}))
        try:
            await tr.publish(*arts[0])
            await tr.publish(*arts[1])
            await asyncio.wait_for(relay.wait_version(1), 20)
            assert await asyncio.to_thread(inside.wait, 20)
            pub = asyncio.create_task(tr.publish(*arts[2]))
            # The relay forwards version 2 while its own commit waits for the snapshot.
            await asyncio.wait_for(kid.wait_version(2), 20)
            assert _same(kid.state, states[2])
            assert relay.version == 1 and 1 in relay.catalogue().snapshots_pending
            assert _snapshot(relay, 1) is None
            gate.set()
            await asyncio.wait_for(pub, 20)
            await asyncio.wait_for(relay.wait_version(2), 20)
            assert _same(relay.state, states[2])
            snap = _snapshot(relay, 1)
            assert snap is not None, sorted(relay.store.artifacts)
            assert snap.manifest.target_fingerprint == arts[1][0].target_fingerprint
            snap.manifest.verify(relay.public_key)
            # Version 2's snapshot (due too) follows the same way once the trainer signed it.
            later.set()
            await relay.settle()
            assert _snapshot(relay, 2) is not None and not relay.catalogue().snapshots_pending
            assert relay.metrics.total("p2psync_snapshots_materialised_total") == 2
        finally:
            gate.set()
            later.set()
            await kid.close()
            await relay.close()
            await tr.close()

    asyncio.run(go())


def test_a_relay_gives_up_on_a_snapshot_the_trainer_failed_to_sign(tmp_path):
    priv, cfg, common = _setup(tmp_path, snapshot_interval=1, checkpoint_interval=0)
    states = _states()
    arts = _artifacts(priv, states)
    gate, inside = threading.Event(), threading.Event()

    async def go():
        tr = await Node.create(cfg)
        real_sign = tr.origin.sign_snapshot

        def failing_sign(model_id):
            if tr.version == 1:
                inside.set()
                assert gate.wait(30)
                raise OSError(28, "No space left on device")
            return real_sign(model_id)

        tr.origin.sign_snapshot = failing_sign
        relay = await Node.create(_relay_cfg(tmp_path, common, tr))
        try:
            await tr.publish(*arts[0])
            await tr.publish(*arts[1])
            assert await asyncio.to_thread(inside.wait, 20)
            pub = asyncio.create_task(tr.publish(*arts[2]))
            for _ in range(200):
                if 1 in relay.catalogue().snapshots_pending:
                    break
                await asyncio.sleep(0.02)
            assert 1 in relay.catalogue().snapshots_pending
            gate.set()
            await asyncio.wait_for(pub, 20)
            # The trainer withdraws the pending snapshot; the relay stops waiting at once (well
            # before store.snapshot_wait) and goes on, keeping no snapshot of version 1.
            await asyncio.wait_for(relay.wait_version(2), 10)
            assert _same(relay.state, states[2])
            await relay.settle()
            assert _snapshot(relay, 1) is None and not relay.catalogue().snapshots_pending
            await tr.publish(*arts[3])
            await asyncio.wait_for(relay.wait_version(3), 10)
            assert _same(relay.state, states[3])
        finally:
            gate.set()
            await relay.close()
            await tr.close()

    asyncio.run(go())


def test_a_relay_whose_disk_is_full_stays_up_and_catches_up_once_space_is_freed(tmp_path, caplog, monkeypatch):
    """Found by the chaos soak (tools/chaos.py, disk_full): a write refused by the data dir crashed the
    relay's follow task and stopped the node. Now it keeps its version and serving, leaves no temporary
    file behind, says why, tries again, and exits cleanly even when its exit checkpoint cannot be written."""
    priv, cfg, common = _setup(tmp_path, snapshot_interval=0, checkpoint_interval=0)
    states = _states()
    arts = _artifacts(priv, states)
    full = threading.Event()

    async def go():
        tr = await Node.create(cfg)
        relay = await Node.create(_relay_cfg(tmp_path, common, tr))
        real_replace = os.replace

        def replace(src, dst):  # the relay's temporary file was written; making it the file fails
            if full.is_set() and str(dst).startswith(str(tmp_path / "relay")):
                raise OSError(28, "No space left on device")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(relay.wait_version(0), 20)
            full.set()
            await tr.publish(*arts[1])
            for _ in range(200):
                if relay.metrics.total("p2psync_store_errors_total") >= 2:
                    break
                await asyncio.sleep(0.05)
            assert relay.metrics.total("p2psync_store_errors_total") >= 2  # tried, and tried again
            assert relay.version == 0 and _same(relay.state, states[0])
            assert relay.status()["version"] == 0  # still up and answering
            assert not list((tmp_path / "relay").rglob("*.tmp"))

            def no_room(state, version):
                raise OSError(28, "No space left on device")

            relay.store.save_state = no_room  # room for artifacts again, not for its checkpoints
            full.clear()
            await asyncio.wait_for(relay.wait_version(1), 20)
            assert _same(relay.state, states[1])
            await relay.settle()
            errors = relay.metrics.total("p2psync_housekeeping_errors_total")
        finally:
            full.clear()
            await relay.close()
            await tr.close()
        assert relay.metrics.total("p2psync_housekeeping_errors_total") == errors + 1  # the exit checkpoint

    with caplog.at_level(logging.ERROR, logger="p2psync"):
        asyncio.run(go())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "cannot store" in text and "No space left" in text
    assert "checkpoint of version 1 at exit failed" in text
    assert "crashed" not in text
