"""The planner: a bandwidth-weighted, degree-limited dissemination tree rooted at the trainer.

Pure and deterministic: the same model, config and seed give the same plan;
nothing here does I/O or reads a clock.

How a plan is built (each step scored with :func:`topology.tree.estimate`):

1. **Backbone.** Every region gets one entry node (chosen among its
   ``gateways_per_region`` strongest machines) attached to a *source*: the
   trainer or the entry of a region already attached. Regions are attached
   greedily, widest path first (highest rate, then lowest path RTT), or
   earliest estimated arrival first (payload time, the chunk times of the
   hops so far and the path delay), so a region is chained behind another
   when that inter-region link beats what the trainer's uplink can still
   give it. Each attachment reserves the rate
   it uses on the source's uplink and on the inter-region pipe, so later
   attachments see what is left.
2. **Fan-out inside a region.** Starting from the entry (and, in the
   trainer's region, the trainer), machines are attached breadth first,
   strongest uplink first, so strong machines become relays near the top and
   weak ones leaves. A relay takes ``floor(spare uplink / target rate)``
   children (at most ``max_degree``), with the target rate the entry's rate;
   halved targets (more fan-out, less depth) and narrow relays (3 or 4
   children: each hop costs one chunk time at the relay's uplink share, so
   a deeper tree of narrow relays can finish sooner) are tried too and the
   best local estimate wins.
3. **Second entry points.** While the region that finishes last can be
   improved by giving it a second entry (its next strongest machine, attached
   to the best remaining source, the region's machines split between the two
   subtrees), that is done.
4. **Fallbacks.** Each node gets a ranked list of nodes to fail over to; see
   :func:`rank_fallbacks`.

Two reservation policies for the backbone are tried (reserve the full rate;
reserve no more than the slowest region's rate, which leaves room on a fast
trainer for direct children) and the plan with the lower estimate is kept.
Finally a bounded local search (:mod:`topology.refine`) moves nodes on the
critical path, or hands a region's entry role to a machine with a faster
measured link into the region, while that lowers the estimate.
"""

from __future__ import annotations

import math
import random

import numpy as np
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from topology import fanout
from topology.errors import ModelError
from topology.fallbacks import rank_fallbacks
from topology.model import NetworkModel
from topology.refine import refine
from topology.tree import Plan, bfs_order, children_of, completion, depths_of, estimate
from topology.vector import arrays_of, layout, propagate

