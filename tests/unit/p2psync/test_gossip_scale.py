"""What breaks when gossip grows to 10,000 nodes, shown on small clusters (in-memory pump, fake
clock, seeded): partitions that heal, refutation on contact, detector waits that grow with log n,
messages that fit what their receiver takes, a plan that rides gossip in small shards, and the
live coordinator's figures. tools/gossip_scale.py measures 10,000 nodes."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from p2psync.control import plan_gossip
from p2psync.errors import CodecError
from p2psync.gossip import DetectorConfig, GossipConfig, GossipNode, MemberEntry
from p2psync.gossip.index import BucketIndex
from p2psync.gossip.membership import MemberTable
from p2psync.gossip.items import MAX_ENTRY_BYTES, PLAN_SHARDS
from p2psync.gossip.messages import Delta, Syn, dumps
from p2psync.gossip.sim import Sim, default_member


def _one_view(sim: Sim) -> bool:
    """Every running node holds the same table, and every running node is alive in it."""
    run = sim.running()
    if len(Counter(nd.index.root for nd in run)) != 1:
        return False
    return all(run[0].members.get(nd.id).status == "alive" for nd in run)


def test_a_partition_between_regions_heals_to_one_view_within_20_rounds():
    sim = Sim.cluster(64, seed=11)
    sim.run_until(3.0)
    side = lambda addr: int(addr.split(".")[-1].split(":")[0]) % 8 < 4  # noqa: E731  (regions r00-r03 | r04-r07)
    sim.partition(side)

    def split_complete() -> bool:  # every node holds every member across dead: none picks one as a peer
        return all(nd.members.get(m.id).status == "dead" for nd in sim.nodes.values() for m in sim.nodes.values()
                   if side(nd.members.me.address) != side(m.members.me.address))
    while not split_complete() and sim.now < 120.0:
        sim.run_until(sim.now + 5.0)
    assert split_complete()
    a, b = sim.nodes[default_member(1).address], sim.nodes[default_member(6).address]
    sim.heal()
    for _ in range(20):
        sim.run_until(sim.now + 1.0)
        if _one_view(sim):
            break
    assert _one_view(sim)
    assert a.members.get(b.id).incarnation > 0  # b refuted its death with a higher incarnation


def test_a_member_held_dead_that_calls_gets_its_entry_back_to_refute():
    sim = Sim.cluster(10, seed=12)
    x, y = sim.nodes[default_member(1).address], sim.nodes[default_member(2).address]
    dead = dataclasses.replace(x.members.get(y.id), status="dead", status_at=1.0)
    x.members.merge(dead, 1.0)
    out = x.receive(2.0, y.members.me.address, Syn(y.id, y.index.root, y.index.count))
    deltas = [m for _, m in out if isinstance(m, Delta)]
    assert deltas and deltas[0].members == (dead,)
    y.receive(2.1, x.members.me.address, deltas[0])
    assert y.members.me.status == "alive" and y.members.me.incarnation == dead.incarnation + 1


def _table(n: int) -> MemberTable:
    t = MemberTable(default_member(0), BucketIndex())
    for i in range(1, n):
        t.merge(default_member(i), 0.0)
    return t


@pytest.mark.parametrize("n, silent_ok, silent_suspect", [(1000, 9.5, 10.5), (10_000, 11.5, 12.5)])
def test_the_suspicion_wait_grows_with_log_n(n, silent_ok, silent_suspect):
    """At 10,000 members a watch waits 12 s, not 10 s: 0.2**12 per watch and round keeps false
    suspicions at 20 % loss as rare as 0.2**10 does at 1,000 members."""
    assert DetectorConfig().timeouts(1000) == (10.0, 20.0)
    t = _table(n)
    t.check(0.0)  # arms the watches
    for m in t.watched():
        t.on_heartbeat(0.0, m, 0, 1)  # heard once: the normal wait applies
    t.check(silent_ok)
    assert not t.suspicions
    t.check(silent_suspect)
    assert {m for _, m in t.suspicions} == set(t.watched())


def test_a_suspect_is_declared_dead_on_time_and_its_tombstone_dropped_on_time():
    """Deadlines kept per 1/16 s: a suspect held ``dead_after`` without a refutation is declared dead,
    not before; a refuted one never; the tombstone goes ``tombstone_ttl`` after it was written, not
    before, and the old entry is refused afterwards (it does not come back)."""
    t = _table(50)
    t.check(100.0)  # arms the watches (none fires before 130 s: never heard, three times the wait)
    victim, refuter = default_member(7), default_member(9)
    for m in (victim, refuter):
        t.merge(dataclasses.replace(m, status="suspect", status_at=100.0), 100.0)
    t.merge(dataclasses.replace(refuter, incarnation=1), 105.0)
    dead_after, ttl = t.config.timeouts(50)[1], t.config.tombstone_ttl
    t.check(100.0 + dead_after - 0.1)
    assert t.get(victim.id).status == "suspect"
    t.check(100.0 + dead_after + 0.1)
    dead = t.get(victim.id)
    assert dead.status == "dead" and dead.status_at == 100.0 + dead_after + 0.1
    assert t.get(refuter.id).status == "alive"
    t.check(dead.status_at + ttl - 0.1)
    assert t.get(victim.id) is dead
    t.check(dead.status_at + ttl + 0.1)
    assert t.get(victim.id) is None and not t.merge(dead, dead.status_at + ttl + 0.2)


def _fat(i: int) -> MemberEntry:
    """A member entry at the schema's limits (long id and address, 16 versions held)."""
    return dataclasses.replace(default_member(i), id=f"n{i:05d}-" + "x" * 120,
                               address="https://" + "a" * 230 + f".example:{7000 + i}", versions=tuple(range(16)))


