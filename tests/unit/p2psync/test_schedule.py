"""Scheduler: staleness bound, class preference, longest-first on the fastest nodes, and
the simulated comparison with round-robin and FIFO. Pure functions, seeded."""

from __future__ import annotations

from p2psync.lease import QueuedWork
from p2psync.schedule import (
    Ewma, FifoScheduler, LengthPredictor, NodeView, RoundRobinScheduler, Scheduler, Workload, default_cluster,
    simulate,
)


def _q(*ids: str, done: int = 0) -> list[QueuedWork]:
    return [QueuedWork(i, i, done, 0) for i in ids]


def test_staleness_bound_is_respected():
    nodes = [NodeView("old", "reserved", 4000, 2, version=3), NodeView("ok", "preemptible", 1000, 2, version=4)]
    for s in (Scheduler(max_staleness=1), FifoScheduler(max_staleness=1), RoundRobinScheduler(max_staleness=1)):
        out = s.assign(0.0, _q("a", "b", "c", "d"), nodes, head=5)
        assert out and all(n == "ok" for _, n in out), (s.name, out)
    assert "old" in {n for _, n in Scheduler(max_staleness=2).assign(0.0, _q("a", "b", "c"), nodes, head=5)}


def test_stale_node_gets_work_only_once_its_version_arrives():
    nodes = [NodeView("late", "reserved", 4000, 1, version=0, ready_at=5.0)]
    assert Scheduler().assign(0.0, _q("a"), nodes, head=1) == []
    assert Scheduler().assign(5.0, _q("a"), [NodeView("late", "reserved", 4000, 1, version=1)], head=1) == [("a", "late")]


def test_reserved_nodes_are_kept_busy_first():
    nodes = [NodeView("spot", "preemptible", 1000, 2), NodeView("res", "reserved", 1000, 2)]
    out = Scheduler().assign(0.0, _q("a", "b"), nodes, head=0)
    assert sorted(n for _, n in out) == ["res", "res"]
    # The surplus goes to the preemptible node.
    out = Scheduler().assign(0.0, _q("a", "b", "c", "d"), nodes, head=0)
    assert sorted(n for _, n in out) == ["res", "res", "spot", "spot"]


def test_longest_predicted_work_goes_first_to_the_fastest_node():
    pred = LengthPredictor()
    for key, tokens in (("long", 8000), ("s1", 100), ("s2", 100)):
        pred.observe(key, tokens)
    nodes = [NodeView("slow", "reserved", 500, 1), NodeView("fast", "reserved", 5000, 1)]
    out = dict(Scheduler(pred).assign(0.0, _q("s1", "long", "s2"), nodes, head=0))
    assert out["long"] == "fast" and list(out.values()).count("slow") == 1


def test_bandwidth_late_node_gets_work_it_finishes_before_going_stale():
    pred = LengthPredictor()
    for key, tokens in (("long", 20000), ("short", 500)):
        pred.observe(key, tokens)
    nodes = [NodeView("wan", "reserved", 1000, 1, stale_at=10.0, ready_at=60.0),
             NodeView("lan", "reserved", 1000, 1, busy_until=(1.0,))]
    out = dict(Scheduler(pred).assign(0.0, _q("long", "short"), nodes, head=0))
    assert out == {"short": "wan"}  # the long one waits a second for the LAN node


def test_partial_progress_shortens_the_prediction():
    pred = LengthPredictor()
    pred.observe("a", 1000)
    pred.observe("b", 900)
    nodes = [NodeView("fast", "reserved", 5000, 1), NodeView("slow", "reserved", 500, 1)]
    out = dict(Scheduler(pred).assign(0.0, [QueuedWork("a", "a", 950, 1), QueuedWork("b", "b", 0, 0)], nodes, 0))
    assert out["b"] == "fast"


def test_ewma_smooths():
    e = Ewma(0.5)
    e.update("n", 100.0)
    assert e.update("n", 200.0) == 150.0 and e.get("x", 7.0) == 7.0


def test_scheduler_beats_round_robin_on_a_long_tail_workload():
    work = Workload(steps=6)
    cluster = default_cluster(0)
    ours = simulate(Scheduler(), cluster, work, seed=1)
    rr = simulate(RoundRobinScheduler(), cluster, work, seed=1)
    fifo = simulate(FifoScheduler(), cluster, work, seed=1)
    assert ours.tokens == rr.tokens == fifo.tokens  # same samples, simulated time differs
    assert ours.throughput >= 1.3 * rr.throughput
    assert ours.throughput >= fifo.throughput
