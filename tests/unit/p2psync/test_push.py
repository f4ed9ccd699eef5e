"""Push of small deltas down the children's open streams: bit-exact through relays, listed once,
corrupt parents avoided (the stream protocol's refusals: ``test_push_stream``)."""

from __future__ import annotations

import asyncio

import pushkit as kit
import pytest
import tlsutil

from p2psync.node import Node
from p2psync.state import ModelState
from p2psync.transport.client import PeerClient

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def setup(tmp_path):
    return kit.make_setup(tmp_path)


@pytest.mark.parametrize(("push_bytes", "forward_first"),
                         [(16 << 20, None), (16 << 20, False), (16 << 20, True), (0, None)],
                         ids=["push-chosen", "push-decode-as-arriving", "push-forward-first", "pull-only"])
def test_deltas_arrive_bit_exact_by_push_through_a_relay(tmp_path, setup, push_bytes, forward_first):
    priv, states, arts = setup
    lim = {"push_bytes": push_bytes, "forward_first": forward_first}

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer"))
        relay = await Node.create(kit.cfg(tmp_path, "relay", "relay", [tr.address], limits=lim))
        leaf = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [relay.address], limits=lim))
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(leaf.wait_version(0), 30)
            if push_bytes:
                await kit.padded((tr, 1), (relay, 1))
            await asyncio.sleep(0.5)  # streams open before the deltas are announced
            # Each node counts the nodes following it; the relay (one child) forwards before it decodes.
            assert (tr.board.children, relay.board.children, leaf.board.children) == (1, 1, 0)
            if forward_first is None:
                assert relay.replica.decode_order().forward_first
            delta_chunks = 0
            for m, chunks in arts[1:]:
                await tr.publish(m, chunks)
                delta_chunks += len(chunks)
                await asyncio.wait_for(leaf.wait_version(m.target_version), 30)
                await asyncio.wait_for(relay.wait_version(m.target_version), 30)  # cut-through: may finish later
                assert kit.same(leaf.state, states[m.target_version])
                assert relay.fingerprint == leaf.fingerprint == tr.fingerprint
            pushed = [n.metrics.total("p2psync_chunks_pushed_in_total") for n in (relay, leaf)]
            if push_bytes:
                assert pushed == [delta_chunks, delta_chunks]  # no delta chunk had to be pulled
                # Each chunk once: the trainer's only child is the relay, and the relay's the leaf.
                assert tr.metrics.total("p2psync_chunks_pushed_total") == delta_chunks
                assert relay.metrics.total("p2psync_chunks_pushed_total") == delta_chunks
            else:
                assert pushed == [0, 0]
        finally:
            for n in (leaf, relay, tr):
                await n.close()

    asyncio.run(go())


def test_an_artifact_complete_but_still_on_the_board_is_listed_and_pushed_once(tmp_path, setup):
    # Between the last chunk stored and the board's end (a moment on a busy trainer or relay), an
    # artifact is both complete and in flight; a catalogue taken then listed it twice, and each
    # push stream sent the whole delta twice over the child's link.
    priv, states, arts = setup

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer"))
        leaf = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [tr.address]))
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(leaf.wait_version(0), 30)
            await kit.padded((tr, 1))
            await asyncio.sleep(0.5)  # the stream is open
            m, chunks = arts[1]
            aid = m.artifact_id
            tr.store.add_manifest(m)
            for i, c in enumerate(chunks):
                tr.store.put_chunk(aid, i, c)
            tr.board.begin(aid, len(chunks))  # complete, and still on the board
            ids = [a.id for a in tr.catalogue().artifacts]
            assert ids.count(aid) == 1
            tr.heads.bump()
            await asyncio.wait_for(leaf.wait_version(1), 30)
            tr.board.end(aid)
            assert kit.same(leaf.state, states[1])
            assert tr.metrics.total("p2psync_chunks_pushed_total") == len(chunks)
            assert leaf.metrics.total("p2psync_chunks_pushed_in_total") == len(chunks)
        finally:
            for n in (leaf, tr):
                await n.close()

    asyncio.run(go())


