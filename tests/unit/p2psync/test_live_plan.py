"""The coordinator's live plan follows measured figures: reported bandwidth and probe runs."""

from __future__ import annotations

import pytest

from p2psync.control.live_plan import LivePlanner, PlanMember
from topology.model import Measurement, NetworkModel, NodeSpec, Region
from topology.fallbacks import moved_nodes
from topology.tree import estimate

GBPS = 1.25e8  # bytes/s in one Gbit/s


def _members(relay_bw: dict[str, float] | None = None) -> list[PlanMember]:
    relay_bw = relay_bw or {}
    out = [PlanMember("trainer", "trainer", "r0", 10 * GBPS)]
    out += [PlanMember(f"relay-{i}", "relay", "r0", relay_bw.get(f"relay-{i}", 10 * GBPS)) for i in range(2)]
    out += [PlanMember(f"x{i:02d}", "rollout", "r0", 1 * GBPS) for i in range(14)]
    return out


def _etas(lp: LivePlanner, parents: dict[str, str], members: list[PlanMember]) -> dict[str, float]:
    cfg = lp.config
    return estimate(lp.model(members), "trainer", parents, cfg.payload_bytes, cfg.chunk_bytes).eta_s


def test_a_low_reported_rate_never_shrinks_a_node_and_a_high_one_raises_it():
    """A reported rate is what a node happened to receive: an idle relay reports little, and must not be
    planned out of the tree for it (that once turned a live plan into a six-deep chain)."""
    lp = LivePlanner("trainer")
    p0 = lp.update(_members())
    busy = [r for r in ("relay-0", "relay-1") if p0.children().get(r)]
    assert busy, "relays carry the rollout nodes while their figures are good"
    idle = _members({busy[0]: 0.008 * GBPS})  # 8 Mbit/s received in the last gossip interval
    assert lp.model(idle).node(busy[0]).downlink_bps == 10e9
    assert lp.update(idle) is None  # nothing moves
    # A rollout node measured receiving at 8 Gbit/s is planned with that downlink (8x its default).
    fast = [PlanMember(m.id, m.role, m.region, 8 * GBPS if m.id == "x00" else m.bandwidth) for m in _members()]
    assert lp.model(fast).node("x00").downlink_bps == 8e9


def test_without_reports_the_plan_stands_on_role_defaults():
    lp = LivePlanner("trainer")
    silent = [PlanMember(m.id, m.role, m.region) for m in _members()]
    p0 = lp.update(silent)
    assert lp.model(silent).node("relay-0").uplink_bps == 10e9
    assert lp.model(silent).node("x00").uplink_bps == 1e9
    assert any(p0.children().get(r) for r in ("relay-0", "relay-1"))
    assert lp.update(silent) is None


def test_probe_figures_replace_role_defaults():
    lp = LivePlanner("trainer")
    members = [PlanMember(m.id, m.role, m.region) for m in _members()]
    p0 = lp.update(members)
    # The probe run found both relays behind 50 Mbit/s uplinks, and the rollout nodes on 10 Gbit/s.
    specs = [NodeSpec("trainer", "r0", "trainer", 10e9, 10e9)]
    specs += [NodeSpec(f"relay-{i}", "r0", "relay", 0.05e9, 10e9) for i in range(2)]
    specs += [NodeSpec(f"x{i:02d}", "r0", "rollout", 10e9, 10e9) for i in range(14)]
    probed = NetworkModel(specs, [Measurement("x00", "x01", 9e9, 0.0003)], [Region("r0", 10e9, 0.0005)])
    lp.use_measurements(probed)
    assert lp.model(members).node("relay-0").uplink_bps == 0.05e9
    assert lp.model(members).bandwidth("x00", "x01") == 9e9  # the measured pair
    p1 = lp.update(members)
    assert p1 is not None and p1.epoch == p0.epoch + 1
    assert not p1.children().get("relay-0") and not p1.children().get("relay-1")
    assert lp.update(members) is None


def test_a_reported_rate_above_the_probe_raises_the_downlink():
    lp = LivePlanner("trainer")
    specs = [NodeSpec("trainer", "r0", "trainer", 10e9, 10e9), NodeSpec("a", "r0", "rollout", 2e9, 3e9)]
    lp.use_measurements(NetworkModel(specs))
    m = lp.model([PlanMember("trainer", "trainer", "r0"), PlanMember("a", "rollout", "r0", 0.5 * GBPS),
                  PlanMember("b", "rollout", "r0")])
    assert (m.node("a").uplink_bps, m.node("a").downlink_bps) == (2e9, 3e9)  # a lower report: the probe stands
    m = lp.model([PlanMember("trainer", "trainer", "r0"), PlanMember("a", "rollout", "r0", 0.5 * GBPS * 12),
                  PlanMember("b", "rollout", "r0")])
    assert (m.node("a").uplink_bps, m.node("a").downlink_bps) == (2e9, 6e9)  # a higher one raises it
    assert (m.node("b").uplink_bps, m.node("b").downlink_bps) == (1e9, 1e9)  # not probed: role default


