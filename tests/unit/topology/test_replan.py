"""Re-planning after a failure, a departure or a join moves as few nodes as it can."""

from __future__ import annotations

from tests.unit.topology.helpers import G
from topology.model import NodeSpec
from topology.fallbacks import moved_nodes
from topology.planner import PlannerConfig, plan
from topology.replan import replan
from topology.synthetic import synthetic_model

CFG = PlannerConfig()


def _busiest(p):
    ch = p.children()
    return max(p.parents, key=lambda n: (len(ch[n]), n))


def test_a_leaf_leaving_moves_nobody():
    m = synthetic_model(4, 8, seed=1)
    p = plan(m, CFG)
    ch = p.children()
    leaf = next(n for n in p.parents if not ch[n])
    q = replan(p, m.without_nodes([leaf]), CFG)
    assert moved_nodes(p, q) == []
    assert q.epoch == p.epoch + 1 and leaf not in q.parents


def test_a_failed_relay_moves_only_its_children():
    m = synthetic_model(4, 8, seed=1)
    p = plan(m, CFG)
    victim = _busiest(p)
    orphans = set(p.children()[victim])
    q = replan(p, m.without_nodes([victim]), CFG)
    assert set(moved_nodes(p, q)) <= orphans
    assert set(q.parents) == set(p.parents) - {victim}
    q.depths()  # a tree again
    # A region entry's strongest orphan takes its place, the others stay below it.
    assert q.parents.get(p.parents[victim]) != victim
    assert q.est_completion_s <= p.est_completion_s * 1.2


def test_an_entry_failure_promotes_an_orphan_into_its_place():
    m = synthetic_model(4, 8, seed=3)
    p = plan(m, CFG)
    entry = next(c for c, q in p.parents.items() if p.regions[c] == "r02" and p.regions[q] != "r02")
    q = replan(p, m.without_nodes([entry]), CFG)
    new_entries = [c for c, x in q.parents.items() if q.regions[c] == "r02" and q.regions[x] != "r02"]
    assert len(new_entries) == 1
    assert new_entries[0] in p.children()[entry]


def test_joiners_attach_without_moving_anyone():
    m = synthetic_model(3, 6, seed=2)
    p = plan(m, CFG)
    grown = m.with_nodes([NodeSpec("new-a", "r01", "rollout", 10 * G, 10 * G),
                          NodeSpec("new-b", "r09", "rollout", 10 * G, 10 * G)])
    q = replan(p, grown, CFG, rebuild_factor=None)
    assert moved_nodes(p, q) == []
    assert q.regions[q.parents["new-a"]] == "r01"
    assert q.parents["new-b"] != "trainer"  # the trainer's uplink is the last resort


def test_few_moves_at_scale():
    m = synthetic_model(10, 100, seed=0)
    p = plan(m, CFG)
    victim = _busiest(p)
    q = replan(p, m.without_nodes([victim]), CFG)
    assert len(moved_nodes(p, q)) <= 0.05 * len(q.parents)


def test_a_wave_of_joiners_enters_a_new_region_through_its_strongest_node():
    # The trainer alone, then a region's relay and rollout nodes join at once (a cluster starting):
    # every one of them gets the same offer from the trainer (the default cross-region rate caps it),
    # so the tie goes to the joiner with the most uplink, the relay, whatever the names say.
    from topology.model import NetworkModel

    alone = NetworkModel([NodeSpec("trainer", "r0", "trainer", 10 * G, 10 * G)])
    p = plan(alone, CFG)
    grown = alone.with_nodes([NodeSpec("r1-relay1", "r1", "relay", 10 * G, 10 * G),
                              NodeSpec("r1-rollout1", "r1", "rollout", 1 * G, 10 * G),
                              NodeSpec("r1-rollout2", "r1", "rollout", 1 * G, 10 * G)])
    q = replan(p, grown, CFG, rebuild_factor=None)
    entries = [c for c, x in q.parents.items() if q.regions[c] == "r1" and q.regions[x] != "r1"]
    assert entries == ["r1-relay1"]
    assert q.parents["r1-rollout1"] == q.parents["r1-rollout2"] == "r1-relay1"
