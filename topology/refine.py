"""Local search that polishes a finished tree, scored by the completion-time estimate.

The constructive planner (:mod:`topology.planner`) decides region by region
and only ever uses region entries as sources of an inter-region hop, so it
can miss a path that combines particular fast machine pairs (measured links
differ from machine to machine). This module takes its tree and tries small
changes on the *critical path* (the path from the root to the node that
finishes last), keeping the best one while the estimate drops:

- **move**: a node on the critical path, with its subtree, pulls from another
  node (one outside its subtree with a free slot);
- **re-root**: a node ``v`` that enters its region (its parent is in another
  region) hands that role to a machine ``w`` of its subtree in the same
  region: ``w`` pulls from some node outside the subtree and ``v`` pulls from
  ``w``. This is how a fast measured pair into the region is used when it
  does not end at the current entry.

Pure and deterministic. Each trial costs one estimate (one visit per node),
so the search is bounded by ``budget`` node visits: on small and medium
clusters it runs to a local optimum; when the budget buys fewer than
:data:`MIN_TRIALS` trials (ten thousand nodes with the planner's default) it
is skipped and the constructive plan stands as built. A move is taken
only when it lowers the estimated completion time, so the result is never
worse than the input; the degree limit and the tree contract hold.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from topology.model import NetworkModel
from topology.tree import Estimate, children_of, estimate, subtree

# A trial must beat the current tree by this relative margin, so float noise never loops.
_IMPROVES = 1e-9
# Fewer trials than this would test an arbitrary few of the hundreds of candidate moves: skip.
MIN_TRIALS = 32


def refine(model: NetworkModel, root: str, parents: Mapping[str, str], payload_bytes: int, chunk_bytes: int,
           max_degree: int, budget: int, more_entries: bool = True) -> dict[str, str]:
    """A tree whose estimated completion is no worse than ``parents``'; see the module docstring.

    With ``more_entries`` False no move raises the number of edges into a region from outside it.
    """
    tree = dict(parents)
    n = len(model)
    trials_left = budget // max(n, 1)
    if trials_left < MIN_TRIALS or n < 3:
        return tree
    est = estimate(model, root, tree, payload_bytes, chunk_bytes)
    current = _score(est)
    while trials_left > 0:
        best: tuple[tuple[float, float], dict[str, str], Estimate] | None = None
        for trial in _moves(model, root, tree, est, max_degree):
            if trials_left <= 0:
                break
            if not more_entries and _entries_added(model, tree, trial):
                continue
            trials_left -= 1
            e = estimate(model, root, trial, payload_bytes, chunk_bytes)
            s = _score(e)
            if best is None or s < best[0]:
                best = (s, trial, e)
        if best is None or not best[0][0] < current[0] * (1 - _IMPROVES):
            break
        current, tree, est = best
    return tree


def _score(e: Estimate) -> tuple[float, float]:
    # The completion time, then the mean arrival, which prefers trees where fewer nodes
    # wait as long as the last one (ties are common: a whole region shares a bottleneck).
    return (e.completion_s, sum(e.eta_s.values()) / max(1, len(e.eta_s)))


def _entries_added(model: NetworkModel, tree: Mapping[str, str], trial: Mapping[str, str]) -> bool:
    """Whether ``trial`` has more inter-region edges into some region than ``tree`` (few edges differ)."""
    delta: dict[str, int] = {}
    for c, p in trial.items():
        old = tree[c]
        if old != p:
            r = model.region_of(c)
            delta[r] = delta.get(r, 0) + (model.region_of(p) != r) - (model.region_of(old) != r)
    return any(d > 0 for d in delta.values())


def _moves(model: NetworkModel, root: str, tree: dict[str, str], est: Estimate,
           max_degree: int) -> Iterator[dict[str, str]]:
    """Trial trees, cheapest-looking first: moves of the critical path's nodes, top down, then re-roots."""
    worst = max(est.eta_s, key=lambda x: (est.eta_s[x], x))
    path: list[str] = []
    x = worst
    while x != root:
        path.append(x)
        x = tree[x]
    path.reverse()
    children = children_of(tree, root)
    degree = {u: len(children.get(u, ())) for u in model.node_ids}
    ids = sorted(model.node_ids)
    subs = {v: subtree(children, v) for v in path}
    for v in path:
        for u in ids:
            if u not in subs[v] and u != tree[v] and degree[u] < max_degree:
                trial = dict(tree)
                trial[v] = u
                yield trial
    for v in path:
        region = model.region_of(v)
        if model.region_of(tree[v]) == region:
            continue
        heirs = sorted((w for w in subs[v] if w != v and model.region_of(w) == region),
                       key=lambda w: (-model.node(w).uplink_bps, w))
        for w in heirs:
            if degree[w] >= max_degree:  # w gains v as a child
                continue
            for u in ids:
                if u in subs[v] or degree[u] >= max_degree:
                    continue
                trial = dict(tree)
                trial[w] = u
                trial[v] = w
                yield trial


__all__ = ["refine"]
