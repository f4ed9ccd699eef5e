"""Control-plane additions to the sans-IO gossip core, in the in-memory pump (fake clock, seeded):
trainer-signed coordinator entries, per-node reports to the coordinator only, lease-entry
tombstones that go away, versions that survive a coordinator restart (traffic under churn:
test_gossip_scale.py)."""

from __future__ import annotations

import pytest

from p2psync import keys
from p2psync.errors import NotCoordinator
from p2psync.gossip import GossipConfig, GossipNode
from p2psync.gossip.items import CoordEntry
from p2psync.gossip.messages import Delta, Report, dumps, loads
from p2psync.gossip.signing import signer, verifier
from p2psync.gossip.sim import Sim, default_member


def _signed_sim(n: int, seed: int = 3) -> tuple[Sim, object]:
    priv = keys.generate()
    sim = Sim.cluster(n, seed=seed)
    verify, sign = verifier(priv.public_key()), signer(priv)
    for node in sim.nodes.values():
        node.coord.verify = verify
    sim.nodes[default_member(0).address].coord.sign = sign
    return sim, priv


def test_signed_entries_spread_and_forged_ones_are_refused_with_state_untouched():
    sim, priv = _signed_sim(40)
    trainer = sim.nodes[default_member(0).address]
    [e] = trainer.publish_plan(1, trainer.id, {"n00001": trainer.id}, sim.now)
    assert e.signature and loads(dumps(Delta(trainer.id, coord=(e,)))).coord[0] == e  # survives the wire
    assert sim.rounds_until(lambda nd: nd.coord.plan is not None, share=1.0) is not None

    victim = sim.nodes[default_member(5).address]
    before = (dict(victim.coord.entries), victim.index.root)
    evil = {"epoch": 2, "root": trainer.id, "parents": {"n00001": "n00007"}}
    forgeries = [
        CoordEntry(e.name, e.version + 10, trainer.id, evil),                     # unsigned, claims the trainer
        signer(keys.generate())(CoordEntry(e.name, e.version + 10, trainer.id, evil)),  # another key
        CoordEntry(e.name, e.version + 10, trainer.id, evil, e.signature),         # a real signature, altered entry
        CoordEntry("head", e.version + 10, trainer.id, {"version": 99}, "!!notbase64"),
    ]
    for f in forgeries:
        assert victim.receive(sim.now, "10.9.9.9:7070", Delta("n00007", coord=(f,))) == []
    assert victim.coord.rejected == len(forgeries)
    assert (victim.coord.entries, victim.index.root) == before
    # The relay cannot write either, even with a signing hook of its own.
    rogue = sim.nodes[default_member(7).address]
    rogue.coord.sign = signer(keys.generate())
    with pytest.raises(NotCoordinator):
        rogue.publish("head", {"version": 99}, sim.now)


def test_reports_go_to_the_coordinator_only():
    sim = Sim.cluster(30, seed=4, count_bytes=True)
    trainer = sim.nodes[default_member(0).address]
    node = sim.nodes[default_member(9).address]
    before = node.members.me
    assert node.update_self(sim.now, versions=(3, 4), throughput=1500.0, bandwidth=2e8)
    sim.run_until(sim.now + 2.0)
    rep = trainer.report_of(node.id)
    assert rep == Report(node.id, 0, (3, 4), 1500.0, 2e8)
    # The member entry did not change, so no other node re-learned it.
    assert node.members.me == before
    assert all(nd.report_of(node.id) is None for nd in sim.nodes.values() if nd is not trainer)
    # Small moves are not re-sent; a new version is.
    assert not node.update_self(sim.now, versions=(3, 4), throughput=1510.0)
    assert node.update_self(sim.now, versions=(4, 5))
    sim.run_until(sim.now + 2.0)
    assert trainer.report_of(node.id).versions == (4, 5)


