"""Control-plane additions to the sans-IO gossip core, in the in-memory pump (fake clock, seeded):
trainer-signed coordinator entries, per-node reports to the coordinator only, lease-entry
tombstones that go away, versions that survive a coordinator restart (traffic under churn:
test_gossip_scale.py)."""

from __future__ import annotations

import pytest

from p2psync import keys
from p2psync.errors import NotCoordinator
from p2psync.gossip import GossipNode
from p2psync.gossip.messages import CoordEntry, Delta, Report, dumps, loads
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


def test_lease_tombstones_are_removed_everywhere_and_not_resurrected():
    sim = Sim.cluster(30, seed=5)
    trainer = sim.nodes[default_member(0).address]
    ttl = trainer.config.detector.tombstone_ttl
    trainer.publish("leases/n00003", [["w1", 40.0]], sim.now)
    assert sim.rounds_until(lambda nd: nd.coord.leases_of("n00003") == [("w1", 40.0)], share=1.0) is not None
    trainer.publish("leases/n00003", [], sim.now)  # n00003 holds nothing any more
    assert sim.rounds_until(lambda nd: nd.coord.get("leases/n00003").value == [], share=1.0) is not None
    tomb = trainer.coord.get("leases/n00003")
    sim.run_until(sim.now + ttl + 5)
    assert all("leases/n00003" not in nd.coord.entries for nd in sim.nodes.values())
    # A straggler offering the old tombstone again does not bring the key back.
    peer = sim.nodes[default_member(4).address]
    peer.receive(sim.now, "10.9.9.9:7070", Delta("n00009", coord=(tomb,)))
    assert "leases/n00003" not in peer.coord.entries
    assert len({nd.index.root for nd in sim.nodes.values()}) == 1  # every node holds the same again


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
