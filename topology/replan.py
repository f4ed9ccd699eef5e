"""Re-planning after nodes join, leave or fail, moving as few nodes as possible.

Contract of :func:`replan`: every node present in both the old plan and the
new model keeps its parent when that parent is still present (a subtree whose
top lost its parent moves as a whole: only its top gets a new parent).
Nodes that lost their parent and nodes that joined are placed one at a time,
strongest first, under the attached node that offers them the best rate. So
when a region's entry leaves, its strongest orphan takes the entry's place
(it attaches to the entry's old parent, the only good offer) and the other
orphans attach below it. The one exception is ``rebuild_factor``: when the
repaired tree is estimated that much slower than a fresh plan, the fresh
plan is returned instead (a deliberate, large move).
"""

from __future__ import annotations

import math
from topology.model import NetworkModel
from topology.planner import PlannerConfig, finish_plan, plan
from topology.tree import Plan, bfs_order, children_of, estimate, subtree


def replan(old: Plan, model: NetworkModel, config: PlannerConfig | None = None,
           rebuild_factor: float | None = 1.5) -> Plan:
    """A plan for ``model`` that changes as few parents of ``old`` as it can; epoch ``old.epoch + 1``."""
    cfg = config or PlannerConfig(
        payload_bytes=old.payload_bytes or PlannerConfig.payload_bytes,
        chunk_bytes=old.chunk_bytes or PlannerConfig.chunk_bytes,
    )
    epoch = old.epoch + 1
    root = model.trainer
    if root != old.root:
        return plan(model, cfg, epoch)
    present = set(model.node_ids)
    parents = {c: p for c, p in old.parents.items() if c in present and p in present}
    children = children_of(parents, root)
    for n in present:
        children.setdefault(n, [])
    attached = set(bfs_order(children, root))
    # Detached tops: survivors whose parent left, and joiners. Their subtrees travel with them.
    tops = [n for n in present if n != root and n not in attached and n not in parents]
    # The nearest surviving ancestor of each departed parent: where a promoted orphan goes.
    anchor: dict[str, str] = {}
    for n in tops:
        p = old.parents.get(n)
        while p is not None and p not in present:
            p = old.parents.get(p)
        if p is not None:
            anchor[n] = p

    est = estimate(model, root, {c: parents[c] for c in attached if c != root}, cfg.payload_bytes, cfg.chunk_bytes)
    rate = dict(est.rate_bps)
    flows: dict[tuple[str, str], int] = {}
    for c in attached:
        if c != root:
            a, b = model.region_of(parents[c]), model.region_of(c)
            if a != b:
                flows[(a, b)] = flows.get((a, b), 0) + 1
    by_region: dict[str, list[str]] = {}
    for n in attached:
        by_region.setdefault(model.region_of(n), []).append(n)
    for ids in by_region.values():
        ids.sort()

    def offer(u: str, v: str) -> float:
        su = model.node(u)
        s = min(model.bandwidth(u, v), su.uplink_bps / (len(children[u]) + 1), model.node(v).downlink_bps)
        a, b = su.region, model.region_of(v)
        cap = model.link_capacity(a, b) if a != b else None
        if cap is not None:
            s = min(s, cap / (flows.get((a, b), 0) + 1))
        return min(rate[u], s)

    depth = {root: 0}
    for n in bfs_order(children, root):
        for c in children[n]:
            depth[c] = depth[n] + 1
    # Nodes that feed a region from outside it (and the root): candidates for a top whose
    # region has nothing attached, instead of scanning every attached node.
    sources = {n for n in attached if n == root or model.region_of(parents[n]) != model.region_of(n)}

    def choose(top: str) -> tuple[tuple[bool, float, int, float, str], str]:
        region = model.region_of(top)
        cands = [u for u in by_region.get(region, ()) if len(children[u]) < cfg.max_degree]
        if not cands:
            # Also the machines of the region it used to be fed from: the one that replaced
            # its departed parent is there.
            old_parent = old.parents.get(top)
            near = by_region.get(old.regions.get(old_parent, ""), []) if old_parent is not None else []
            cands = [u for u in (*sources, *near) if len(children[u]) < cfg.max_degree] or [root]
        if top in anchor and len(children[anchor[top]]) < cfg.max_degree:
            cands.append(anchor[top])
        # First, parents that can take one more child without slowing the ones they have
        # (a saturated trainer uplink is then the last resort); then the best offer; then the
        # shallowest (fewer chunk times and delays); then the most uplink per child.
        return max(
            ((not harms(u), offer(u, top), -depth[u], model.node(u).uplink_bps / (len(children[u]) + 1), u), u)
            for u in cands
        )

    def harms(u: str) -> bool:
        share = model.node(u).uplink_bps / (len(children[u]) + 1)
        return any(share < rate[c] * 0.999 for c in children[u])

    remaining = sorted(tops, key=lambda n: (-model.node(n).uplink_bps, n))
    while remaining:
        # Few tops (a failure): place the one with the best offer first, Prim-like, so a
        # promoted entry is in place before its region's other orphans and the regions it fed.
        # Many (a wave of joiners): strongest first, one pass.
        if len(remaining) <= 32:
            # Equal offers (a region's joiners all capped by the same link) go to the joiner
            # with the most uplink, so a region is entered through its relay, not its last name.
            key, best, top = max(((*choose(t), t) for t in remaining),
                                 key=lambda c: (c[0], model.node(c[2]).uplink_bps, c[2]))
        else:
            top = remaining[0]
            key, best = choose(top)
        remaining.remove(top)
        r = key[1]
        region = model.region_of(top)
        parents[top] = best
        children[best].append(top)
        if model.region_of(best) != region:
            flows[(model.region_of(best), region)] = flows.get((model.region_of(best), region), 0) + 1
            sources.add(top)
        # The subtree comes along: its nodes become candidates for the next tops.
        for n in bfs_order(children, top):
            if n == top:
                rate[n], depth[n] = r, depth[best] + 1
            else:
                p = parents[n]
                rate[n], depth[n] = min(rate[p], rate.get(n, math.inf)), depth[p] + 1
            attached.add(n)
            by_region.setdefault(model.region_of(n), []).append(n)

    repaired = finish_plan(model, cfg, parents, epoch)
    if rebuild_factor is not None:
        fresh = plan(model, cfg, epoch)
        if repaired.est_completion_s > rebuild_factor * fresh.est_completion_s:
            return fresh
    return repaired


__all__ = ["replan"]