_TARGET_DIVISORS = (1.0, 2.0, 4.0)
# Narrower relays inside a region, tried at the entry's rate: a hop costs one chunk time at the
# relay's uplink share (uplink / children), so a deeper tree of narrow relays can finish sooner
# (the sum of the degrees along the path, not their product, is what the chunk times add up to).
_NARROW_DEGREES = (3, 4)


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner optimises for and the knobs that bound the tree."""

    payload_bytes: int = 256 * 2**20
    """Size of the artifact the plan is scored for (a typical delta)."""
    chunk_bytes: int = 4 * 2**20
    """Chunk size: the unit a relay forwards once it has verified it."""
    max_degree: int = 8
    """Most children a node serves at once."""
    gateways_per_region: int = 3
    """How many of a region's strongest machines are considered as its entry."""
    fallbacks: int = 3
    """Length of each node's ranked fail-over list."""
    second_entries: bool = True
    """Whether a region may get a second entry point when that lowers the estimate."""
    seed: int = 0
    """Breaks ties between equally strong machines."""
    refine_budget: int = 100_000
    """Node visits the local search after construction may spend (a trial costs one per node;
    see :mod:`topology.refine`); 0 turns it off."""

    def __post_init__(self) -> None:
        for name in ("payload_bytes", "chunk_bytes", "max_degree", "gateways_per_region"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelError(name, f"must be a positive integer, got {v!r}")
        for name in ("fallbacks", "refine_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ModelError(name, f"must be a non-negative integer, got {v!r}")


class _Shared:
    """What every attempt of one :func:`plan` call shares: orderings, and the fan-outs already built.

    A region's fan-out depends only on its heads' state (rate, reserved uplink, children), so
    attempts whose backbones leave a region's heads alike reuse it (``fanouts``).
    """

    def __init__(self, model: NetworkModel, rank: Mapping[str, int]) -> None:
        self.by_region = model.by_region()
        root = model.trainer

        def strength(n: str) -> tuple[float, float, int]:
            s = model.node(n)
            return (-s.uplink_bps, -s.downlink_bps, rank[n])

        # Each region's machines (the trainer left out), strongest first.
        self.strongest = {r: sorted((n for n in ids if n != root), key=strength) for r, ids in self.by_region.items()}
        self.fanouts: dict[tuple[Any, ...], dict[str, str]] = {}
        self.arrays = arrays_of(model)


class _Builder:
    """Mutable tree under construction; one per attempt."""

    def __init__(self, model: NetworkModel, cfg: PlannerConfig, rank: Mapping[str, int], by_eta: bool,
                 shared: _Shared) -> None:
        self.m = model
        self.sh = shared
        self.by_eta = by_eta
        self.bits = cfg.payload_bytes * 8.0
        self.cfg = cfg
        self.root = model.trainer
        self.rank = rank
        self.parents: dict[str, str] = {}
        self.children: defaultdict[str, list[str]] = defaultdict(list)
        self.reserved: dict[str, float] = {}
        """Uplink reserved by the backbone, per source (absent: none)."""
        self.pipe_reserved: dict[tuple[str, str], float] = {}
        self.rate: dict[str, float] = {self.root: math.inf}
        self.lat: dict[str, float] = {self.root: 0.0}
        self.pipe: dict[str, float] = {self.root: 0.0}
        """Chunk times along the backbone path to each source (the hop cost of cut-through)."""
        self.cbits = min(cfg.chunk_bytes, cfg.payload_bytes) * 8.0
        self.entries: dict[str, list[str]] = {}
        self.sources: list[str] = [self.root]
        self.serve: dict[str, float] = {}
        self.completion_s = math.inf
        """The estimate of the finished tree (set by :func:`_build`)."""

    def attach(self, child: str, parent: str) -> None:
        self.parents[child] = parent
        self.children[parent].append(child)

    def detach(self, child: str) -> None:
        self.children[self.parents.pop(child)].remove(child)

    def strength(self, n: str) -> tuple[float, float, int]:
        s = self.m.node(n)
        return (-s.uplink_bps, -s.downlink_bps, self.rank[n])

    # ---- backbone ----------------------------------------------------------------------

    def offer(self, src: str, dst: str) -> float:
        """Rate ``dst`` would get from ``src`` given what is already reserved."""
        m = self.m
        if len(self.children[src]) >= self.cfg.max_degree:
            return 0.0
        r = min(self.rate[src], m.bandwidth(src, dst), m.node(dst).downlink_bps,
                m.node(src).uplink_bps - self.reserved.get(src, 0.0))
        a, b = m.region_of(src), m.region_of(dst)
        cap = m.link_capacity(a, b)
        if cap is not None:
            r = min(r, cap - self.pipe_reserved.get((a, b), 0.0))
        return max(r, 0.0)

    def link(self, src: str, dst: str, rate: float, reserve_cap: float) -> None:
        self.attach(dst, src)
        self.rate[dst] = rate
        self.lat[dst] = self.lat[src] + self.m.rtt(src, dst) / 2
        self.pipe[dst] = self.pipe[src] + self.cbits / rate
        used = min(rate, reserve_cap)
        self.reserved[src] = self.reserved.get(src, 0.0) + used
        a, b = self.m.region_of(src), self.m.region_of(dst)
        if a != b:
            self.pipe_reserved[(a, b)] = self.pipe_reserved.get((a, b), 0.0) + used

    def best_source(self, gateways: list[str], exclude_region: str | None = None) -> tuple[float, str, str] | None:
        best: tuple[float, float, float, int, float, str, str] | None = None
        for g in gateways:
            for s in self.sources:
                if exclude_region is not None and s != self.root and self.m.region_of(s) == exclude_region:
                    continue
                r = self.offer(s, g)
                if r <= 0:
                    continue
                key = (*self.score(r, s, g), r, s, g)
                if best is None or key[:4] > best[:4]:
                    best = key
        return None if best is None else (best[4], best[5], best[6])

    def score(self, r: float, s: str, g: str) -> tuple[float, float, float, int]:
        """Larger is better: widest first (then lowest delay), or earliest estimated arrival first.

        Ties go to the gateway that can serve its region best (see ``backbone``).
        """
        lat = self.lat[s] + self.m.rtt(s, g) / 2
        up = self.serve.get(g, 0.0)
        if self.by_eta:
            return (-(self.bits / r + self.pipe[s] + lat), r, up, -self.rank[g])
        return (r, -lat, up, -self.rank[g])

    def backbone(self, reserve_cap: float) -> None:
        m, cfg = self.m, self.cfg
        gateways: dict[str, list[str]] = {}
        for region, cands in self.sh.strongest.items():
            if cands:
                gateways[region] = cands[: cfg.gateways_per_region]
        # How well a gateway serves its own region: the median bandwidth to a sample of the
        # region's machines, capped by its uplink (measured links may be asymmetric).
        for region, gws in gateways.items():
            sample = self.sh.strongest[region][:16]
            for g in gws:
                bws = sorted(m.bandwidth(g, x) for x in sample if x != g) or [m.node(g).uplink_bps]
                self.serve[g] = min(m.node(g).uplink_bps, bws[len(bws) // 2])
        pending = dict(gateways)
        while pending:
            best: tuple[float, float, float, int, str, str, str] | None = None
            for region, gws in pending.items():
                hit = self.best_source(gws)
                if hit is None:
                    continue
                r, s, g = hit
                key = (*self.score(r, s, g), region, s, g)
                if best is None or key[:4] > best[:4]:
                    best = key
            if best is None:
                # Every source is saturated: attach the strongest remaining gateway to the
                # source with the most spare uplink, accepting a shared (slower) link.
                region, gws = next(iter(pending.items()))
                s = max(self.sources, key=lambda x: (m.node(x).uplink_bps - self.reserved.get(x, 0.0)) / (1 + len(self.children[x])))
                r = min(m.bandwidth(s, gws[0]), m.node(s).uplink_bps / (1 + len(self.children[s])))
                best = (*self.score(r, s, gws[0]), region, s, gws[0])
            _, _, _, _, region, s, g = best
            r = self.offer(s, g) or min(m.bandwidth(s, g), m.node(s).uplink_bps / (1 + len(self.children[s])))
            self.link(s, g, r, reserve_cap)
            self.entries[region] = [g]
            self.sources.append(g)
            del pending[region]

    # ---- fan-out inside a region -------------------------------------------------------

    def slots(self, p: str, target: float, degree: int | None = None) -> int:
        spare = self.m.node(p).uplink_bps - self.reserved.get(p, 0.0)
        free = min(self.cfg.max_degree, degree or self.cfg.max_degree) - len(self.children[p])
        return max(0, min(free, int(spare / target + 1e-9)))

    def fan_out(self, heads: list[str], members: list[str], target: float, degree: int) -> None:
        """Attach ``members`` (strongest first) breadth first below ``heads``, each member relaying to
        at most ``degree`` others."""
        m = self.m
        queue: list[list[Any]] = [[h, self.slots(h, target)] for h in heads]
        queue = [q for q in queue if q[1] > 0] or [[heads[-1], 1]]
        qi = 0
        attached = list(heads)
        shares = fanout.Shares(m, self.reserved, self.children, self.rank, self.cfg.max_degree)
        for h in heads:
            shares.add(h)
        for c in members:
            while qi < len(queue) and queue[qi][1] <= 0:
                qi += 1
            if qi == len(queue):
                # No relay has a free slot at this target: give one to whichever attached
                # machine keeps the largest share, degree cap permitting.
                p = shares.best()
                if p is None:  # every attached machine is at the degree cap
                    p = max(attached, key=shares.key)
                queue.append([p, 1])
            # Prefer, among the next few open relays, the first whose measured link carries the target.
            pick, best_bw = qi, -1.0
            j, seen = qi, 0
            while j < len(queue) and seen < 4:
                if queue[j][1] > 0:
                    bw = m.bandwidth(queue[j][0], c)
                    if bw >= target:
                        pick = j
                        break
                    if bw > best_bw:
                        pick, best_bw = j, bw
                    seen += 1
                j += 1
            p = queue[pick][0]
            queue[pick][1] -= 1
            self.attach(c, p)
            attached.append(c)
            shares.add(c)
            k = self.slots(c, target, degree)
            if k > 0:
                queue.append([c, k])

    def local_eval(self, heads: list[str], members: set[str]) -> float:
        """Worst estimate over ``members`` relative to their heads (heads' upstream is common to all trials)."""
        a = self.sh.arrays
        lay = layout(a, self.children, heads, members)
        n_children = np.zeros(len(a.ids))
        for j in lay.nodes.tolist():
            n_children[j] = len(self.children[a.ids[j]])
        tops = len(heads)
        paths = propagate(self.m, a, lay, n_children, None, self.cfg.payload_bytes, self.cfg.chunk_bytes,
                          np.array([self.rate.get(h, math.inf) for h in heads]), np.zeros(tops), np.zeros(tops))
        return float(paths.eta[tops:].max()) if len(lay.nodes) > tops else 0.0

    def build_region(self, region: str) -> None:
        """(Re)build the fan-out of ``region`` below its entries, trying a few target rates."""
        entries = self.entries.get(region, [])
        if not entries:
            return
        for n in self.sh.by_region[region]:
            if n in self.parents and n not in entries and self.m.region_of(self.parents[n]) == region:
                self.detach(n)
        heads = ([self.root] if self.m.region_of(self.root) == region else []) + entries
        members = [n for n in self.sh.strongest[region] if n not in heads]
        if not members:
            return
        base = min(self.rate[e] for e in entries)
        for c in members:
            if c in self.parents:
                self.detach(c)
        key = (region, tuple((h, self.rate.get(h, math.inf), self.reserved.get(h, 0.0), len(self.children[h])) for h in heads))
        chosen = self.sh.fanouts.get(key)
        if chosen is None:
            chosen = self.sh.fanouts[key] = self.best_fan_out(heads, members, base)
        # Re-attach in BFS order so that children lists keep the breadth-first order.
        by_parent: dict[str, list[str]] = {}
        for c in members:
            by_parent.setdefault(chosen[c], []).append(c)
        order = list(heads)
        for p in order:
            for c in by_parent.get(p, ()):
                self.attach(c, p)
                order.append(c)

    def best_fan_out(self, heads: list[str], members: list[str], base: float) -> dict[str, str]:
        """The fan-out (member -> parent) with the best local estimate over the target rates tried."""
        cfg, a = self.cfg, self.sh.arrays
        best: tuple[float, dict[str, str] | Callable[[], dict[str, str]]] | None = None
        member_set = set(members)
        # The closed form of topology.fanout applies while the members are bare.
        bare = all(not self.children[c] and not self.reserved.get(c, 0.0) for c in members)
        hi = np.array([a.idx[h] for h in heads], dtype=np.int64)
        mi = np.array([a.idx[c] for c in members], dtype=np.int64)
        trials = [(div, cfg.max_degree) for div in _TARGET_DIVISORS]
        trials += [(1.0, d) for d in _NARROW_DEGREES if d < cfg.max_degree]
        for div, degree in trials:
            target = max(base / div, 1.0)
            parent = fanout.fan_out(a, hi, [self.slots(h, target) for h in heads], mi, target,
                                    degree) if bare else None
            trial: dict[str, str] | Callable[[], dict[str, str]]
            if parent is not None:
                score = fanout.worst_below(
                    self.m, a, hi, np.array([self.rate.get(h, math.inf) for h in heads]),
                    np.array([float(len(self.children[h])) for h in heads]), mi, parent,
                    cfg.payload_bytes, cfg.chunk_bytes)
                names = [*heads, *members]
                trial = (lambda par=parent, nm=names: dict(zip(members, (nm[j] for j in par.tolist()))))
            else:
                for c in members:
                    if c in self.parents:
                        self.detach(c)
                self.fan_out(heads, members, target, degree)
                score = self.local_eval(heads, member_set)
                trial = {c: self.parents[c] for c in members}
                for c in members:
                    self.detach(c)
            if best is None or score < best[0] * (1 - 1e-9):
                best = (score, trial)
        assert best is not None
        return best[1] if isinstance(best[1], dict) else best[1]()

    def add_second_entry(self, region: str) -> bool:
        """Give ``region`` a second entry point; False when there is no candidate or source."""
        m = self.m
        entries = self.entries[region]
        cands = [n for n in self.sh.strongest[region] if n not in entries]
        if len(cands) < 2:
            return False
        gateways = cands[: self.cfg.gateways_per_region]
        for g in gateways:
            if g in self.parents:
                self.detach(g)
        hit = self.best_source(gateways, exclude_region=region)
        if hit is None:
            return False
        r, s, g = hit
        self.link(s, g, r, math.inf)
        entries.append(g)
        self.build_region(region)
        return True


def _ranks(model: NetworkModel, seed: int) -> dict[str, int]:
    ids = sorted(model.node_ids)
    order = list(range(len(ids)))
    random.Random(seed).shuffle(order)
    return dict(zip(ids, order))


def _build(model: NetworkModel, cfg: PlannerConfig, rank: Mapping[str, int], reserve_cap: float, by_eta: bool,
           shared: _Shared) -> _Builder:
    b = _Builder(model, cfg, rank, by_eta, shared)
    b.backbone(reserve_cap)
    for region in model.region_names():
        b.build_region(region)
    if cfg.second_entries:
        tried: set[str] = set()
        current = completion(model, b.root, b.children, cfg.payload_bytes, cfg.chunk_bytes)
        for _ in range(len(model.region_names())):
            region = model.region_of(current[1])
            if region in tried or current[1] == b.root:
                break
            tried.add(region)
            # What add_second_entry may touch: the region's machines and the backbone's sources.
            mine = shared.by_region[region]
            saved = ({n: b.parents[n] for n in mine if n in b.parents},
                     {n: list(b.children[n]) for n in (*mine, *b.sources)}, dict(b.reserved),
                     dict(b.pipe_reserved), dict(b.rate), dict(b.lat), list(b.entries[region]), list(b.sources))
            if b.add_second_entry(region):
                trial = completion(model, b.root, b.children, cfg.payload_bytes, cfg.chunk_bytes)
                if trial[0] < current[0] * (1 - 1e-6):
                    current = trial
                    continue
            for n in mine:
                b.parents.pop(n, None)
            b.parents.update(saved[0])
            b.children.update(saved[1])
            b.reserved, b.pipe_reserved, b.rate, b.lat, entries, b.sources = saved[2:]
            b.entries[region] = entries
            break
        b.completion_s = current[0]
    else:
        b.completion_s = completion(model, b.root, b.children, cfg.payload_bytes, cfg.chunk_bytes)[0]
    return b


def plan(model: NetworkModel, config: PlannerConfig | None = None, epoch: int = 0) -> Plan:
    """Plan the dissemination tree for ``model``; see the module docstring for how."""
    cfg = config or PlannerConfig()
    rank = _ranks(model, cfg.seed)
    if len(model) == 1:
        return finish_plan(model, cfg, {}, epoch)
    best: tuple[float, _Builder] | None = None
    shared = _Shared(model, rank)
    for by_eta in (False, True):
        first = _build(model, cfg, rank, math.inf, by_eta, shared)
        # The slowest region's entry rate: reserving more than that on a source only helps
        # nodes that do not decide the completion time.
        floor_rate = min(first.rate[e[0]] for e in first.entries.values())
        for b in (first, _build(model, cfg, rank, max(floor_rate, 1.0), by_eta, shared)):
            score = b.completion_s
            if best is None or score < best[0] * (1 - 1e-9):
                best = (score, b)
    assert best is not None
    parents = refine(model, best[1].root, best[1].parents, cfg.payload_bytes, cfg.chunk_bytes,
                     cfg.max_degree, cfg.refine_budget, more_entries=cfg.second_entries)
    return finish_plan(model, cfg, parents, epoch)


def finish_plan(model: NetworkModel, cfg: PlannerConfig, parents: Mapping[str, str], epoch: int) -> Plan:
    """The :class:`Plan` for a finished tree: estimate, fallbacks, breadth-first order."""
    root = model.trainer
    # Deterministic order: breadth first from the root.
    children = children_of(parents, root)
    ordered = {c: parents[c] for c in bfs_order(children, root) if c != root}
    children = children_of(ordered, root)
    est = estimate(model, root, ordered, cfg.payload_bytes, cfg.chunk_bytes, children)
    return Plan(
        root=root,
        parents=ordered,
        edge_bps=est.edge_bps,
        eta_s=est.eta_s,
        est_completion_s=est.completion_s,
        fallbacks=rank_fallbacks(model, root, ordered, cfg.fallbacks, children),
        regions={n: model.region_of(n) for n in model.node_ids},
        roles={n: model.node(n).role for n in model.node_ids},
        payload_bytes=cfg.payload_bytes,
        chunk_bytes=cfg.chunk_bytes,
        epoch=epoch,
    )


__all__ = ["PlannerConfig", "finish_plan", "plan"]
