"""The coordinator's live plan follows measured figures: reported bandwidth and probe runs."""

from __future__ import annotations

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
