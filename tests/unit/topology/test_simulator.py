"""The flow simulator against closed forms, and the baselines and bounds around it."""

from __future__ import annotations

import networkx as nx
import pytest

from tests.unit.topology.helpers import G, MiB, model, node, trainer
from topology.baselines import (
    _edge_cap,
    fixed_tiers_tree,
    flow_lower_bound,
    random_tree,
    star_tree,
    tree_lower_bound,
)
from topology.simulator import max_min_rates, simulate
from topology.synthetic import synthetic_model

PAYLOAD = 64 * MiB
CHUNK = 4 * MiB
BITS = PAYLOAD * 8


def test_single_link_takes_payload_over_bandwidth():
    m = model([trainer(up=1 * G), node("a")])
    r = simulate(m, {"a": "T"}, PAYLOAD, CHUNK)
    assert r.makespan_s == pytest.approx(BITS / G, rel=1e-9)


def test_single_link_adds_the_one_way_delay():
    m = model([trainer(up=1 * G), node("a")], rtt=0.08)
    assert simulate(m, {"a": "T"}, PAYLOAD, CHUNK).makespan_s == pytest.approx(BITS / G + 0.04, rel=1e-9)


def test_star_shares_the_trainer_uplink():
    n = 6
    m = model([trainer(up=1 * G)] + [node(f"n{i}") for i in range(n)])
    r = simulate(m, star_tree(m), PAYLOAD, CHUNK)
    assert r.makespan_s == pytest.approx(n * BITS / G, rel=1e-9)
    assert all(t == pytest.approx(n * BITS / G, rel=1e-9) for x, t in r.completion_s.items() if x != "T")


def test_chain_pipelines_chunks():
    d, bw = 5, 2 * G
    nodes = [trainer(up=bw)] + [node(f"n{i}", up=bw, down=bw) for i in range(d)]
    m = model(nodes)
    parents = {"n0": "T", **{f"n{i}": f"n{i - 1}" for i in range(1, d)}}
    r = simulate(m, parents, PAYLOAD, CHUNK)
    assert r.makespan_s == pytest.approx(BITS / bw + (d - 1) * CHUNK * 8 / bw, rel=1e-9)
    # Each hop finishes exactly one chunk time after its parent.
    for i in range(1, d):
        assert r.completion_s[f"n{i}"] - r.completion_s[f"n{i - 1}"] == pytest.approx(CHUNK * 8 / bw, rel=1e-9)


def test_a_partial_last_chunk_is_forwarded_too():
    bw = 1 * G
    m = model([trainer(up=bw), node("a", up=bw), node("b")])
    payload = 10 * MiB + 123
    r = simulate(m, {"a": "T", "b": "a"}, payload, CHUNK)
    # b starts one (full) chunk after a and then streams at a's pace, the short tail included.
    assert r.makespan_s == pytest.approx(CHUNK * 8 / bw + payload * 8 / bw, rel=1e-9)


def test_slow_child_does_not_slow_its_sibling():
    # Max-min: b is capped at 0.2G by its downlink, so a gets the rest of the 1G uplink.
    m = model([trainer(up=1 * G), node("a"), node("b", down=0.2 * G)])
    r = simulate(m, star_tree(m), PAYLOAD, CHUNK)
    assert r.completion_s["b"] == pytest.approx(BITS / (0.2 * G), rel=1e-9)
    # a gets 0.8G until it is done.
    assert r.completion_s["a"] == pytest.approx(BITS / (0.8 * G), rel=1e-9)


def test_inter_region_pipe_is_shared():
    nodes = [trainer(up=10 * G), node("b1", "B"), node("b2", "B")]
    m = model(nodes, regions=("A", "B"), region_links=[("A", "B", 1 * G, 0.0, 1 * G)])
    r = simulate(m, star_tree(m), PAYLOAD, CHUNK)
    assert r.makespan_s == pytest.approx(2 * BITS / G, rel=1e-9)


def test_max_min_rates_progressive_filling():
    # Resources: 0 (cap 10) used by flows 0,1,2; 1 (cap 2) used by flow 0; flow 2 private cap 1.
    rates = max_min_rates([[0, 1], [0], [0]], [float("inf"), float("inf"), 1.0], [10.0, 2.0])
    assert rates == pytest.approx([2.0, 7.0, 1.0])


def test_bad_trees_are_rejected():
    m = model([trainer(), node("a"), node("b")])
    with pytest.raises(ValueError, match="without a parent"):
        simulate(m, {"a": "T"}, PAYLOAD, CHUNK)
    with pytest.raises(ValueError, match="cycle"):
        simulate(m, {"a": "b", "b": "a"}, PAYLOAD, CHUNK)


def test_baselines_are_trees_and_bounds_hold():
    m = synthetic_model(3, 4, seed=5)
    tree_lb = tree_lower_bound(m, PAYLOAD).completion_s
    flow_lb = flow_lower_bound(m, PAYLOAD).completion_s
    assert flow_lb <= tree_lb
    tiers = fixed_tiers_tree(m)
    assert sum(1 for p in tiers.values() if p == "trainer") == 3  # one middle server per region
    for parents in (star_tree(m), random_tree(m, seed=1), tiers):
        assert set(parents) == set(m.node_ids) - {"trainer"}
        assert simulate(m, parents, PAYLOAD, CHUNK).makespan_s >= tree_lb * (1 - 1e-9)


def test_tree_lower_bound_is_exact_on_a_chain_with_one_path():
    m = model([trainer(up=1 * G), node("a", up=0.5 * G)], rtt=0.02)
    # a direct link is the only path: payload / 1G + half the RTT.
    assert tree_lower_bound(m, PAYLOAD).completion_s == pytest.approx(BITS / G + 0.01)


def test_tree_lower_bound_is_the_exact_minimum_over_paths():
    # Measured pairs make every hop capacity distinct; brute force over every simple path.
    m = synthetic_model(2, 3, seed=3, measured_fraction=0.6)
    lb = tree_lower_bound(m, PAYLOAD)
    g = nx.complete_graph(m.node_ids, create_using=nx.DiGraph)
    for v in m.node_ids:
        if v == "trainer":
            continue
        best = min(
            BITS / min(_edge_cap(m, a, b) for a, b in zip(path, path[1:]))
            + sum(m.rtt(a, b) / 2 for a, b in zip(path, path[1:]))
            for path in nx.all_simple_paths(g, "trainer", v)
        )
        assert lb.per_node_s[v] == pytest.approx(best, rel=1e-12)
