"""Rollout scheduling (pure): which queued work goes to which free slot, plus baselines
and a discrete-event rollout simulator to compare them.

Contract of :meth:`Scheduler.assign`: it only places work on a slot that is free
at ``now``, on a node whose version is within the staleness bound
(``version >= head - max_staleness``), never the same work twice, and it is a
pure function of its arguments. The policy plans every queued item on every
slot as if the plan were final (list scheduling): items longest predicted
remaining output first (LPT) go to the slot that would finish them earliest,
given each node's smoothed throughput, when its busy slots free up, and when a
node outside the staleness bound gets the new version (its download time, so a
node on a slow link gets less work, or work it can finish before its version
goes stale). Slower classes pay a factor (reserved < on-demand < preemptible),
so reserved nodes are kept busy first and the surplus goes to preemptible
ones. Only the placements on slots free now are returned; the rest is
re-planned on the next call, which re-balances as nodes come and go.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2psync.errors import LeaseExpired
from p2psync.lease import LeaseTable, QueuedWork, WorkItem

CLASS_FACTOR = {"reserved": 1.0, "on-demand": 1.05, "preemptible": 1.15}


@dataclass(frozen=True)
class NodeView:
    """What the scheduler knows about a rollout node at ``now``."""

    id: str
    node_class: str
    throughput: float
    """Smoothed decode throughput of the whole node, tokens/s."""
    slots: int
    busy_until: tuple[float, ...] = ()
    """Estimated finish times of the work it runs now (one per busy slot)."""
    version: int = 0
    ready_at: float | None = None
    """When it will hold the head version (None: unknown, e.g. not downloading yet)."""
    stale_at: float | None = None
    """When its current version falls outside the staleness bound (None: not foreseen)."""


class Ewma:
    """Exponentially smoothed value per key (throughput per node, output length per prompt)."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.values: dict[str, float] = {}

    def update(self, key: str, value: float) -> float:
        old = self.values.get(key)
        new = value if old is None else old + self.alpha * (value - old)
        self.values[key] = new
        return new

    def get(self, key: str, default: float) -> float:
        return self.values.get(key, default)


class LengthPredictor:
    """Predicted output tokens of a prompt group from its history (EWMA), else the global mean."""

    def __init__(self, alpha: float = 0.5, prior: float = 512.0) -> None:
        self.ewma = Ewma(alpha)
        self.total = 0.0
        self.count = 0
        self.prior = prior

    def observe(self, prompt_key: str, tokens: int) -> None:
        self.ewma.update(prompt_key, float(tokens))
        self.total += tokens
        self.count += 1

    def predict(self, prompt_key: str) -> float:
        return self.ewma.get(prompt_key, self.total / self.count if self.count else self.prior)


class Policy(Protocol):
    """What :func:`simulate` asks of a scheduler (a ``predictor`` attribute, when present,
    is told each finished work's length)."""

    name: str
    """Shown in the simulation's result."""

    def assign(self, now: float, queue: Sequence[QueuedWork], nodes: Sequence[NodeView],
               head: int) -> list[tuple[str, str]]: ...