def test_every_message_fits_what_its_receiver_takes_in_a_cluster_of_mixed_limits():
    """A third of the nodes are an older build (64 KiB bodies, ``accept`` never named), a third take
    64 KiB, the rest 1 MiB, and one joiner of each kind joins through a 1 MiB seed (not the
    coordinator, which answers within 64 KiB whatever the peer takes): every message fits
    its receiver, the 1 MiB joiner learns every member (~180 KB of entries at the schema's limits) in
    its first exchange, and the other two learn them 64 KiB at a time."""
    sim = Sim.cluster(300, seed=13, count_bytes=True, make=lambda i: default_member(0) if i == 0 else _fat(i))
    small = 64 << 10
    older = {nd.members.me.address for i, nd in enumerate(sim.nodes.values()) if i % 3 == 1}
    for i, nd in enumerate(sim.nodes.values()):
        if i % 3:
            nd.config = dataclasses.replace(nd.config, max_body_bytes=small)
    over: list[tuple[int, int]] = []
    big = 0
    send = sim._send

    def spy(src, out):
        nonlocal big
        if src in older:  # a build from before ``accept``: its messages name none
            out = [(d, dataclasses.replace(m, accept=0) if hasattr(m, "accept") else m) for d, m in out]
        for d, m in out:
            size, limit = len(dumps(m)), sim.nodes[d].config.max_body_bytes
            over.extend([(size, limit)] if size > limit else [])
            big = max(big, size)
        send(src, out)
    sim._send = spy  # type: ignore[method-assign]
    seed = (_fat(3).address,)  # 1 MiB
    joiners = [sim.join(_fat(300 + i), seeds=seed, config=GossipConfig(max_body_bytes=small if i else 1 << 20))
               for i in range(3)]
    older.add(joiners[2].members.me.address)
    sim.run_until(sim.now + 1.0)
    assert len(joiners[0].members) >= 301  # the whole cluster in one exchange
    for _ in range(20):
        sim.run_until(sim.now + 1.0)
        if all(len(nd.members) == 303 for nd in sim.running()):
            break
    assert all(len(nd.members) == 303 for nd in sim.running())
    assert not over and sim.oversize == 0 and big > small


def test_a_10000_node_plan_rides_gossip_in_shards_and_a_small_replan_rewrites_few():
    me = default_member(0)
    g = GossipNode(me, coordinator=me.id)
    parents = {f"n{i:05d}": f"n{(i // 16) * 16:05d}" if i % 16 else me.id for i in range(1, 10_000)}
    written = g.publish_plan(1, me.id, parents, 100.0)
    assert len(written) == PLAN_SHARDS and max(e.wire_bytes for e in written) < MAX_ENTRY_BYTES
    assert max(len(dumps(Delta(me.id, coord=(e,)))) for e in written) < 64 << 10
    assert g.coord.plan == (1, me.id, parents)
    moved = dict(parents, n00017=me.id, n00018=me.id)
    rewritten = g.publish_plan(2, me.id, moved, 101.0)
    assert 1 <= len(rewritten) <= 2
    assert g.coord.parent_of("n00017") == me.id and g.coord.parent_of("n00033") == "n00032"
    # One entry too big to ride a message is refused, and nothing changes.
    before = dict(g.coord.entries)
    with pytest.raises(CodecError, match="over"):
        g.publish("revoked", {"ids": [f"node-{i:06d}" for i in range(5000)]}, 102.0)
    assert g.coord.entries == before


def test_a_node_follows_its_planned_parent_from_its_shard():
    sim = Sim.cluster(40, seed=14)
    trainer = sim.nodes[default_member(0).address]
    parents = {nd.id: trainer.id for nd in sim.nodes.values() if nd is not trainer}
    parents["n00005"] = "n00016"
    trainer.publish_plan(1, trainer.id, parents, sim.now)
    leaf = sim.nodes[default_member(5).address]
    assert sim.rounds_until(lambda nd: plan_gossip.planned_parent(nd, nd.id) is not None or nd is trainer,
                            share=1.0) is not None
    version, url, pid = plan_gossip.planned_parent(leaf, leaf.id)
    assert pid == "n00016" and url == default_member(16).address


def _tool():
    spec = importlib.util.spec_from_file_location("gossip_scale", Path(__file__).parents[3] / "tools/gossip_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_live_coordinator_figures_on_a_small_cluster():
    """The tool's cluster phase on 64 nodes: membership news within 20 rounds, every child of a
    crashed relay on a new planned parent, traffic within budget, no message over 64 KiB."""
    out: dict = {}
    _tool().phase_cluster(64, 1, 15, out, lambda msg: None)
    assert out["joiner_rounds_p99"] <= 20 and out["leaver_rounds_p99"] <= 20, out
    assert out["failure_rounds_p99"] is not None and out["failure_rounds_p99"] <= 20, out
    assert out["failure_victim_children"] >= 1 and out["failure_to_new_parent_s"] is not None, out
    assert out["bytes_per_node_per_s_idle"] < 2_000 and out["bytes_per_node_per_s_churn"] < 5_000, out
    assert out["oversize_messages"] == 0, out
