"""Which pairs a probe run measures and how it schedules them (pure: topology.probeplan)."""

from __future__ import annotations

import itertools

import pytest

from topology.errors import ModelError
from topology.model import Measurement, model_from_measurements
from topology.probeplan import Member, choose_pairs, node_specs, rounds_lower_bound, schedule_rounds


def fleet(regions: int, per_region: int, relays: int = 1) -> list[Member]:
    out = [Member("T", "r00", "trainer")]
    for r in range(regions):
        for j in range(per_region):
            out.append(Member(f"r{r:02d}-n{j:03d}", f"r{r:02d}", "relay" if j < relays else "rollout"))
    return out


def test_small_regions_measure_every_ordered_pair():
    ms = fleet(2, 2)  # r00: T + 2 nodes, r01: 2 nodes
    pairs = set(choose_pairs(ms, intra_peers=3, representatives_per_region=1))
    r00 = ["T", "r00-n000", "r00-n001"]
    assert {(a, b) for a, b in itertools.permutations(r00, 2) if b != "T"} <= pairs
    assert not any(d == "T" for _, d in pairs)  # the root never pulls: nothing measures into it
    assert {("r01-n000", "r01-n001"), ("r01-n001", "r01-n000")} <= pairs


def test_large_fleet_is_sampled_but_every_node_has_in_and_out_figures():
    ms = fleet(5, 40)
    region = {m.id: m.region for m in ms}
    pairs = choose_pairs(ms, intra_peers=3, representatives_per_region=2, seed=7)
    assert len(pairs) == len(set(pairs))
    n = len(ms)
    assert len(pairs) < n * 4 + 5 * 4 * 2 + 2 * 4 + 1, len(pairs)  # far below n (n-1) = 40,200
    for m in ms:
        assert sum(1 for _, d in pairs if d == m.id) >= (3 if m.id != "T" else 0), m.id
        assert sum(1 for s, _ in pairs if s == m.id) >= 3, m.id
    intra = [(a, b) for a, b in pairs if region[a] == region[b]]
    assert all(a != b for a, b in intra)
    # Every ordered region pair is measured, and the trainer reaches each foreign representative.
    regions = sorted(set(region.values()))
    cross = {(region[a], region[b]) for a, b in pairs if region[a] != region[b]}
    assert cross == {(a, b) for a in regions for b in regions if a != b}
    for r in regions[1:]:
        assert any(s == "T" and region[d] == r for s, d in pairs), r


def test_representatives_prefer_the_trainer_then_relays():
    ms = fleet(3, 5, relays=2)
    pairs = choose_pairs(ms, intra_peers=2, representatives_per_region=2, seed=3)
    region = {m.id: m.region for m in ms}
    crossing = {x for p in pairs if region[p[0]] != region[p[1]] for x in p}
    assert "T" in crossing
    for m in ms:
        if m.id in crossing and m.id != "T":
            assert m.role == "relay", m  # 2 reps per region: T + 1 relay in r00, 2 relays elsewhere


def test_same_seed_same_pairs():
    ms = fleet(3, 10)
    assert choose_pairs(ms, seed=1) == choose_pairs(ms, seed=1)
    assert choose_pairs(ms, seed=1) != choose_pairs(ms, seed=2)


@pytest.mark.parametrize("regions,per", [(1, 6), (4, 8), (20, 30)])
def test_rounds_share_no_node_and_no_region_pipe(regions, per):
    ms = fleet(regions, per)
    region = {m.id: m.region for m in ms}
    pairs = choose_pairs(ms, seed=regions)
    rounds = schedule_rounds(pairs, region)
    flat = [p for r in rounds for p in r]
    assert sorted(flat) == sorted(pairs)  # every pair exactly once
    for r in rounds:
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes))
        pipes = [(region[a], region[b]) for a, b in r if region[a] != region[b]]
        assert len(pipes) == len(set(pipes))
    lb = rounds_lower_bound(pairs, region)
    assert lb <= len(rounds) <= 2 * lb


def test_bad_fleets_are_config_errors():
    with pytest.raises(ModelError, match="exactly one node must have role 'trainer'"):
        choose_pairs([Member("a", "r", "rollout"), Member("b", "r", "rollout")])
    with pytest.raises(ModelError, match="duplicate node id"):
        choose_pairs([Member("T", "r", "trainer"), Member("T", "r", "rollout")])
    with pytest.raises(ModelError, match="intra_peers"):
        choose_pairs(fleet(1, 2), intra_peers=0)


def test_node_specs_take_the_best_flow_seen_each_way():
    ms = [Member("T", "a", "trainer"), Member("x", "a", "rollout"), Member("y", "b", "rollout"),
          Member("z", "b", "rollout")]
    meas = [Measurement("T", "x", 400e6, 0.001), Measurement("T", "y", 100e6, 0.05),
            Measurement("x", "T", 900e6, 0.001), Measurement("y", "x", 50e6, 0.05)]
    specs = {s.id: s for s in node_specs(ms, meas)}
    assert specs["T"].uplink_bps == 400e6 and specs["T"].downlink_bps == 900e6
    assert specs["x"].uplink_bps == 900e6 and specs["x"].downlink_bps == 400e6
    assert specs["y"].uplink_bps == 50e6 and specs["y"].downlink_bps == 100e6
    assert specs["z"].uplink_bps == specs["z"].downlink_bps == pytest.approx(250e6)  # median of all figures
    model = model_from_measurements(specs.values(), meas)
    assert model.bandwidth("T", "x") == 400e6 and model.is_measured("T", "x")
    # An unmeasured pair is estimated from the region pair's median, capped by the two ends.
    assert model.bandwidth("T", "z") == pytest.approx(min(100e6, specs["z"].downlink_bps))
