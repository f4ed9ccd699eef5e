"""Restarts in the in-memory pump (fake clock, seeded): a node stopped and started again with its
data dir, or without it, is back in every view within a bounded number of rounds, and the
signed revocation list it kept comes back with it."""

from __future__ import annotations

import dataclasses

import pytest

from p2psync import keys
from p2psync.control import saved_state
from p2psync.control.saved_state import SavedControl
from p2psync.errors import NotCoordinator
from p2psync.gossip import GossipConfig, GossipNode
from p2psync.gossip.membership import restart_incarnation
from p2psync.gossip.items import CoordEntry
from p2psync.gossip.signing import signer, verifier
from p2psync.gossip.sim import Sim, default_member

N = 30
BOUND = 20
"""Rounds within which a restarted node must be back in every view (1 s rounds, fake clock)."""
CFG = GossipConfig(rejoin_interval=5.0)


def _everyone_sees_everyone_alive(sim: Sim):
    ids = {nd.id for nd in sim.running()}

    def pred(nd: GossipNode) -> bool:
        return {e.id for e in nd.members.entries.values() if e.status == "alive"} >= ids
    return pred


def _stop_gracefully(sim: Sim, member_id: str) -> GossipNode:
    """SIGTERM: the node pushes its ``left`` tombstone, which every other node then holds."""
    addr = next(a for a, nd in sim.nodes.items() if nd.id == member_id)
    old = sim.nodes[addr]
    sim.leave(addr)
    gone = sim.rounds_until(lambda nd: nd is old or nd.members.get(member_id).status == "left", share=1.0)
    assert gone is not None
    sim.run_until(sim.now + 3.0)  # it stopped answering
    return sim.nodes.pop(addr)


def _signed(n: int = N, seed: int = 7) -> tuple[Sim, object]:
    priv = keys.generate()
    sim = Sim.cluster(n, seed=seed, config=CFG)
    for nd in sim.nodes.values():
        nd.coord.verify = verifier(priv.public_key())
    sim.nodes[default_member(0).address].coord.sign = signer(priv)
    sim.run_until(2.0)
    return sim, priv


def test_a_restarted_trainer_is_back_in_every_view_through_the_members_it_remembered():
    sim, _ = _signed()
    trainer = default_member(0)
    old = _stop_gracefully(sim, trainer.id)
    remembered = tuple(default_member(i).address for i in (3, 16, 21))
    # Started again from its data dir: no seeds (a trainer has none), the incarnation it kept.
    me = dataclasses.replace(trainer, incarnation=restart_incarnation(old.members.me.incarnation, sim.now))
    fresh = sim.join(me, seeds=(), rejoin=remembered, config=CFG, coordinator=trainer.id)
    r = sim.rounds_until(_everyone_sees_everyone_alive(sim), share=1.0, max_rounds=BOUND)
    assert r is not None, {nd.id: nd.members.get(trainer.id).status for nd in sim.running() if nd is not fresh}
    assert len(fresh.alive_member_ids()) == N


def test_a_trainer_that_lost_its_data_dir_is_called_back_by_nodes_that_have_it_as_seed():
    sim, _ = _signed()
    trainer = default_member(0)
    for nd in sim.nodes.values():
        if nd.id != trainer.id:
            nd.seeds = (trainer.address,)
    _stop_gracefully(sim, trainer.id)
    # Nothing kept: no remembered members, and only the clock to start its incarnation from.
    me = dataclasses.replace(trainer, incarnation=restart_incarnation(0, 1.7e9 + sim.now))
    fresh = sim.join(me, seeds=(), config=CFG, coordinator=trainer.id)
    r = sim.rounds_until(_everyone_sees_everyone_alive(sim), share=1.0, max_rounds=BOUND)
    assert r is not None
    assert len(fresh.alive_member_ids()) == N


