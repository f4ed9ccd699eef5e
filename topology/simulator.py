"""Flow-level simulator of chunk-pipelined dissemination down a tree.

Model (the one the planner's estimate approximates):

- Every non-root node pulls the artifact from its parent as one flow.
- The artifact is cut into chunks of ``chunk_bytes`` (the last may be
  shorter). A node can forward a chunk once it holds all of it (cut-through
  at chunk granularity, as relays verify a chunk before serving it); the
  root holds every chunk at t = 0.
- Every byte reaches the child half an RTT (the one-way delay of the link)
  after the parent sent it; a child's request is outstanding from t = 0
  (it learned of the artifact through the control plane), so a flow runs
  whenever the parent holds bytes the child has not been sent yet.
- Concurrent flows share capacity max-min fairly. The shared resources are
  node uplinks, node downlinks and the inter-region pipes that have an
  aggregate capacity; each flow is further capped by the bandwidth of its own
  pair (``model.bandwidth``).

Between events every active flow moves at a constant rate, so the run is
exact for this model: an event is a flow finishing sending a chunk, catching
up with its parent, or a chunk arriving after its delay. The result is each
node's completion time. Cost grows with nodes x chunks; use it for up to a
few hundred nodes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from topology.model import NetworkModel
from topology.tree import depths_of


@dataclass(frozen=True)
class SimResult:
    completion_s: dict[str, float]
    """Time at which each node holds the whole artifact (root: 0)."""
    makespan_s: float
    """Time at which the last node holds it."""
    events: int


def max_min_rates(flow_resources: list[list[int]], flow_caps: list[float], capacities: list[float]) -> list[float]:
    """Max-min fair rates (progressive filling).

    ``flow_resources[f]`` lists the resources flow ``f`` crosses,
    ``capacities[r]`` is resource ``r``'s capacity (``inf`` for none) and
    ``flow_caps[f]`` a private cap for the flow. Each round, the resource (or
    private cap) with the smallest equal share fixes the rate of all the
    unfixed flows that cross it.
    """
    n = len(flow_resources)
    rate = [0.0] * n
    remaining = list(capacities)
    users: dict[int, set[int]] = {}
    for f, rs in enumerate(flow_resources):
        for r in rs:
            if math.isfinite(capacities[r]):
                users.setdefault(r, set()).add(f)
    unfixed = set(range(n))
    while unfixed:
        level = math.inf
        for r, us in users.items():
            if us:
                level = min(level, remaining[r] / len(us))
        for f in unfixed:
            level = min(level, flow_caps[f])
        if not math.isfinite(level):
            raise ValueError("a flow crosses no finite resource and has no cap")
        level = max(level, 0.0)
        tol = level * 1e-12 + 1e-12
        fix = {f for f in unfixed if flow_caps[f] <= level + tol}
        for r, us in users.items():
            if us and remaining[r] / len(us) <= level + tol:
                fix |= us
        for f in fix:
            rate[f] = level
            for r in flow_resources[f]:
                if r in users:
                    remaining[r] -= level
                    users[r].discard(f)
        unfixed -= fix
    return rate


def simulate(model: NetworkModel, parents: Mapping[str, str], payload_bytes: int, chunk_bytes: int,
             root: str | None = None) -> SimResult:
    """Run the model of the module docstring for the tree ``parents`` (child -> parent).

    ``parents`` must give every node of ``model`` other than ``root``
    (default: the trainer) a parent in the model, without cycles; otherwise
    ``ValueError``.
    """
    root = root or model.trainer
    if payload_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError("payload_bytes and chunk_bytes must be positive")
    missing = [n for n in model.node_ids if n != root and n not in parents]
    if missing:
        raise ValueError(f"nodes without a parent: {', '.join(sorted(missing)[:5])}")
    for c, p in parents.items():
        if c not in model or p not in model:
            raise ValueError(f"edge {p!r} -> {c!r} names a node outside the model")
    depths_of(parents, root)  # raises on cycles

    # Resources: 0..N-1 uplinks, N..2N-1 downlinks, then inter-region pipes with a capacity.
    ids = model.node_ids
    idx = {n: i for i, n in enumerate(ids)}
    N = len(ids)
    caps = [model.node(n).uplink_bps / 8 for n in ids] + [model.node(n).downlink_bps / 8 for n in ids]
    pipe_idx: dict[tuple[str, str], int] = {}
    children = [c for c in ids if c != root]
    flow_parent = [idx[parents[c]] for c in children]
    flow_child = [idx[c] for c in children]
    flow_res: list[list[int]] = []
    flow_cap: list[float] = []
    flow_delay: list[float] = []
    for c in children:
        p = parents[c]
        rs = [idx[p], N + idx[c]]
        a, b = model.region_of(p), model.region_of(c)
        cap = model.link_capacity(a, b)
        if cap is not None:
            if (a, b) not in pipe_idx:
                pipe_idx[(a, b)] = len(caps)
                caps.append(cap / 8)
            rs.append(pipe_idx[(a, b)])
        flow_res.append(rs)
        flow_cap.append(model.bandwidth(p, c) / 8)
        flow_delay.append(model.rtt(p, c) / 2)
    payload = float(payload_bytes)
    eps = payload * 1e-12
    sent = [0.0] * N          # bytes sent to each node so far
    held = [0.0] * N          # bytes of complete chunks that have arrived (what the node can forward)
    sent[idx[root]] = held[idx[root]] = payload
    done = {root: 0.0}
    arrivals: list[tuple[float, int, float]] = []   # (time, node, held bytes from then on)
    t = 0.0
    events = 0
    cached_key: tuple[int, ...] | None = None
    rates: list[float] = []
    sending = set(range(len(children)))
    while sending or arrivals:
        events += 1
        active = tuple(f for f in sorted(sending) if sent[flow_child[f]] < held[flow_parent[f]] - eps)
        if active != cached_key:
            rates = max_min_rates([flow_res[f] for f in active], [flow_cap[f] for f in active], caps)
            cached_key = active
        dt = math.inf
        targets = []
        for f, r in zip(active, rates):
            ci = flow_child[f]
            boundary = min(payload, (math.floor(sent[ci] / chunk_bytes + 1e-9) + 1) * chunk_bytes)
            target = min(boundary, held[flow_parent[f]])
            targets.append(target)
            if r > 0:
                dt = min(dt, (target - sent[ci]) / r)
        if arrivals:
            dt = min(dt, arrivals[0][0] - t)
        if not math.isfinite(dt):
            raise RuntimeError("simulation stalled: no active flow and nothing in flight")
        t += max(dt, 0.0)
        for f, r, target in zip(active, rates, targets):
            ci = flow_child[f]
            before = sent[ci]
            sent[ci] += r * dt
            if sent[ci] >= target - eps:
                sent[ci] = target
            whole = math.floor(sent[ci] / chunk_bytes + 1e-9) * chunk_bytes
            complete = payload if sent[ci] >= payload - eps else min(payload, whole)
            if complete > math.floor(before / chunk_bytes + 1e-9) * chunk_bytes or complete == payload > before:
                heapq.heappush(arrivals, (t + flow_delay[f], ci, complete))
            if sent[ci] >= payload:
                sending.discard(f)
        while arrivals and arrivals[0][0] <= t + 1e-12:
            _, ci, amount = heapq.heappop(arrivals)
            held[ci] = max(held[ci], amount)
            if held[ci] >= payload:
                done[ids[ci]] = t
    return SimResult(done, max(done.values()), events)