def test_a_leaf_decoding_as_chunks_arrive_lists_a_pushed_delta_complete_while_its_decode_lags(
        tmp_path, setup, monkeypatch):
    # A leaf with a spare core decodes each pushed chunk as it arrives, through a bounded queue.
    # It holds the delta once the last chunk is verified and stored, and its catalogue must say so
    # then, whatever its decode has reached: on the WAN testbed such leaves were the last machines
    # "holding" a version, listed complete only once their decode had caught up to within the
    # queue's depth. Here the decode is held back entirely.
    import threading

    from p2psync.node import follower

    import torch

    priv = setup[0]
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1 << 21, generator=g).bfloat16()
    new = base.clone()
    new[::3] = (new[::3].float() * 1.01).bfloat16()
    states = [ModelState({"w": base}), ModelState({"w": new})]
    arts = kit.artifacts(priv, states)
    m, chunks = arts[1]
    depth = 1 + 2  # parallel_streams + 2
    assert len(chunks) > depth + 1
    gate = threading.Event()
    gate.set()

    class Gated(follower.Applier):
        def add_chunk(self, index, chunk):
            assert gate.wait(30)
            super().add_chunk(index, chunk)

    monkeypatch.setattr(follower, "Applier", Gated)

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer"))
        leaf = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [tr.address],
                                         limits={"forward_first": False, "parallel_streams": 1}))
        watcher = await PeerClient.create(kit.TOKEN, "watcher", stall_timeout=5.0, sse_keepalive=1.0,
                                          parallel_streams=1, tls=tlsutil.node_tls("watcher"))
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(leaf.wait_version(0), 30)
            await kit.padded((tr, 1))
            await asyncio.sleep(0.5)  # the stream is open
            assert not leaf.replica.decode_order().forward_first
            listed = asyncio.Event()

            async def watch():  # what a child or an observer sees: the leaf's event stream
                async for cat in watcher.call_events(leaf.address):
                    if any(a.id == m.artifact_id and a.complete for a in cat.artifacts):
                        listed.set()
                        return

            watching = asyncio.create_task(watch())
            await asyncio.sleep(0.3)  # its first catalogue came
            gate.clear()
            await tr.publish(m, chunks)
            await asyncio.wait_for(listed.wait(), 20)
            await watching
            assert leaf.version == 0  # nothing decoded yet, nothing applied
            assert leaf.metrics.total("p2psync_chunks_pushed_in_total") == len(chunks)
            gate.set()
            await asyncio.wait_for(leaf.wait_version(1), 30)
            assert kit.same(leaf.state, states[1]) and leaf.fingerprint == tr.fingerprint
        finally:
            gate.set()
            await watcher.close()
            for n in (leaf, tr):
                await n.close()

    asyncio.run(go())


def test_a_parent_pushing_corrupt_chunks_is_avoided_and_nothing_wrong_is_applied(tmp_path, setup):
    priv, states, arts = setup

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer"))
        bad = await Node.create(kit.cfg(tmp_path, "bad", "relay", [tr.address],
                                        testing={"corrupt_served_chunks": True}))
        good = await Node.create(kit.cfg(tmp_path, "good", "relay", [tr.address]))
        leaf = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [bad.address, good.address],
                                         limits={"avoid_seconds": 1.0}))
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(leaf.wait_version(0), 30)  # the snapshot: pulled, the bad relay caught there
            await asyncio.wait_for(bad.wait_version(0), 30)
            before = leaf.metrics.total("p2psync_bad_chunks_total")
            await asyncio.sleep(1.2)  # the bad relay is no longer avoided: the leaf follows it again
            leaf.follower.parent_changed.set()
            for _ in range(50):
                if leaf.status()["parent"] == bad.address:
                    break
                await asyncio.sleep(0.05)
            assert leaf.status()["parent"] == bad.address
            await asyncio.sleep(0.3)
            for m, chunks in arts[1:]:
                await tr.publish(m, chunks)
            await asyncio.wait_for(leaf.wait_version(3), 30)
            assert kit.same(leaf.state, states[3]) and leaf.fingerprint == tr.fingerprint
            assert leaf.metrics.total("p2psync_bad_chunks_total") > before  # caught in what was pushed
            assert bad.metrics.total("p2psync_chunks_pushed_total") >= 1
        finally:
            for n in (leaf, good, bad, tr):
                await n.close()

    asyncio.run(go())
