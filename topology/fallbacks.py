"""The parents a node fails over to, ranked, and which nodes a new plan moves.

Pure: a finished tree in, lists out (:func:`topology.planner.finish_plan` and the re-planners
call :func:`rank_fallbacks` and :func:`rank_one`; the coordinator gossips :func:`moved_nodes`).
:class:`LiveFallbacks` keeps them current under :class:`topology.incremental.Replanner`'s changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from topology.model import NetworkModel
from topology.tree import Plan, children_of, depths_of

_FALLBACK_POOL = (8, 4)
"""Fallback candidates considered per node: the shallowest machines of its region, then of the tree."""
# Shallowest nodes of the whole tree kept as LiveFallbacks' pool (rank_one takes 4 of them).
_TREE_POOL = 64
# Shallowest nodes of a region kept as LiveFallbacks' pool (rank_one takes 8 of them).
_REGION_POOL = 64


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


class LiveFallbacks:
    """Every node's fallbacks kept true to a tree that changes one event at a time.

    ``of`` maps each non-root node to its fallbacks (best first, as :func:`rank_fallbacks`
    ranks them) and ``users`` each node to the nodes naming it. The pools :func:`rank_one`
    draws from (per region its shallowest nodes, and the tree's shallowest) are kept between
    changes; the owner drops those a change may alter (:meth:`invalidate`), and they are
    rebuilt when next used.
    """

    def __init__(self, initial: Mapping[str, list[str]], nodes: Iterable[str], depth: Mapping[str, int],
                 regions: Mapping[str, str], uplink: Callable[[str], float]) -> None:
        self.of: dict[str, list[str]] = {n: list(initial.get(n, [])) for n in nodes}
        self.users: dict[str, set[str]] = {}
        for n, fbs in self.of.items():
            for f in fbs:
                self.users.setdefault(f, set()).add(n)
        self._pools: dict[str, list[str]] = {}
        """Per region, its shallowest nodes (fallback candidates); dropped when a node of it moves."""
        self._tree_pool: list[str] | None = None
        """The shallowest nodes of the tree; dropped when a node at depth <= 3 moves, leaves or joins."""
        # The pools of every region, in one pass (a change then rebuilds only those it touches).
        for n in sorted(depth, key=lambda n: (depth[n], -uplink(n), n)):
            pool = self._pools.setdefault(regions[n], [])
            if len(pool) < _REGION_POOL:
                pool.append(n)

    def leave(self, node: str) -> None:
        """``node`` left: it no longer uses its fallbacks (a later depth change of one of them must
        not check it: it did, and failed on the missing node, after many changes)."""
        for f in self.of.get(node, ()):
            self.users.get(f, set()).discard(node)
        self.of.pop(node, None)

    def pop_users(self, node: str) -> set[str]:
        """The nodes naming ``node`` (which left), forgotten here: their fallbacks must be ranked again."""
        return self.users.pop(node, set())

    def invalidate(self, regions: Iterable[str], gone: set[str], changed: Iterable[str],
                   depth: Mapping[str, int]) -> None:
        """Drop the pools of ``regions`` and, where a node left from it or one of ``changed`` (nodes
        whose depth changed, and joiners) is or was in it, the tree's."""
        for r in regions:
            self._pools.pop(r, None)
        pool = set(self._tree_pool or ())
        if gone & pool or any(depth[n] <= 3 or n in pool for n in changed):
            self._tree_pool = None

    def broken(self, depth_moved: Mapping[str, int], depth: Mapping[str, int], parents: Mapping[str, str],
               skip: set[str]) -> set[str]:
        """Nodes (outside ``skip``) whose fallbacks no longer keep the contract (each shallower than the
        node, not its parent) after the depths of ``depth_moved`` (node -> depth before) changed: the
        nodes that got shallower and the users of a node whose depth changed are checked, and most pass
        (a subtree that moves up keeps its fallbacks when they moved up with it)."""
        check: set[str] = set()
        for n, was in depth_moved.items():
            if depth[n] < was:
                check.add(n)
            check |= self.users.get(n, set())
        out: set[str] = set()
        for n in check - skip:
            dn, p = depth[n], parents[n]
            if any(f == p or depth.get(f, dn) >= dn for f in self.of.get(n, ())):
                out.add(n)
        return out

    def rank(self, nodes: set[str], model: NetworkModel, parents: Mapping[str, str], depth: Mapping[str, int],
             shallow: Iterable[str], children: Mapping[str, list[str]], k: int) -> int:
        """Rank the fallbacks of ``nodes`` again (``shallow``: the nodes at depth <= 3); how many were."""
        if not nodes or k == 0:
            return 0
        up = _Uplinks(model)
        if self._tree_pool is None:
            self._tree_pool = sorted(shallow, key=lambda n: (depth[n], -up[n], n))[:_TREE_POOL]
        pools = self._pools
        # Siblings without measured links share region, depth, parent, grandparent and usually the
        # downlink, and so their ranking (as rank_fallbacks memoises it).
        memo: dict[tuple[str, int, str, str | None, float], list[str]] = {}
        for v in nodes:
            if v not in parents:
                continue
            r = model.region_of(v)
            if r not in pools:
                pools[r] = sorted((n for n in model.nodes_in(r) if n in depth),
                                  key=lambda n: (depth[n], -up[n], n))[:_REGION_POOL]
            for f in self.of.get(v, []):
                self.users.get(f, set()).discard(v)
            p = parents[v]
            gp = parents.get(p)
            key = None if model.has_measurements(v) else (r, depth[v], p, gp, model.node(v).downlink_bps)
            fbs = memo.get(key) if key is not None else None
            if fbs is None:
                fbs = rank_one(model, v, p, gp, depth, pools[r], self._tree_pool, up, children, k)
                if key is not None:
                    memo[key] = fbs
            fbs = list(fbs)
            self.of[v] = fbs
            for f in fbs:
                self.users.setdefault(f, set()).add(v)
        return len(nodes)


class _Uplinks(dict[str, float]):
    """Uplinks looked up on demand (``rank_one`` reads a few)."""

    def __init__(self, model: NetworkModel) -> None:
        super().__init__()
        self.model = model

    def __missing__(self, n: str) -> float:
        v = self.model.node(n).uplink_bps
        self[n] = v
        return v