@dataclass
class Scheduler:
    """Throughput-, staleness-, bandwidth-, skew- and class-aware list scheduling."""

    predictor: LengthPredictor = field(default_factory=LengthPredictor)
    max_staleness: int = 0
    class_factor: dict[str, float] = field(default_factory=lambda: dict(CLASS_FACTOR))
    name: str = "scheduler"

    def assign(self, now: float, queue: Sequence[QueuedWork], nodes: Sequence[NodeView],
               head: int) -> list[tuple[str, str]]:
        """(work id, node id) placements for slots free at ``now``."""
        slots: list[tuple[float, str, NodeView]] = []
        for n in nodes:
            if n.throughput <= 0 or n.slots <= 0:
                continue
            start = now
            if n.version < head - self.max_staleness:
                if n.ready_at is None:
                    continue
                start = max(now, n.ready_at)
            busy = sorted(n.busy_until)[: n.slots]
            for i in range(n.slots):
                slots.append((max(start, busy[i]) if i < len(busy) else start, n.id, n))
        if not slots or not queue:
            return []
        remaining = sorted(((max(self.predictor.predict(q.prompt_key) - q.tokens_done, 1.0), q.work_id)
                            for q in queue), reverse=True)
        free_at = [t for t, _, _ in slots]
        out: list[tuple[str, str]] = []
        for tokens, wid in remaining:
            best, best_cost, best_finish = -1, math.inf, math.inf
            # One candidate per node, its earliest-free slot: the slots of a node are alike.
            seen: set[str] = set()
            for i in sorted(range(len(slots)), key=free_at.__getitem__):
                n = slots[i][2]
                if n.id in seen:
                    continue
                seen.add(n.id)
                start = free_at[i]
                per_slot = n.throughput / n.slots
                finish = start + tokens / per_slot
                if n.stale_at is not None and finish > n.stale_at and n.ready_at is not None and start < n.ready_at:
                    # It would finish on a version gone stale: it has to wait for the new one.
                    finish = n.ready_at + tokens / per_slot
                cost = now + (finish - now) * self.class_factor.get(n.node_class, 1.0)
                if cost < best_cost:
                    best, best_cost, best_finish = i, cost, finish
            if best < 0:
                break
            if free_at[best] <= now:
                out.append((wid, slots[best][1]))
            free_at[best] = best_finish
        return out


@dataclass
class FifoScheduler:
    """Baseline: the oldest queued work goes to whichever eligible slot is free, in node order."""

    max_staleness: int = 0
    name: str = "fifo"

    def assign(self, now: float, queue: Sequence[QueuedWork], nodes: Sequence[NodeView],
               head: int) -> list[tuple[str, str]]:
        free = [n.id for n in nodes if n.version >= head - self.max_staleness
                for _ in range(max(0, n.slots - len(n.busy_until)))]
        return [(q.work_id, nid) for q, nid in zip(queue, free)]


@dataclass
class RoundRobinScheduler:
    """Baseline: work is dealt to nodes in turn (each node gets its share, whatever its speed)."""

    max_staleness: int = 0
    name: str = "round-robin"
    _owner: dict[str, str] = field(default_factory=dict)
    _turn: int = 0

    def assign(self, now: float, queue: Sequence[QueuedWork], nodes: Sequence[NodeView],
               head: int) -> list[tuple[str, str]]:
        ids = sorted(n.id for n in nodes)
        free = {n.id: max(0, n.slots - len(n.busy_until)) for n in nodes
                if n.version >= head - self.max_staleness}
        out = []
        for q in queue:
            owner = self._owner.get(q.work_id)
            if owner not in ids and ids:
                owner = self._owner[q.work_id] = ids[self._turn % len(ids)]
                self._turn += 1
            if owner is not None and free.get(owner, 0) > 0:
                free[owner] -= 1
                out.append((q.work_id, owner))
        return out


# ---------------------------------------------------------------- rollout simulator


@dataclass(frozen=True)
class SimNode:
    id: str
    node_class: str
    throughput: float
    slots: int
    bandwidth: float
    """Bytes/s for downloading deltas (and snapshots after a restart)."""


@dataclass(frozen=True)
class Workload:
    """Synchronous RL: each step releases ``batch`` prompt groups with long-tail lengths."""

    steps: int = 12
    batch: int = 128
    prompts: int = 256
    median_tokens: float = 600.0
    sigma: float = 1.0
    """Lognormal spread of per-prompt mean output length (the long tail)."""
    noise: float = 0.25
    """Lognormal spread of one sample around its prompt's mean."""
    max_tokens: int = 16384
    train_seconds: float = 10.0
    delta_bytes: float = 200e6
    snapshot_bytes: float = 4e9
    report_every: int = 16
    """Tokens between progress reports (what survives a preemption)."""


@dataclass
class SimResult:
    policy: str
    seconds: float
    tokens: int
    completed: int
    submitted: int
    duplicates: int
    preemptions: int
    requeued: int
    carried_tokens: int

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    @property
    def lost(self) -> int:
        return self.submitted - self.completed