def test_lease_tombstones_are_removed_and_not_resurrected():
    sim = Sim.cluster(30, seed=5)
    trainer = sim.nodes[default_member(0).address]
    holder = sim.nodes[default_member(3).address]
    ttl = trainer.config.detector.tombstone_ttl
    trainer.publish("leases/n00003", [["w1", 40.0]], sim.now)
    sim.run_until(sim.now + 2.0)
    assert holder.coord.leases_of("n00003") == [("w1", 40.0)]
    trainer.publish("leases/n00003", [], sim.now)  # n00003 holds nothing any more
    sim.run_until(sim.now + 2.0)
    assert holder.coord.get("leases/n00003").value == []
    tomb = trainer.coord.get("leases/n00003")
    sim.run_until(sim.now + ttl + 5)
    assert all("leases/n00003" not in nd.coord.entries for nd in sim.nodes.values())
    # A straggler offering the old tombstone again does not bring the key back.
    for nd in (holder, trainer):
        nd.receive(sim.now, "10.9.9.9:7070", Delta("n00009", coord=(tomb,)))
        assert "leases/n00003" not in nd.coord.entries
    assert len({nd.index.root for nd in sim.nodes.values()}) == 1  # every node holds the same again


def _lease_sim(n: int, seed: int) -> tuple[Sim, GossipNode, object]:
    sim, priv = _signed_sim(n, seed)
    trainer = sim.nodes[default_member(0).address]
    for i in range(1, n):
        trainer.publish(f"leases/{default_member(i).id}", [[f"w{i}", 100.0 + i]], sim.now)
    return sim, trainer, priv


def test_a_lease_entry_reaches_its_holder_only_and_never_rides_anti_entropy():
    sim, trainer, _ = _lease_sim(40, seed=7)
    roots = {nd.index.root for nd in sim.nodes.values()}
    sim.run_until(sim.now + 3.0)
    for i in range(1, 40):
        nd = sim.nodes[default_member(i).address]
        assert nd.coord.leases_of(nd.id) == [(f"w{i}", 100.0 + i)]
        assert [k for k in nd.coord.entries if k.startswith("leases/")] == [f"leases/{nd.id}"]
    assert len([k for k in trainer.coord.entries if k.startswith("leases/")]) == 39
    # The replicated table did not change: no node's root (what Syns compare) moved.
    assert {nd.index.root for nd in sim.nodes.values()} == roots and len(roots) == 1

    # Another node's entry offered directly (by a peer that still lists them) is not kept.
    other = trainer.coord.get("leases/n00005")
    bystander = sim.nodes[default_member(6).address]
    before = dict(bystander.coord.entries)
    assert bystander.receive(sim.now, "10.9.9.9:7070", Delta("n00009", coord=(other,))) == []
    assert bystander.coord.entries == before and bystander.coord.rejected == 0
    # A forged one for the holder itself is refused, its entry untouched.
    holder = sim.nodes[default_member(5).address]
    forged = CoordEntry("leases/n00005", other.version + 5, trainer.id, [["stolen", 1.0]], other.signature)
    holder.receive(sim.now, "10.9.9.9:7070", Delta("n00009", coord=(forged,)))
    assert holder.coord.rejected == 1 and holder.coord.leases_of("n00005") == [("w5", 105.0)]


def test_a_lost_lease_send_and_both_restarts_are_repaired_by_the_holders_report():
    sim, trainer, priv = _lease_sim(20, seed=8)
    report_interval = trainer.config.report_interval
    holder_entry = default_member(4)
    holder = sim.nodes[holder_entry.address]
    sim.run_until(sim.now + 3.0)
    assert holder.coord.leases_of(holder.id) == [("w4", 104.0)]
    trainer.publish("leases/n00004", [["w4", 104.0], ["w44", 144.0]], sim.now)
    trainer._lease_sends.pop(holder_entry.id)  # its send is lost
    sim.run_until(sim.now + 2.0)
    assert holder.coord.leases_of(holder.id) == [("w4", 104.0)]
    sim.run_until(sim.now + report_interval + 2.0)
    assert holder.coord.leases_of(holder.id) == [("w4", 104.0), ("w44", 144.0)]

    # The holder restarts with no state: its first report fetches its entry again.
    sim.crash(holder_entry.address)
    fresh = sim.join(holder_entry, seeds=(trainer.members.me.address,))
    fresh.coord.verify = verifier(priv.public_key())
    sim.run_until(sim.now + 3.0)
    assert fresh.coord.leases_of(fresh.id) == [("w4", 104.0), ("w44", 144.0)]

    # The coordinator restarts with no lease entries: the holders' reports bring them back to it.
    t_addr = trainer.members.me.address
    sim.crash(t_addr)
    new = GossipNode(trainer.members.me, coordinator=trainer.id, seed=9, now=sim.now, seeds=(),
                     rejoin=tuple(nd.members.me.address for nd in sim.running()),
                     verify=verifier(priv.public_key()), sign=signer(priv))
    sim.add(new)
    sim.run_until(sim.now + report_interval + 3.0)
    assert new.coord.leases_of("n00004") == [("w4", 104.0), ("w44", 144.0)]
    assert len([k for k in new.coord.entries if k.startswith("leases/")]) == 19


