"""Array views of a model and the completion estimate over arrays (numpy).

The estimate of :mod:`topology.tree` walks the tree node by node; at 100,000
nodes that walk, not the arithmetic, is the cost. Here the same formulas run
on arrays: nodes get indices (:class:`ModelArrays`, built once per model), a
tree is laid out breadth first so that each depth is one contiguous block,
and the path quantities (rate, chunk times, delay) are propagated one depth
at a time. Every element goes through the same floating-point operations in
the same order as the scalar walk, so the figures are identical, not merely
close.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from topology.model import NetworkModel

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class ModelArrays:
    """Per-node figures of one model as arrays, indexed by position in ``model.node_ids``."""

    def __init__(self, model: NetworkModel) -> None:
        self.ids = model.node_ids
        self.idx = {n: i for i, n in enumerate(self.ids)}
        names = model.region_names()
        self.region_idx = {r: i for i, r in enumerate(names)}
        k = len(names)
        self.up = np.array([model.node(n).uplink_bps for n in self.ids], dtype=np.float64)
        self.down = np.array([model.node(n).downlink_bps for n in self.ids], dtype=np.float64)
        self.reg = np.array([self.region_idx[model.region_of(n)] for n in self.ids], dtype=np.int64)
        self.region_bw = np.array([[model.region_bandwidth(a, b) for b in names] for a in names], dtype=np.float64).reshape(k, k)
        self.region_rtt = np.array([[model.region_rtt(a, b) for b in names] for a in names], dtype=np.float64).reshape(k, k)
        caps = [[model.link_capacity(a, b) for b in names] for a in names]
        self.cap = np.array([[math.inf if c is None else c for c in row] for row in caps], dtype=np.float64).reshape(k, k)
        self.measured = np.array([model.has_measurements(n) for n in self.ids], dtype=bool)


def arrays_of(model: NetworkModel) -> ModelArrays:
    """The (cached) :class:`ModelArrays` of ``model``; a model is read-only, so the cache never goes stale."""
    got = getattr(model, "_arrays_cache", None)
    if got is None:
        got = ModelArrays(model)
        model._arrays_cache = got  # type: ignore[attr-defined]
    assert isinstance(got, ModelArrays)
    return got


def pair_figures(model: NetworkModel, a: ModelArrays, p: I64, c: I64) -> tuple[F64, F64]:
    """Bandwidth and RTT of the pairs ``p[i] -> c[i]`` (node indices), as ``model.bandwidth``/``rtt`` answer."""
    rp, rc = a.reg[p], a.reg[c]
    bw = np.minimum(np.minimum(a.up[p], a.down[c]), a.region_bw[rp, rc])
    rtt = a.region_rtt[rp, rc]
    hit = np.flatnonzero(a.measured[p] & a.measured[c])
    if hit.size:
        bw = bw.copy()
        rtt = rtt.copy()
        ids = a.ids
        for i in hit.tolist():
            u, v = ids[int(p[i])], ids[int(c[i])]
            if model.is_measured(u, v):
                bw[i] = model.bandwidth(u, v)
                rtt[i] = model.rtt(u, v)
    return bw, rtt


@dataclass
class Layout:
    """A forest laid out breadth first: ``nodes[j]`` (node indices), ``parent[j]`` (position of its
    parent, -1 for a top) and ``levels`` (start of each depth's block, then the end)."""

    nodes: I64
    parent: I64
    levels: list[int]


def layout(a: ModelArrays, children: Mapping[str, Sequence[str]], tops: Sequence[str],
           keep: set[str] | None = None) -> Layout:
    """Breadth-first layout below ``tops`` (children in list order), visiting only ``keep`` when given."""
    idx = a.idx
    order: list[str] = list(tops)
    parent = [-1] * len(order)
    levels = [0]
    start, end = 0, len(order)
    while start < end:
        levels.append(end)
        for j in range(start, end):
            for c in children.get(order[j], ()):
                if keep is None or c in keep:
                    order.append(c)
                    parent.append(j)
        start, end = end, len(order)
    return Layout(np.fromiter((idx[n] for n in order), dtype=np.int64, count=len(order)),
                  np.array(parent, dtype=np.int64), levels)


@dataclass
class Paths:
    """Per position of a :class:`Layout`: the edge share into it and the path quantities of the estimate."""

    share: F64
    rate: F64
    pipe: F64
    lat: F64
    eta: F64


def propagate(model: NetworkModel, a: ModelArrays, lay: Layout, n_children: F64, flows: F64 | None,
              payload_bytes: int, chunk_bytes: int, top_rate: F64, top_pipe: F64, top_lat: F64) -> Paths:
    """The estimate of :mod:`topology.tree` down ``lay`` (tops start from the given path quantities).

    ``n_children[i]`` is node ``i``'s number of children (its uplink's divisor); ``flows[ra, rb]``
    the number of plan edges on each inter-region pipe (None: every pipe counts one flow).
    """
    bits, cbits = payload_bytes * 8.0, min(chunk_bytes, payload_bytes) * 8.0
    n, ntop = len(lay.nodes), lay.levels[1] if len(lay.levels) > 1 else len(lay.nodes)
    share = np.full(n, np.inf)
    rate, pipe, lat = np.empty(n), np.empty(n), np.empty(n)
    rate[:ntop], pipe[:ntop], lat[:ntop] = top_rate, top_pipe, top_lat
    if n > ntop:
        pp = lay.parent[ntop:]
        p, c = lay.nodes[pp], lay.nodes[ntop:]
        bw, rtt = pair_figures(model, a, p, c)
        s = np.minimum(np.minimum(bw, a.up[p] / np.maximum(1.0, n_children[p])), a.down[c])
        rp, rc = a.reg[p], a.reg[c]
        cross = np.flatnonzero((rp != rc) & np.isfinite(a.cap[rp, rc]))
        if cross.size:
            k = np.ones(cross.size) if flows is None else np.maximum(1.0, flows[rp[cross], rc[cross]])
            s[cross] = np.minimum(s[cross], a.cap[rp[cross], rc[cross]] / k)
        share[ntop:] = s
        half = rtt / 2
        for lo, hi in zip(lay.levels[1:-1], lay.levels[2:]):
            q = lay.parent[lo:hi]
            e = share[lo:hi]
            rate[lo:hi] = np.minimum(rate[q], e)
            pipe[lo:hi] = pipe[q] + cbits / e
            lat[lo:hi] = lat[q] + half[lo - ntop:hi - ntop]
    eta = bits / rate + pipe - cbits / rate + lat
    return Paths(share, rate, pipe, lat, eta)


def pipe_flow_matrix(a: ModelArrays, lay: Layout) -> F64:
    """Number of plan edges on each inter-region pipe of the laid-out tree."""
    k = a.region_bw.shape[0]
    ntop = lay.levels[1] if len(lay.levels) > 1 else len(lay.nodes)
    rp, rc = a.reg[lay.nodes[lay.parent[ntop:]]], a.reg[lay.nodes[ntop:]]
    out = np.zeros((k, k))
    cross = rp != rc
    np.add.at(out, (rp[cross], rc[cross]), 1.0)
    return out


def child_counts(a: ModelArrays, lay: Layout) -> F64:
    ntop = lay.levels[1] if len(lay.levels) > 1 else len(lay.nodes)
    return np.bincount(lay.nodes[lay.parent[ntop:]], minlength=len(a.ids)).astype(np.float64)


__all__ = ["Layout", "ModelArrays", "Paths", "arrays_of", "child_counts", "layout", "pair_figures",
           "pipe_flow_matrix", "propagate"]
