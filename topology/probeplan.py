"""Which node pairs a probe run measures, in which rounds, and the node capacities the figures imply.

Pure: no sockets, no clocks (the I/O is :mod:`p2psync.probe.run`).

Pairs. Measuring all ordered pairs costs ``n (n - 1)`` downloads; the planner
needs far fewer, because :func:`topology.model.model_from_measurements`
estimates every unmeasured pair from the median of its region pair. So a run
measures, as ordered pairs ``(src, dst)`` (``dst`` pulls from ``src``):

- inside each region, every node pulls from ``intra_peers`` others and serves
  ``intra_peers`` others (a seeded ring over a shuffled order; all pairs when the
  region is that small), so every node has an in and an out figure; the
  trainer serves ``intra_peers`` nodes of its region;
- across regions, ``representatives`` per region (the trainer first in its
  region, then relays, then the rest in seeded order) pull from the
  representatives of every other region, rep ``j`` of A -> rep ``j`` of B;
- the trainer serves every representative of every other region (its uplink
  is what the plan depends on most);
- nobody serves the trainer: it is the root and never pulls, so pairs into it
  are skipped (in its region, the other representatives receive instead).

Rounds. Pairs measured at the same time must not disturb each other:
:func:`schedule_rounds` puts each pair into the first round in which neither
of its nodes is busy and, for a pair across regions, no other pair uses the
same directed region pipe (which may be one shared WAN link). Pairs of one
round run in parallel; rounds run one after the other.

Capacities. A probe measures one flow at a time; :func:`node_specs` takes a
node's uplink as the best flow measured out of it and its downlink as the
best flow into it (a lower bound on the real capacity, never above what was
seen), falling back to the other direction and then to the median of all
measurements.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from topology.errors import ModelError
from topology.model import ROLES, Measurement, NodeSpec

Pair = tuple[str, str]


@dataclass(frozen=True)
class Member:
    """What a probe run knows of a node before measuring: its identity (from ``GET /v1/status``)."""

    id: str
    region: str
    role: str


def _check(members: Sequence[Member]) -> None:
    seen: set[str] = set()
    for i, m in enumerate(members):
        if not m.id:
            raise ModelError(f"nodes[{i}].id", "must be non-empty")
        if m.id in seen:
            raise ModelError(f"nodes[{i}].id", f"duplicate node id {m.id!r}")
        if m.role not in ROLES:
            raise ModelError(f"nodes[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
        seen.add(m.id)
    trainers = [m.id for m in members if m.role == "trainer"]
    if len(trainers) != 1:
        raise ModelError("nodes", f"exactly one node must have role 'trainer', found {len(trainers)}")


def representatives(members: Sequence[Member], count: int, seed: int = 0) -> dict[str, list[str]]:
    """Region -> up to ``count`` node ids that measure across regions (trainer, then relays, then others)."""
    by_region: dict[str, list[Member]] = {}
    for m in members:
        by_region.setdefault(m.region, []).append(m)
    out = {}
    for region, ms in by_region.items():
        rng = random.Random(f"reps:{seed}:{region}")  # per region: leaving one node out changes only its region
        order = sorted(ms, key=lambda m: m.id)
        rng.shuffle(order)
        rank = {"trainer": 0, "relay": 1, "rollout": 2}
        order.sort(key=lambda m: rank[m.role])  # stable: seeded order inside each role
        out[region] = [m.id for m in order[:max(1, count)]]
    return out


def choose_pairs(members: Sequence[Member], *, intra_peers: int = 3, representatives_per_region: int = 2,
                 seed: int = 0) -> list[Pair]:
    """The ordered pairs ``(src, dst)`` a probe run measures (see the module doc); no duplicates."""
    if intra_peers < 1:
        raise ModelError("intra_peers", "must be at least 1")
    if representatives_per_region < 1:
        raise ModelError("representatives", "must be at least 1")
    _check(members)
    rng = random.Random(f"pairs:{seed}")
    trainer = next(m.id for m in members if m.role == "trainer")
    pairs: dict[Pair, None] = {}  # insertion-ordered set
    by_region: dict[str, list[str]] = {}
    for m in members:
        by_region.setdefault(m.region, []).append(m.id)
    for region in sorted(by_region):
        ids = sorted(x for x in by_region[region] if x != trainer)
        n = len(ids)
        if n - 1 <= intra_peers:
            for a in ids:
                for b in ids:
                    if a != b:
                        pairs[(a, b)] = None
        else:
            rng.shuffle(ids)
            for i, dst in enumerate(ids):
                for k in range(1, intra_peers + 1):
                    pairs[(ids[(i + k) % n], dst)] = None
        if trainer in by_region[region]:
            for dst in ids[:intra_peers]:
                pairs[(trainer, dst)] = None
    reps = representatives(members, representatives_per_region, seed)
    others = [m for m in members if m.id != trainer]
    receivers = {**reps, **representatives(others, representatives_per_region, seed)}
    regions = sorted(reps)
    for a in regions:
        for b in regions:
            if a == b:
                continue
            ra, rb = reps[a], receivers[b]
            for j in range(max(len(ra), len(rb))):
                if rb[j % len(rb)] != trainer:
                    pairs[(ra[j % len(ra)], rb[j % len(rb)])] = None
    home = next(m.region for m in members if m.id == trainer)
    for b in regions:
        if b != home:
            for r in reps[b]:
                pairs[(trainer, r)] = None
    return list(pairs)


def schedule_rounds(pairs: Iterable[Pair], region_of: dict[str, str]) -> list[list[Pair]]:
    """Split ``pairs`` into rounds of non-interfering pairs (see the module doc).

    In every round a node appears in at most one pair, and a directed region
    pipe ``(region(src), region(dst))`` with distinct regions carries at most
    one pair. Every pair lands in exactly one round. Greedy first fit, pairs
    of the busiest nodes and pipes first; greedy colouring guarantees fewer
    than twice :func:`rounds_lower_bound` rounds (in practice 1.0-1.2x).
    """
    pairs = list(dict.fromkeys(pairs))
    load: dict[object, int] = {}

    def keys(p: Pair) -> list[object]:
        ra, rb = region_of[p[0]], region_of[p[1]]
        return [p[0], p[1]] + ([("pipe", ra, rb)] if ra != rb else [])

    for p in pairs:
        for k in keys(p):
            load[k] = load.get(k, 0) + 1
    order = sorted(range(len(pairs)), key=lambda i: (-sum(load[k] for k in keys(pairs[i])), i))
    rounds: list[list[Pair]] = []
    busy: list[set[object]] = []
    for i in order:
        p = pairs[i]
        ks = keys(p)
        for r, used in enumerate(busy):
            if not any(k in used for k in ks):
                rounds[r].append(p)
                used.update(ks)
                break
        else:
            rounds.append([p])
            busy.append(set(ks))
    return rounds


def rounds_lower_bound(pairs: Iterable[Pair], region_of: dict[str, str]) -> int:
    """The most pairs one node or one directed region pipe takes part in: no schedule has fewer rounds."""
    load: dict[object, int] = {}
    for a, b in pairs:
        ks: list[object] = [a, b]
        if region_of[a] != region_of[b]:
            ks.append(("pipe", region_of[a], region_of[b]))
        for k in ks:
            load[k] = load.get(k, 0) + 1
    return max(load.values(), default=0)


def node_specs(members: Sequence[Member], measurements: Iterable[Measurement],
               fallback_bps: float = 1e9) -> list[NodeSpec]:
    """Node specs whose capacities are the best single flows measured (see the module doc)."""
    out_best: dict[str, float] = {}
    in_best: dict[str, float] = {}
    every: list[float] = []
    for ms in measurements:
        out_best[ms.src] = max(out_best.get(ms.src, 0.0), ms.bandwidth_bps)
        in_best[ms.dst] = max(in_best.get(ms.dst, 0.0), ms.bandwidth_bps)
        every.append(ms.bandwidth_bps)
    typical = statistics.median(every) if every else fallback_bps
    specs = []
    for m in members:
        up = out_best.get(m.id) or in_best.get(m.id) or typical
        down = in_best.get(m.id) or out_best.get(m.id) or typical
        specs.append(NodeSpec(m.id, m.region, m.role, up, down, "probed"))
    return specs


__all__ = ["Member", "Pair", "choose_pairs", "node_specs", "representatives", "rounds_lower_bound",
           "schedule_rounds"]