def test_a_restarted_relay_is_back_in_every_view():
    sim, _ = _signed()
    relay = default_member(16)
    old = _stop_gracefully(sim, relay.id)
    me = dataclasses.replace(relay, incarnation=restart_incarnation(old.members.me.incarnation, sim.now))
    sim.join(me, seeds=(default_member(0).address,), config=CFG, coordinator=default_member(0).id)
    assert sim.rounds_until(_everyone_sees_everyone_alive(sim), share=1.0, max_rounds=BOUND) is not None


def test_the_restart_incarnation_outranks_what_peers_remember():
    assert restart_incarnation(7, 3.0) == 8  # the data dir's counter wins over a clock set back
    assert restart_incarnation(0, 1.7e9 + 0.9) == 1_700_000_000  # no data dir: the clock
    sim, _ = _signed(5)
    relay = default_member(1)
    _stop_gracefully(sim, relay.id)
    peer = sim.nodes[default_member(2).address]
    tomb = peer.members.get(relay.id)
    assert tomb.status == "left"
    back = dataclasses.replace(relay, incarnation=restart_incarnation(tomb.incarnation, sim.now))
    assert peer.members.merge(back, sim.now) and peer.members.get(relay.id).status == "alive"


def test_a_revocation_list_kept_across_a_restart_is_enforced_and_gossiped_on(tmp_path):
    sim, priv = _signed()
    trainer = sim.nodes[default_member(0).address]
    entry = trainer.publish("revoked", {"ids": ["n00009"]}, sim.now)
    assert sim.rounds_until(lambda nd: nd.coord.get("revoked") is not None, share=1.0, max_rounds=BOUND)

    # A relay saves the list, stops, and comes back from its data dir.
    relay = default_member(16)
    path = saved_state.path_in(tmp_path)
    saved_state.save(path, SavedControl(4, (trainer.members.me.address,), entry))
    old = _stop_gracefully(sim, relay.id)
    kept = saved_state.load(path, verifier(priv.public_key()))
    assert kept.revoked == entry and kept.incarnation == 4
    me = dataclasses.replace(relay, incarnation=restart_incarnation(kept.incarnation, sim.now))
    back = GossipNode(me, seeds=(), rejoin=kept.peers, config=CFG, now=sim.now,
                      verify=verifier(priv.public_key()))  # no coordinator configured: learnt from the entry
    assert back.coord.restore(kept.revoked)
    assert back.coord.coordinator == trainer.id and back.coord.get("revoked") == entry
    sim.add(back)
    # A node that lost its list (a fresh one) gets it from the restarted relay alone.
    stranger = dataclasses.replace(default_member(N + 1), incarnation=1)
    lone = GossipNode(stranger, seeds=(me.address,), config=CFG, now=sim.now, verify=verifier(priv.public_key()))
    sim.add(lone)
    assert sim.rounds_until(lambda nd: nd is not lone or nd.coord.get("revoked") == entry, share=1.0,
                            max_rounds=BOUND) is not None
    assert old.members.me.incarnation < back.members.me.incarnation


def test_a_forged_or_damaged_saved_list_is_not_restored(tmp_path):
    priv = keys.generate()
    good = signer(priv)(CoordEntry("revoked", 10, "n00000", {"ids": ["bad"]}))
    forged = signer(keys.generate())(CoordEntry("revoked", 11, "n00000", {"ids": []}))
    path = saved_state.path_in(tmp_path)
    saved_state.save(path, SavedControl(3, ("https://a:1",), forged))
    kept = saved_state.load(path, verifier(priv.public_key()))
    assert kept == SavedControl(3, ("https://a:1",), None)  # the incarnation and peers stay usable
    path.write_text("{not json")
    assert saved_state.load(path, verifier(priv.public_key())) == SavedControl()
    node = GossipNode(default_member(1), config=CFG, verify=verifier(priv.public_key()))
    with pytest.raises(NotCoordinator):
        node.coord.restore(forged)
    assert node.coord.get("revoked") is None and node.coord.coordinator is None
    assert node.coord.restore(good) and node.coord.coordinator == "n00000"
