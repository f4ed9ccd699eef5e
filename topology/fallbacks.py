"""The parents a node fails over to, ranked, and which nodes a new plan moves.

Pure: a finished tree in, lists out (:func:`topology.planner.finish_plan` and the re-planners
call :func:`rank_fallbacks` and :func:`rank_one`; the coordinator gossips :func:`moved_nodes`).
"""

from __future__ import annotations

from collections.abc import Mapping

from topology.model import NetworkModel
from topology.tree import Plan, children_of, depths_of

_FALLBACK_POOL = (8, 4)
"""Fallback candidates considered per node: the shallowest machines of its region, then of the tree."""


def rank_fallbacks(model: NetworkModel, root: str, parents: Mapping[str, str], k: int,
                   children: Mapping[str, list[str]] | None = None) -> dict[str, list[str]]:
    """For each node, up to ``k`` nodes to fail over to, best first.

    Candidates have a smaller depth than the node and are not its parent, so
    they are never in the node's subtree and nodes that fail over at the same
    time cannot form a cycle. The grandparent comes first (it just lost a
    child, so it has a free slot on the path the data already takes); the
    others are the shallowest, strongest machines of the node's region and
    of the whole tree, ranked by the share they could give (pair bandwidth,
    uplink divided among one more child), then depth.
    """
    if k == 0:
        return {n: [] for n in parents}
    children = children if children is not None else children_of(parents, root)
    depth = depths_of(parents, root)
    up = {n: model.node(n).uplink_bps for n in depth}
    shallow_first = sorted(depth, key=lambda n: (depth[n], -up[n], n))
    pool: dict[str, list[str]] = {}
    for n in shallow_first:
        pool.setdefault(model.region_of(n), []).append(n)
    out: dict[str, list[str]] = {}
    # A node without measured links ranks by its region, depth, parent, grandparent and downlink
    # alone (siblings usually share all five): rank once per such key.
    memo: dict[tuple[str, int, str, str | None, float], list[str]] = {}
    for v, p in parents.items():
        spec = model.node(v)
        gp = parents.get(p)
        key = None if model.has_measurements(v) else (spec.region, depth[v], p, gp, spec.downlink_bps)
        if key is not None:
            hit = memo.get(key)
            if hit is not None:
                out[v] = list(hit)
                continue
        out[v] = rank_one(model, v, p, gp, depth, pool[spec.region], shallow_first, up, children, k)
        if key is not None:
            memo[key] = out[v]
    return out


def rank_one(model: NetworkModel, v: str, p: str, gp: str | None, depth: Mapping[str, int],
             region_pool: list[str], tree_pool: list[str], up: Mapping[str, float],
             children: Mapping[str, list[str]], k: int) -> list[str]:
    """One node's fallbacks (see :func:`rank_fallbacks`): pools are shallowest first."""
    d = depth[v]
    cands: list[str] = []
    for source, limit in zip((region_pool, tree_pool), _FALLBACK_POOL):
        taken = 0
        for u in source:
            if depth[u] >= d or taken >= limit:
                break
            if u != p and u not in cands:
                cands.append(u)
                taken += 1
    if gp is not None and gp not in cands:
        cands.append(gp)
    ranked = sorted(
        cands,
        key=lambda u: (u != gp, -min(model.bandwidth(u, v), up[u] / (1 + len(children.get(u, ())))), depth[u], u),
    )
    return ranked[:k]


def moved_nodes(old: Plan, new: Plan) -> list[str]:
    """Nodes present in both plans whose parent differs."""
    return [n for n, p in new.parents.items() if n in old.parents and old.parents[n] != p]