def test_versions_follow_the_clock_so_a_restarted_coordinator_wins():
    sim = Sim.cluster(20, seed=6)
    sim.run_until(100.0)
    trainer = sim.nodes[default_member(0).address]
    old = trainer.publish("head", {"version": 5}, sim.now)
    assert sim.rounds_until(lambda nd: nd.coord.head == 5, share=1.0) is not None
    # The trainer restarts with no state and writes again a minute later.
    fresh = GossipNode(trainer.members.me, coordinator=trainer.id, seed=1, now=sim.now + 60)
    new = fresh.publish("head", {"version": 6}, sim.now + 60)
    assert new.version > old.version
    peer = sim.nodes[default_member(3).address]
    peer.receive(sim.now, trainer.members.me.address, Delta(trainer.id, coord=(new,)))
    assert peer.coord.head == 6


def _reports_to_coordinator(n: int, budget: float, seconds: float, seed: int = 11) -> tuple[float, Sim]:
    """Every member takes a new version every 2 s for ``seconds``: the coordinator's reports a second
    after the cluster's first ones (10 s in)."""
    sim = Sim.cluster(n, seed=seed, config=GossipConfig(report_budget=budget))
    trainer = sim.nodes[default_member(0).address]
    got: list[float] = []
    take = trainer._take_report

    def counting(now: float, rep: Report) -> None:
        got.append(now)
        take(now, rep)

    trainer._take_report = counting  # type: ignore[method-assign]
    for step in range(1, int(seconds / 2) + 1):
        for nd in sim.running():
            nd.update_self(sim.now, versions=(step,))
        sim.run_until(sim.now + 2.0)
    return len([t for t in got if t >= 10.0]) / (sim.now - 10.0), sim


def test_reports_stay_within_the_coordinators_budget_when_every_member_takes_each_version():
    n, budget = 300, 30.0
    unbounded, _ = _reports_to_coordinator(n, 0.0, 40.0)
    assert unbounded > 4 * budget  # each member reports each version: n / 2 s
    rate, sim = _reports_to_coordinator(n, budget, 40.0)
    assert rate <= 1.2 * budget, rate
    # Each member's newest version still reaches the coordinator, within 1.5 spacings of taking it.
    trainer = sim.nodes[default_member(0).address]
    assert trainer.report_spacing() == n / budget
    last = 20
    sim.run_until(sim.now + 1.5 * n / budget + 2.0)
    held = {nd.id: trainer.reports[nd.id][1].versions for nd in sim.running() if nd is not trainer}
    assert all(v == (last,) for v in held.values()), sorted(set(held.values()))


def test_a_member_reports_at_once_when_the_cluster_is_small_enough():
    # 40 members with the default budget (500 a second): spacing 0.08 s, under one round.
    sim = Sim.cluster(40, seed=12)
    trainer = sim.nodes[default_member(0).address]
    sim.run_until(5.0)
    member = sim.nodes[default_member(7).address]
    member.update_self(sim.now, versions=(3,))
    sim.run_until(sim.now + 1.5)
    assert trainer.reports[member.id][1].versions == (3,)