# ---- the incremental path: membership and link events re-plan through topology.incremental ----------

def _fleet(regions: int = 3, per: int = 12) -> list[PlanMember]:
    out = [PlanMember("trainer", "trainer", "r0")]
    out += [PlanMember(f"r{r}-relay", "relay", f"r{r}") for r in range(regions)]
    out += [PlanMember(f"r{r}-x{i:02d}", "rollout", f"r{r}") for r in range(regions) for i in range(per)]
    return out


def test_a_failure_moves_only_the_orphans_as_the_incremental_replanner_places_them(monkeypatch):
    from p2psync.control import live_plan
    from topology.incremental import Replanner

    lp = LivePlanner("trainer")
    members = _fleet()
    p0 = lp.update(members)
    ch = p0.children()
    victim = max((n for n in p0.parents if ch[n]), key=lambda n: (len(ch[n]), n))
    expected = Replanner(p0, lp.model_used, lp.config).fail(victim)

    def whole(*a, **k):
        raise AssertionError("a membership change must not re-plan the whole tree")

    monkeypatch.setattr(live_plan, "plan", whole)
    monkeypatch.setattr(live_plan, "replan", whole)
    p1 = lp.update([m for m in members if m.id != victim])
    assert p1 is not None and p1.parents == expected.plan.parents
    assert lp.last_moved == expected.moved and lp.last_moved <= set(ch[victim])
    assert {n for n, p in p1.parents.items() if p0.parents[n] != p} == lp.last_moved


def test_a_join_moves_nobody_and_a_region_cut_off_moves_only_what_it_fed():
    lp = LivePlanner("trainer")
    members = _fleet()
    p0 = lp.update(members)
    p1 = lp.update([*members, PlanMember("r1-new", "rollout", "r1")])
    assert p1 is not None and lp.last_moved == frozenset()
    assert all(p1.parents[n] == p for n, p in p0.parents.items()) and p1.regions[p1.parents["r1-new"]] == "r1"
    alive = [m for m in [*members, PlanMember("r1-new", "rollout", "r1")] if m.region != "r2"]
    p2 = lp.update(alive)
    assert p2 is not None and not any(p2.regions.get(n) == "r2" for n in p2.parents)
    fed = {c for c, x in p1.parents.items() if p1.regions[x] == "r2" and p1.regions[c] != "r2"}
    assert lp.last_moved <= fed
    assert lp.update(alive) is None  # nothing changed: no new plan


def test_a_measured_link_moves_only_the_child_of_that_edge():
    lp = LivePlanner("trainer")
    members = _fleet()
    p0 = lp.update(members)
    ch = p0.children()
    child = next(c for c, x in p0.parents.items() if x != "trainer" and p0.regions[c] == p0.regions[x] and ch[c])
    quiet = next(n for n in p0.parents if n not in (child, p0.parents[child]))
    assert lp.link_measured(quiet, child, 5e9, 0.001) is None and lp.plan.parents == p0.parents
    p1 = lp.link_measured(p0.parents[child], child, 1e6, 0.001)
    assert p1 is not None and lp.last_moved == frozenset({child}) and p1.parents[child] != p0.parents[child]
    assert lp.model(members).bandwidth(p0.parents[child], child) == 1e6  # kept for later models
    with pytest.raises(ValueError):
        lp.link_measured("nobody", child, 1e9, 0.001)


def test_the_periodic_full_plan_keeps_an_unchanged_tree_bit_for_bit_and_repairs_a_worn_one():
    lp = LivePlanner("trainer", full_every_s=60.0)
    members = _fleet()
    p0 = lp.update(members, now=0.0)
    assert lp.update(members, now=30.0) is None and lp.update(members, now=61.0) is None
    assert lp.plan.parents == p0.parents and lp.plan.eta_s == p0.eta_s
    # Relays fail one after the other: the repairs keep everyone else in place, then the full plan
    # (taken only when it beats the repaired tree by min_gain) may move more.
    alive = [m for m in members if m.role != "relay"]
    worn = lp.update(alive, now=62.0)
    assert worn is not None
    fresh = lp.update(alive, now=200.0)
    if fresh is not None:
        assert fresh.est_completion_s < worn.est_completion_s
        assert lp.last_moved == {n for n, p in fresh.parents.items() if worn.parents[n] != p}
