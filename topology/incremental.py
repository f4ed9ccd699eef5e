"""Incremental re-planning: one change at a time, in time proportional to the part of the tree it touches.

A :class:`Replanner` holds a plan, its model and, per node, the quantities of
the completion estimate (edge share, path rate, chunk times, delay, arrival).
Each change (:meth:`~Replanner.fail`, :meth:`~Replanner.join`,
:meth:`~Replanner.link_changed`, :meth:`~Replanner.partition`) updates them
where they change and nowhere else:

- the edges whose share changes: those out of a parent that gained or lost a
  child (its uplink is split differently), those on an inter-region pipe that
  gained or lost an edge, and an edge whose pair was re-measured;
- the subtrees below those edges (their path quantities follow);
- the fallbacks of the nodes that moved or whose fallbacks name a node that
  left or moved.

Placement follows :func:`topology.replan.replan`: a node that lost its parent
keeps its subtree and attaches, with it, under the attached node that offers
the best rate (first one that can take a child without slowing the ones it
has, then the best offer, the shallowest, the most uplink per child); few
such tops go best offer first, so a promoted region entry is in place before
the other orphans. Nodes whose parent is still there never move.

Contract: after each change, ``plan`` is a tree over the model's nodes with
every node except the root having one parent; ``moved`` (in the returned
:class:`Change`) lists the nodes present before and after whose parent
differs, and only nodes whose own parent left (or whose edge was re-measured,
for :meth:`~Replanner.link_changed`) are in it. The estimate equals what
:func:`topology.tree.estimate` computes for the same tree. Compared with a
fresh :func:`topology.planner.plan`, a repaired tree may be somewhat slower;
a periodic full re-plan in the background (its changes gossiped as moves)
recovers that, see docs/TOPOLOGY.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from topology.model import Measurement, NetworkModel, NodeSpec
from topology.fallbacks import LiveFallbacks
from topology.offers import Key, NodeTable
from topology.planner import PlannerConfig
from topology.tree import Plan, edge_share, estimate

# At most this many tops are placed best-offer-first (each costs a scan of its region's candidates).
_PRIM_TOPS = 32


@dataclass(frozen=True)
class Change:
    plan: Plan
    """The plan after the change (epoch one more than before)."""
    moved: frozenset[str]
    """Nodes present before and after whose parent changed: what has to be gossiped."""
    touched: int
    """Nodes whose estimate or fallbacks were recomputed (the cost of the change)."""


class Replanner:
    """The current plan and model, changed one event at a time; see the module docstring."""

    def __init__(self, plan: Plan, model: NetworkModel, config: PlannerConfig | None = None) -> None:
        self.cfg = config or PlannerConfig(payload_bytes=plan.payload_bytes or PlannerConfig.payload_bytes,
                                           chunk_bytes=plan.chunk_bytes or PlannerConfig.chunk_bytes)
        self.model = model
        self.root = plan.root
        self.epoch = plan.epoch
        self.parents = dict(plan.parents)
        self.children: dict[str, list[str]] = {n: [] for n in model.node_ids}
        for c, p in self.parents.items():
            self.children[p].append(c)
        self.flows: dict[tuple[str, str], int] = {}
        self.pipe_edges: dict[tuple[str, str], set[str]] = {}
        for c, p in self.parents.items():
            self._count_edge(c, p, +1)
        est = estimate(model, self.root, self.parents, self.cfg.payload_bytes, self.cfg.chunk_bytes, self.children)
        self.share = dict(est.edge_bps)
        self.rate = dict(est.rate_bps)
        self.eta = dict(est.eta_s)
        self.pipe: dict[str, float] = {self.root: 0.0}
        self.lat: dict[str, float] = {self.root: 0.0}
        self.depth: dict[str, int] = {self.root: 0}
        self._shallow: set[str] = {self.root}
        """The nodes of ``depth`` at depth <= 3 (the tree pool's candidates), kept as depths change."""
        self.regions = {n: model.region_of(n) for n in model.node_ids}
        self.roles = {n: model.node(n).role for n in model.node_ids}
        self._detached: set[str] = set()
        """Tops detached during a change, until placed: their subtrees are loose (not candidates)."""
        self._above: dict[str, str | None] = {}
        """Per node seen during a change: the detached top above it (None: attached); see _is_loose."""
        self._table = NodeTable(model)
        self._touched = 0
        self._depth_moved: dict[str, int] = {}
        """Nodes whose depth changed during the current change, with their depth before it."""
        self._walk(self.root)
        ups, ix = self._table.up, self._table.ix
        self.fb = LiveFallbacks(plan.fallbacks, self.parents, self.depth, self.regions, lambda n: ups[ix[n]])
        self._touched = 0

    # ---- the changes ------------------------------------------------------------------------

    def fail(self, node: str) -> Change:
        """``node`` failed or left: its children (with their subtrees) are placed again."""
        return self.leave([node])

    def leave(self, nodes: Iterable[str]) -> Change:
        gone = [n for n in dict.fromkeys(nodes) if n in self.parents]
        if self.root in gone:
            raise ValueError("the trainer cannot leave the plan")
        return self._snapshot(self._apply(self.model.without_nodes(gone), gone, [], set()))


    def partition(self, region: str) -> Change:
        """Every node of ``region`` became unreachable: they leave; nodes fed through them are placed again."""
        if self.model.region_of(self.root) == region:
            raise ValueError("the trainer's own region cannot be partitioned off")
        return self.leave(self.model.nodes_in(region))

    def join(self, spec: NodeSpec, links: Iterable[Measurement] = ()) -> Change:
        """``spec`` joined (or came back): it is placed under the best offer; nobody else moves."""
        return self.join_many([spec], links)

    def join_many(self, specs: list[NodeSpec], links: Iterable[Measurement] = ()) -> Change:
        """Several members joined at once, placed in the order given as :meth:`join` places one; the
        model grows once (a copy of it per joiner cost ~0.1 s each at 100,000 nodes under churn)."""
        return self.leave_and_join([], specs, links)

    def leave_and_join(self, nodes: Iterable[str], specs: list[NodeSpec], links: Iterable[Measurement] = ()) -> Change:
        """:meth:`leave` of ``nodes``, then :meth:`join_many` of ``specs`` (``links`` may name both kinds'
        survivors and the joiners), handing out one plan: the tree, estimate, fallbacks and epoch
        (one more per step that ran) are those of the two calls, and ``moved`` is their union. A
        member in both leaves and comes back (a new region or role). Checked before anything changes."""
        named = list(dict.fromkeys(nodes))
        gone = [n for n in named if n in self.parents]
        if self.root in gone:
            raise ValueError("the trainer cannot leave the plan")
        ids = [s.id for s in specs]
        gone_set = set(gone)
        taken = [i for i in ids if i in self.model and i not in gone_set]
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"{(taken or ids)[0]!r} is already in the plan (or given twice)")
        if not specs and not named:
            raise ValueError("join_many needs at least one node")
        links = list(links)
        self._touched = 0
        moved: frozenset[str] = frozenset()
        if named:  # (as leave(): a step even when none of them is planned)
            moved = self._apply(self.model.without_nodes(gone), gone, [], set())
        touched = self._touched
        if specs:
            moved |= self._apply(self.model.with_nodes(specs, links), [], ids, set())
        self._touched += touched
        return self._snapshot(moved)

    def link_changed(self, src: str, dst: str, bandwidth_bps: float, rtt_s: float | None = None) -> Change:
        """The pair ``src -> dst`` was measured again. If it is a plan edge, ``dst`` (with its subtree)
        is placed again, its current parent among the candidates: it moves only to a better offer."""
        rtt = self.model.rtt(src, dst) if rtt_s is None else rtt_s
        model = self.model.with_links([Measurement(src, dst, bandwidth_bps, rtt)])
        self._table.measured(src, dst)
        if self.parents.get(dst) != src:
            self.model = model  # not a plan edge: the tree and its estimate are unchanged
            self._touched = 0
            self._settle(set())
            return self._snapshot(frozenset())
        return self._snapshot(self._apply(model, [], [], {dst}))

    # ---- machinery --------------------------------------------------------------------------

    def _apply(self, model: NetworkModel, gone: list[str], joined: list[str], replace: set[str]) -> frozenset[str]:
        """One change (a step of the public methods): the tree, estimate and fallbacks updated and the
        epoch advanced; the nodes it moved. The plan is handed out by :meth:`_snapshot`."""
        self._touched = 0
        self._depth_moved = {}
        gone_set = set(gone)
        changed_regions = {self.regions[g] for g in gone}
        old_parent: dict[str, str] = {}
        anchor: dict[str, str] = {}  # a top's nearest surviving ancestor: one of its candidates
        stale: set[str] = set()  # edges (by child) whose share must be recomputed
        # Detach with the old model (it still knows the regions of the nodes that leave).
        for g in gone:
            for c in self.children[g]:
                if c not in gone_set:
                    old_parent[c] = g
                    a = self.parents[g]
                    while a in gone_set:
                        a = self.parents[a]
                    anchor[c] = a
        for n in replace:
            old_parent[n] = anchor[n] = self.parents[n]
        for t in old_parent:
            stale |= self._detach(t)
        for g in gone:
            stale |= self._detach(g)
        for g in gone:
            self.fb.leave(g)
            for c in self.children.pop(g):
                self.parents.pop(c)
                self._count_edge(c, g, -1)
            for d in (self.share, self.rate, self.eta, self.pipe, self.lat, self.depth, self.regions, self.roles):
                d.pop(g, None)
            self._shallow.discard(g)
        self.model = model
        for j in joined:
            self.children[j] = []
            self.regions[j], self.roles[j] = model.region_of(j), model.node(j).role
        if joined:
            self._table.add(model, [*joined, *(x for j in joined for x in self._measured_peers(model, j))])
        tops = [*old_parent, *joined]
        self._detached, self._above = set(tops), {}
        self._refresh(stale - gone_set)
        placed = self._place(tops, anchor)
        self._detached, self._above = set(), {}
        moved = frozenset(t for t, p in old_parent.items() if placed[t] != p)
        # Fallbacks are recomputed where the grandparent changed (the placed tops and their children)
        # or a fallback left, and wherever the contract no longer holds (LiveFallbacks.broken).
        redo: set[str] = set()
        for t in placed:
            redo.add(t)
            redo.update(self.children[t])
        for n in gone:
            redo |= self.fb.pop_users(n)
        changed = [*self._depth_moved, *joined]
        changed_regions.update(self.regions[n] for n in changed)
        self.fb.invalidate(changed_regions, gone_set, changed, self.depth)
        redo |= self.fb.broken(self._depth_moved, self.depth, self.parents, redo | gone_set)
        self._settle(redo - gone_set)
        return moved

    def _settle(self, redo: set[str]) -> None:
        self._touched += self.fb.rank(redo, self.model, self.parents, self.depth, self._shallow, self.children,
                                      self.cfg.fallbacks)
        self.epoch += 1

    def _snapshot(self, moved: frozenset[str]) -> Change:
        plan = Plan(
            # dict.copy, not dict(): these dicts have deleted slots, which make dict() insert key by
            # key (at 100,000 nodes ~15 ms a dict against ~1 ms).
            root=self.root, parents=self.parents.copy(), edge_bps=self.share.copy(), eta_s=self.eta.copy(),
            est_completion_s=max(self.eta.values()), fallbacks=self.fb.of.copy(),
            regions=self.regions.copy(), roles=self.roles.copy(),
            payload_bytes=self.cfg.payload_bytes, chunk_bytes=self.cfg.chunk_bytes, epoch=self.epoch,
        )
        return Change(plan, moved, self._touched)

    def _count_edge(self, c: str, p: str, sign: int) -> set[str]:
        """Count edge ``p -> c`` on its pipe; the other edges of that pipe change share."""
        a, b = self.model.region_of(p), self.model.region_of(c)
        if a == b:
            return set()
        key = (a, b)
        self.flows[key] = self.flows.get(key, 0) + sign
        edges = self.pipe_edges.setdefault(key, set())
        if sign > 0:
            edges.add(c)
        else:
            edges.discard(c)
        return set(edges) if self.model.link_capacity(a, b) is not None else set()

    def _detach(self, c: str) -> set[str]:
        p = self.parents.pop(c)
        self.children[p].remove(c)
        return self._count_edge(c, p, -1) | set(self.children[p])

    def _attach(self, c: str, p: str) -> set[str]:
        self.parents[c] = p
        self.children[p].append(c)
        return self._count_edge(c, p, +1) | set(self.children[p])

    def _refresh(self, edges: set[str]) -> set[str]:
        """Recompute the shares of ``edges`` (by child) and the path quantities below them; the nodes
        walked (a node not walked kept its figures)."""
        live = [c for c in edges if c in self.parents and not self._is_loose(c)]
        for c in live:
            self.share[c] = edge_share(self.model, self.children, self.parents[c], c, self.flows)
        live.sort(key=lambda c: self.depth[self.parents[c]])
        done: set[str] = set()
        for c in live:
            if c not in done:
                done |= self._walk(c)
        return done

    def _walk(self, top: str) -> set[str]:
        """Path quantities of ``top`` (from its parent's; the root's are fixed) and everything below."""
        m, bits = self.model, self.cfg.payload_bytes * 8.0
        cbits = min(self.cfg.chunk_bytes, self.cfg.payload_bytes) * 8.0
        order = [top]
        for n in order:
            if n != self.root:
                p = self.parents[n]
                s = self.share.get(n)
                if s is None:
                    s = self.share[n] = edge_share(m, self.children, p, n, self.flows)
                r = min(self.rate[p], s)
                pipe, lat, depth = self.pipe[p] + cbits / s, self.lat[p] + m.rtt(p, n) / 2, self.depth[p] + 1
                if n != top and self.rate.get(n) == r and self.pipe.get(n) == pipe and self.lat.get(n) == lat \
                        and self.depth.get(n) == depth:
                    continue  # nothing changed on its path: its subtree keeps its figures
                was = self.depth.get(n)
                if was is not None and was != depth:
                    self._depth_moved[n] = was
                self.rate[n], self.pipe[n], self.lat[n], self.depth[n] = r, pipe, lat, depth
                if depth <= 3:
                    self._shallow.add(n)
                else:
                    self._shallow.discard(n)
                self.eta[n] = bits / r + pipe - cbits / r + lat
            order.extend(self.children[n])
        self._touched += len(order)
        return set(order)

    def _is_loose(self, n: str) -> bool:
        """Whether ``n`` hangs below a detached top. Each node's top is found once per change (a walk
        up, remembered for every node on it); placing a top attaches every node remembered below it."""
        above, path = self._above, []
        while n not in above:
            p = self.parents.get(n)
            if p is None:  # the root, or a detached top
                above[n] = None if n == self.root else n
                break
            path.append(n)
            n = p
        top = above[n]
        for x in path:
            above[x] = top
        return top is not None and top in self._detached

    @staticmethod
    def _measured_peers(model: NetworkModel, n: str) -> list[str]:
        return [x for x in model.node_ids if model.is_measured(n, x) or model.is_measured(x, n)] \
            if model.has_measurements(n) else []

    # ---- placement (as topology.replan) -----------------------------------------------------

    def _offer(self, u: str, v: str) -> float:
        m = self.model
        su = m.node(u)
        s = min(m.bandwidth(u, v), su.uplink_bps / (len(self.children[u]) + 1), m.node(v).downlink_bps)
        a, b = su.region, m.region_of(v)
        cap = m.link_capacity(a, b) if a != b else None
        if cap is not None:
            s = min(s, cap / (self.flows.get((a, b), 0) + 1))
        return min(self.rate[u], s)

    def _harms(self, u: str) -> bool:
        share = self.model.node(u).uplink_bps / (len(self.children[u]) + 1)
        return any(share < self.rate[c] * 0.999 for c in self.children[u])

    def _candidates(self, region: str, old_region: str | None) -> tuple[list[str], bool]:
        """Attached nodes with a free slot in ``region``; if none, the sources (the root and the nodes
        entering a region) and the machines of ``old_region`` (where the top used to be fed from).
        The flag says whether they are the first kind (nodes of ``region`` only)."""
        m, cap, loose = self.model, self.cfg.max_degree, self._is_loose
        cands = [u for u in m.nodes_in(region) if len(self.children[u]) < cap and not loose(u)]
        if cands:
            return cands, True
        sources = [self.root] + [c for es in self.pipe_edges.values() for c in es]
        near = m.nodes_in(old_region) if old_region is not None else []
        return [u for u in (*sources, *near) if u in self.depth and len(self.children[u]) < cap
                and not loose(u)] or [self.root], False

    def _best(self, top: str, anchor: dict[str, str], old_regions: dict[str, str],
              groups: dict[tuple[str, str | None], tuple[list[str], bool]]
              ) -> tuple[tuple[Key, str], frozenset[str] | None]:
        """The best parent for ``top`` and its key, and the regions whose nodes that choice read (None:
        nodes of any region); ``groups`` caches candidate lists until a placement."""
        g = (self.regions[top], old_regions.get(top))
        got = groups.get(g)
        if got is None:
            got = groups[g] = self._candidates(*g)
        cands, local = got
        best = self._table.best(self.model, cands, top, self.children, self.rate, self.depth, self.flows,
                                self._harms)
        a = anchor.get(top)
        if a is not None and a in self.depth and len(self.children[a]) < self.cfg.max_degree:
            best = max(best, (self._key(a, top), a))
        return best, (frozenset((g[0], self.regions[a] if a is not None and a in self.regions else g[0]))
                      if local else None)

    def _key(self, u: str, top: str) -> Key:
        return (not self._harms(u), self._offer(u, top), -self.depth[u], self.model.node(u).uplink_bps / (len(self.children[u]) + 1), u)

    def _place(self, tops: list[str], anchor: dict[str, str]) -> dict[str, str]:
        """Attach ``tops`` (with their subtrees) one at a time; see the module docstring."""
        m = self.model
        # The region each top's old parent was in: a region with nothing attached is fed from there.
        old_regions = {t: self.regions.get(a, "") for t, a in anchor.items()}
        remaining = sorted(tops, key=lambda n: (-m.node(n).uplink_bps, n))
        placed: dict[str, str] = {}
        # Each top's best parent is kept from one placement to the next unless the placement touched
        # a region that choice read: a placement changes the children, rates and depths only of nodes
        # it walked, of the new parent, and of the placed subtree (which becomes candidates), and the
        # flows only of a pipe into the placed top's region. Without this a join of k members scored
        # every region candidate k^2 / 2 times (~0.3 s a round at 100,000 members under churn).
        memo: dict[str, tuple[tuple[Key, str], frozenset[str]]] = {}

        def best_of(t: str) -> tuple[Key, str]:
            hit = memo.get(t)
            if hit is not None:
                return hit[0]
            b, reads = self._best(t, anchor, old_regions, groups)
            if reads is not None:
                memo[t] = (b, reads)
            return b

        while remaining:
            groups: dict[tuple[str, str | None], tuple[list[str], bool]] = {}
            if len(remaining) <= _PRIM_TOPS:
                # Few tops (a failure): best offer first, so a promoted entry is in place before its
                # region's other orphans; equal offers go to the top with the most uplink.
                best = max(((best_of(t), t) for t in remaining),
                           key=lambda x: (x[0][0], m.node(x[1]).uplink_bps, x[1]))
                (_, parent), top = best
            else:
                top = remaining[0]
                (_, parent), _ = self._best(top, anchor, old_regions, groups)
            remaining.remove(top)
            placed[top] = parent
            self._detached.discard(top)
            walked = self._refresh(self._attach(top, parent) | {top})
            if memo:
                regions = self.regions
                hit = {regions[n] for n in walked} | {regions[parent]} | self._subtree_regions(top)
                for t in [t for t, (_, reads) in memo.items() if not reads.isdisjoint(hit)]:
                    del memo[t]
        return placed

    def _subtree_regions(self, top: str) -> set[str]:
        """Regions of the nodes in ``top``'s subtree (the part a placement attaches)."""
        children, regions = self.children, self.regions
        out, todo = set(), [top]
        while todo:
            n = todo.pop()
            out.add(regions[n])
            todo.extend(children[n])
        return out


__all__ = ["Change", "Replanner"]
