"""Trees to compare the planner with, and lower bounds on the completion time.

Baselines (each a child -> parent map rooted at the trainer):

- :func:`star_tree`: every node pulls from the trainer.
- :func:`random_tree`: nodes join in random order under a random node that
  already holds a place (degree-limited), blind to bandwidth.
- :func:`fixed_tiers_tree`: one fixed middle server per region (the first
  ``relay`` of the region, else its first machine by id) pulls from the
  trainer and serves every other machine of its region, as shardcast-style
  deployments are set up by hand.

Lower bounds, in the simulator's model (see :mod:`topology.simulator`), for
the time until the last node holds the artifact:

- :func:`tree_lower_bound`: in a tree each node gets everything over one
  path from the trainer, so no tree beats, for any node v, the minimum over
  paths P of ``payload / bottleneck(P) + delay(P)``: each hop capped by pair
  bandwidth, sender uplink, receiver downlink and inter-region pipe, each
  hop delaying every byte by half its RTT. Sharing is ignored, so the bound
  is optimistic wherever paths must share a link.
- :func:`flow_lower_bound`: no scheme at all (striping chunks over several
  parents included) beats ``payload / min(maxflow(v), downlink(v)) +
  delay(v)``, with ``delay(v)`` the smallest delay over paths and
  ``maxflow(v)`` the max-flow from the trainer to v's region in a relaxed
  graph of regions (capacity inside a region unlimited, so the bound stays
  valid). It is the one to quote when asking what multi-parent striping
  could gain.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import networkx as nx

from topology.model import NetworkModel


def star_tree(model: NetworkModel) -> dict[str, str]:
    return {n: model.trainer for n in model.node_ids if n != model.trainer}


def random_tree(model: NetworkModel, seed: int = 0, max_degree: int | None = 8) -> dict[str, str]:
    rng = random.Random(seed)
    others = sorted(n for n in model.node_ids if n != model.trainer)
    rng.shuffle(others)
    placed = [model.trainer]
    degree = {model.trainer: 0}
    parents = {}
    for n in others:
        open_ = [p for p in placed if max_degree is None or degree[p] < max_degree]
        p = rng.choice(open_)
        parents[n] = p
        degree[p] += 1
        degree[n] = 0
        placed.append(n)
    return parents


def fixed_tiers_tree(model: NetworkModel) -> dict[str, str]:
    parents = {}
    for region, ids in model.by_region().items():
        machines = sorted(n for n in ids if n != model.trainer)
        if not machines:
            continue
        relays = [n for n in machines if model.node(n).role == "relay"]
        middle = (relays or machines)[0]
        parents[middle] = model.trainer
        for n in machines:
            if n != middle:
                parents[n] = middle
    return parents


@dataclass(frozen=True)
class LowerBound:
    completion_s: float
    """The bound on the time until the last node holds the artifact."""
    per_node_s: dict[str, float]
    bottleneck_bps: dict[str, float]
    """The rate each node cannot exceed under this bound."""


def _edge_cap(model: NetworkModel, u: str, v: str) -> float:
    su, sv = model.node(u), model.node(v)
    c = min(model.bandwidth(u, v), su.uplink_bps, sv.downlink_bps)
    cap = model.link_capacity(su.region, sv.region)
    return c if cap is None else min(c, cap)


def _delay_paths(model: NetworkModel) -> dict[str, float]:
    """A lower bound on the one-way delay (half-RTT sum) from the trainer to every node, from regions.

    Dijkstra over the regions: a hop from region a to b costs the least half-RTT of any pair from
    a to b (the region figure, or a measured pair below it); passing through a region is free (a
    path may leave from the machine it entered by). Without measurements this is the exact
    shortest delay over node paths (an intra-region hop only adds delay, so shortest paths use
    none, except into the trainer's own region); with them it is never above it. Cost: regions
    squared plus the measured pairs, so it serves 100,000 nodes.
    """
    t = model.trainer
    names = model.region_names()
    w = {(a, b): model.region_rtt(a, b) / 2 for a in names for b in names}
    for m in model.measurements():
        key = (model.region_of(m.src), model.region_of(m.dst))
        w[key] = min(w[key], m.rtt_s / 2)
    home = model.region_of(t)
    dist = {home: 0.0}
    heap = [(0.0, home)]
    while heap:
        d, a = heapq.heappop(heap)
        if d > dist.get(a, math.inf):
            continue
        for b in names:
            if b != a and d + w[(a, b)] < dist.get(b, math.inf):
                dist[b] = d + w[(a, b)]
                heapq.heappush(heap, (dist[b], b))
    # A machine of the trainer's region: one hop inside it, or out and back.
    back = min([w[(home, home)]] + [dist[b] + w[(b, home)] for b in names if b != home])
    return {n: (0.0 if n == t else back if model.region_of(n) == home else dist[model.region_of(n)])
            for n in model.node_ids}


def tree_lower_bound(model: NetworkModel, payload_bytes: int) -> LowerBound:
    """See the module docstring. Exact; about O(labels x n^2): meant for up to a few thousand nodes.

    A path is summed up by a label (delay so far, bottleneck so far). Labels
    are settled in order of increasing delay (Dijkstra), and a node keeps a
    label only if its bottleneck beats every label it settled before (which
    all had no more delay), so each node keeps the Pareto front of
    (delay, bottleneck) over all its paths from the trainer, and the best of
    ``payload / bottleneck + delay`` over that front is the exact minimum over
    paths. (An earlier version bucketed the bottleneck values into 64
    thresholds and charged each bucket at its upper end: still a bound, but
    up to 6 % too optimistic once measured pairs made the values distinct.)
    """
    if not model.measurements():
        return _tree_lower_bound_by_region(model, payload_bytes)
    ids = model.node_ids
    t = model.trainer
    others = [v for v in ids if v != t]
    cap = {u: [(v, _edge_cap(model, u, v), model.rtt(u, v) / 2) for v in others if v != u] for u in ids}
    bits = payload_bytes * 8.0
    best = {n: math.inf for n in others}
    rate = {n: 0.0 for n in others}
    kept: dict[str, float] = {}
    heap: list[tuple[float, float, str]] = [(0.0, -math.inf, t)]
    while heap:
        d, nb, u = heapq.heappop(heap)
        b = -nb
        if b <= kept.get(u, 0.0):
            continue  # a label with no more delay already had at least this bottleneck
        kept[u] = b
        if u != t and bits / b + d < best[u]:
            best[u] = bits / b + d
            rate[u] = b
        for v, c, half_rtt in cap[u]:
            nb2 = min(b, c)
            if nb2 > kept.get(v, 0.0):
                heapq.heappush(heap, (d + half_rtt, -nb2, v))
    per = {t: 0.0, **best}
    return LowerBound(max(per.values()), per, rate)


def _tree_lower_bound_by_region(model: NetworkModel, payload_bytes: int) -> LowerBound:
    """:func:`tree_lower_bound` when no pair is measured, over regions instead of nodes (same value).

    Without measurements a hop ``u -> v`` is capped by ``min(up(u), down(v))`` and the figures of
    its two regions, so a best path enters each region it crosses through the machine with the
    largest ``min(uplink, downlink)`` and reaches ``v`` directly from the region before (an extra
    hop inside a region only lowers the bottleneck and adds delay). The same Pareto label search
    then runs over regions, and each node is scored by its region and downlink.
    """
    t = model.trainer
    bits = payload_bytes * 8.0
    names = model.region_names()
    home = model.region_of(t)
    through = {r: max((min(model.node(n).uplink_bps, model.node(n).downlink_bps) for n in ids if n != t), default=0.0)
               for r, ids in model.by_region().items()}

    def hop(a: str, b: str) -> float:
        cap = model.link_capacity(a, b)
        bw = model.region_bandwidth(a, b)
        return bw if cap is None else min(bw, cap)

    # Labels (delay, bottleneck) ready to send out of a region; the trainer's own is its uplink.
    fronts: dict[str, list[tuple[float, float]]] = {r: [] for r in names}
    kept: dict[str, float] = {}
    heap: list[tuple[float, float, str, bool]] = [(0.0, -model.node(t).uplink_bps, home, True)]
    labels: list[tuple[str, float, float]] = []
    while heap:
        d, nb, a, at_trainer = heapq.heappop(heap)
        b = -nb
        if not at_trainer:
            if b <= kept.get(a, 0.0):
                continue
            kept[a] = b
        labels.append((a, d, b))
        for c in names:
            if c == a:
                continue
            nb2 = min(b, hop(a, c), through.get(c, 0.0))
            if nb2 > kept.get(c, 0.0):
                heapq.heappush(heap, (d + model.region_rtt(a, c) / 2, -nb2, c, False))
    per: dict[str, float] = {t: 0.0}
    rate: dict[str, float] = {}
    memo: dict[tuple[str, float], tuple[float, float]] = {}
    for v in model.node_ids:
        if v == t:
            continue
        r, down = model.region_of(v), model.node(v).downlink_bps
        got = memo.get((r, down))
        if got is None:
            got = (math.inf, 0.0)
            for a, d, b in labels:
                x = min(b, hop(a, r), down)
                if x > 0 and bits / x + d + model.region_rtt(a, r) / 2 < got[0]:
                    got = (bits / x + d + model.region_rtt(a, r) / 2, x)
            memo[(r, down)] = got
        per[v], rate[v] = got
    return LowerBound(max(per.values()), per, rate)


def flow_lower_bound(model: NetworkModel, payload_bytes: int) -> LowerBound:
    """See the module docstring."""
    g = nx.DiGraph()
    t = model.trainer
    root_region = model.region_of(t)
    by_region = model.by_region()
    up_sum = {r: sum(model.node(n).uplink_bps for n in ids if n != t) for r, ids in by_region.items()}
    # The trainer's uplink feeds its own region and, directly, the pipes out of it.
    g.add_edge("T", "T:up", capacity=model.node(t).uplink_bps)
    g.add_edge("T:up", f"in:{root_region}")
    g.add_edge("T:up", f"out:{root_region}")
    for r in by_region:
        # Traffic leaving a region goes out through its machines' uplinks (the trainer's own
        # uplink is the edge above, so it is not counted twice).
        g.add_edge(f"in:{r}", f"out:{r}", capacity=up_sum[r])
    for a in by_region:
        for b in by_region:
            if a != b:
                cap = model.link_capacity(a, b)
                g.add_edge(f"out:{a}", f"in:{b}", capacity=up_sum[a] if cap is None else cap)
    flow = {r: nx.maximum_flow_value(g, "T", f"in:{r}") for r in by_region}
    lat = _delay_paths(model)
    rate = {n: min(flow[model.region_of(n)], model.node(n).downlink_bps) for n in model.node_ids if n != t}
    rate[t] = math.inf
    return _bound(model, payload_bytes, rate, lat)


def _bound(model: NetworkModel, payload_bytes: int, rate: dict[str, float], lat: dict[str, float]) -> LowerBound:
    bits = payload_bytes * 8.0
    per = {}
    for n in model.node_ids:
        if n == model.trainer:
            per[n] = 0.0
        else:
            per[n] = lat[n] + (bits / rate[n] if rate.get(n, 0.0) > 0 else math.inf)
    return LowerBound(max(per.values()), per, {n: r for n, r in rate.items() if n != model.trainer})