def default_cluster(seed: int = 0, n: int = 16) -> list[SimNode]:
    """Heterogeneous nodes: a quarter reserved (fast, good links), a quarter on-demand, half preemptible."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cls = "reserved" if i < n // 4 else ("on-demand" if i < n // 2 else "preemptible")
        tps = {"reserved": 4000.0, "on-demand": 2500.0, "preemptible": rng.choice([800.0, 1500.0, 3000.0])}[cls]
        bw = 1.25e9 if cls == "reserved" else rng.choice([12.5e6, 50e6, 125e6])
        out.append(SimNode(f"g{i:03d}", cls, tps, 4, bw))
    return out


def simulate(policy: Policy, cluster: Sequence[SimNode], work: Workload = Workload(), *, seed: int = 0,
             preempt_share: float = 0.0, notice_share: float = 0.7, stall_share: float = 0.0,
             downtime: float = 60.0, ttl: float = 30.0) -> SimResult:
    """Run ``work`` on ``cluster`` under ``policy``; faults hit ``preempt_share`` of the nodes.

    A preempted node hands its leases back with their tokens (``notice_share`` of
    the time) or vanishes (its leases expire after ``ttl``); it returns after
    ``downtime`` and downloads a snapshot. A stalled node freezes for ``2 * ttl``
    and then delivers its results late (they must be dropped as duplicates if
    someone else finished first). Every result goes through a :class:`LeaseTable`.
    """
    rng = random.Random(seed)
    prompt_mean = [min(work.max_tokens, work.median_tokens * math.exp(rng.gauss(0, work.sigma)))
                   for _ in range(work.prompts)]
    table = LeaseTable(ttl)
    tput = Ewma(0.3)
    predictor: LengthPredictor | None = getattr(policy, "predictor", None)
    nodes = {n.id: n for n in cluster}
    up = {n.id: True for n in cluster}
    version = {n.id: 0 for n in cluster}
    ready_at: dict[str, float | None] = {n.id: None for n in cluster}
    running: dict[str, dict[str, tuple[int, float, float, int]]] = {n.id: {} for n in cluster}
    """node -> work id -> (lease id, start, finish, start tokens)"""
    length: dict[str, int] = {}
    events: list[tuple[float, int, str, str, Any]] = []
    """(time, sequence, kind, node, data): ``data`` depends on ``kind``."""
    seq = [0]

    def push(t: float, kind: str, node: str, data: Any = None) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, node, data))

    victims = rng.sample([n.id for n in cluster if n.node_class == "preemptible"] or [n.id for n in cluster],
                         k=min(len(cluster), round(preempt_share * len(cluster))))
    now, head, step, tokens_total, preemptions, carried = 0.0, 0, 0, 0, 0, 0
    pending: set[str] = set()
    publishing = False

    def release_step() -> None:
        nonlocal step
        for b in range(work.batch):
            p = rng.randrange(work.prompts)
            wid = f"s{step}-{b}"
            length[wid] = max(1, min(work.max_tokens, round(prompt_mean[p] * math.exp(rng.gauss(0, work.noise)))))
            table.submit(WorkItem(wid, prompt_key=f"p{p}"))
            pending.add(wid)
        step += 1

    def views() -> list[NodeView]:
        return [NodeView(nid, n.node_class, tput.get(nid, n.throughput), n.slots,
                         tuple(f for _, _, f, _ in running[nid].values()), version[nid], ready_at[nid])
                for nid, n in nodes.items() if up[nid]]

    def dispatch() -> None:
        for wid, nid in policy.assign(now, table.queued(), views(), head):
            lease = table.grant(now, nid, wid)
            done = sum(len(t) for t in lease.resume.values())
            n = nodes[nid]
            finish = now + max(0, length[wid] - done) * n.slots / n.throughput
            running[nid][wid] = (lease.lease_id, now, finish, done)
            push(finish, "finish", nid, (wid, lease.lease_id))

    def stop_node(nid: str, notice: bool) -> None:
        nonlocal carried
        n = nodes[nid]
        for wid, (lid, start, _, done) in running[nid].items():
            made = done + int((now - start) * n.throughput / n.slots)
            kept = min(length[wid] - 1, made // work.report_every * work.report_every)
            if kept > done:
                table.progress(now, nid, wid, lid, 0, done, (1,) * (kept - done))
                carried += kept - done
        running[nid].clear()
        if notice:
            table.release_all(now, nid)
        else:
            push(now + ttl, "expire", nid)

    release_step()
    for v in victims:
        push(rng.uniform(5.0, 60.0), "preempt", v)
    stalled: dict[str, float] = {}
    if stall_share:
        for v in rng.sample(sorted(nodes), k=max(1, round(stall_share * len(nodes)))):
            push(rng.uniform(5.0, 60.0), "stall", v)
    dispatch()
    while events:
        now, _, kind, nid, data = heapq.heappop(events)
        if kind == "finish":
            wid, lid = data
            if not up[nid] or running[nid].get(wid, (None,))[0] != lid:
                continue
            if nid in stalled and now < stalled[nid]:
                push(stalled[nid], "finish", nid, data)
                continue
            lid, start, _, done = running[nid].pop(wid)
            c = table.complete(now, nid, wid, lid)
            tput.update(nid, nodes[nid].throughput)
            if c.accepted:
                tokens_total += length[wid]
                pending.discard(wid)
                if predictor is not None:
                    predictor.observe(table.item(wid).prompt_key, length[wid])
            for other in nodes:  # a late result revokes the lease then in force (a stalled node misses that)
                if other != nid and wid in running[other] and c.accepted and other not in stalled:
                    del running[other][wid]
        elif kind == "preempt":
            if (not running[nid] or not up[nid]) and int(data or 0) < 15:
                # Preempt it while it works (the case that matters): try again a bit later.
                push(now + 2.0, "preempt", nid, int(data or 0) + 1)
                continue
            if not up[nid]:
                continue
            preemptions += 1
            notice = rng.random() < notice_share
            stop_node(nid, notice)
            up[nid] = False
            push(now + downtime, "return", nid)
        elif kind == "return":
            up[nid] = True
            version[nid] = -1
            ready_at[nid] = t = now + work.snapshot_bytes / nodes[nid].bandwidth
            push(t, "ready", nid, None)
        elif kind == "ready":
            if up[nid]:
                # A snapshot (data None) is of the head at the time it completes.
                version[nid] = max(version[nid], head if data is None else int(data))
                if version[nid] >= head:
                    ready_at[nid] = None
        elif kind == "stall":
            if not running[nid] or not up[nid]:
                push(now + 2.0, "stall", nid)
                continue
            stalled[nid] = now + 2 * ttl
            push(now + ttl + 1e-6, "expire", nid)
        elif kind == "expire":
            for wid in table.expire(now):
                for other in nodes:
                    if other not in stalled:
                        running[other].pop(wid, None)
        elif kind == "published":
            publishing = False
            head = int(data)
            release_step()
            for m, n in nodes.items():
                if up[m] and version[m] >= 0:
                    ready_at[m] = t = now + work.delta_bytes / n.bandwidth
                    push(t, "ready", m, head)
        for s_node, until in list(stalled.items()):
            if now >= until:
                del stalled[s_node]
        if not pending and step < work.steps and not publishing:
            publishing = True
            push(now + work.train_seconds, "published", "", head + 1)
        # Leases of healthy nodes are renewed by their progress reports; a node whose
        # lease moved on (it was stalled) finishes anyway and its result is judged then.
        for m in nodes:
            if up[m] and m not in stalled:
                for wid, (lid, *_rest) in running[m].items():
                    try:
                        table.renew(now, m, wid, lid)
                    except LeaseExpired:
                        pass
        dispatch()
        if not pending and step >= work.steps:
            break
    counts = table.counts()
    return SimResult(policy.name, now, tokens_total, counts["completed"], step * work.batch, counts["duplicates"],
                     preemptions, table.requeued, carried)
