"""The best parent for a detached node among many candidates, over arrays (for :mod:`topology.incremental`).

:class:`topology.incremental.Replanner` places a node that lost its parent
under the candidate with the largest key ``(does not slow its children,
offer, -depth, uplink per child, name)`` (see :func:`topology.replan.replan`).
A region has thousands of candidates, so scoring them one by one in Python
costs more than the rest of a repair. :class:`NodeTable` keeps the per-node
figures that never change for a node (uplink, downlink, region) as arrays in
an append-only numbering, so a new model (one node fewer, one more) costs
nothing here, and :meth:`NodeTable.best` scores a candidate list in a few
array operations. The figures are the same floating-point operations as the
scalar key, so it picks the same parent, ties included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from topology.model import NetworkModel

Key = tuple[bool, float, int, float, str]


class NodeTable:
    """Uplink, downlink and region of every node ever seen, and the model's region figures."""

    def __init__(self, model: NetworkModel) -> None:
        self.ix: dict[str, int] = {}
        self.names: list[str] = []
        self._up: list[float] = []
        self._down: list[float] = []
        self._reg: list[int] = []
        self._meas: list[bool] = []
        self.region_idx: dict[str, int] = {}
        self._regions(model)
        self.add(model, model.node_ids)

    def _regions(self, model: NetworkModel) -> None:
        for r in (*model.regions, *model.region_names()):
            self.region_idx.setdefault(r, len(self.region_idx))
        names = list(self.region_idx)
        k = len(names)
        self.region_bw = np.array([[model.region_bandwidth(a, b) for b in names] for a in names],
                                  dtype=np.float64).reshape(k, k)
        caps = [[model.link_capacity(a, b) for b in names] for a in names]
        self.cap = np.array([[math.inf if c is None else c for c in row] for row in caps],
                            dtype=np.float64).reshape(k, k)
        self.region_names = names

    def add(self, model: NetworkModel, ids: Sequence[str]) -> None:
        """Take ``ids`` (new or with new figures) and any new region from ``model``."""
        if any(model.region_of(n) not in self.region_idx for n in ids):
            self._regions(model)
        for n in ids:
            s = model.node(n)
            i = self.ix.get(n)
            if i is None:
                self.ix[n] = i = len(self.names)
                self.names.append(n)
                self._up.append(0.0)
                self._down.append(0.0)
                self._reg.append(0)
                self._meas.append(False)
            self._up[i], self._down[i], self._reg[i] = s.uplink_bps, s.downlink_bps, self.region_idx[s.region]
            self._meas[i] = model.has_measurements(n)
        self.up = np.array(self._up)
        self.down = np.array(self._down)
        self.reg = np.array(self._reg, dtype=np.int64)
        self.meas = np.array(self._meas, dtype=bool)

    def measured(self, *ids: str) -> None:
        """``ids`` now have measured links (their pairs are looked up in the model)."""
        for n in ids:
            self._meas[self.ix[n]] = True
        self.meas = np.array(self._meas, dtype=bool)

    def best(self, model: NetworkModel, cands: Sequence[str], top: str, children: Mapping[str, list[str]],
             rate: Mapping[str, float], depth: Mapping[str, int], flows: Mapping[tuple[str, str], int],
             harms: Callable[[str], bool]) -> tuple[Key, str]:
        """``max((key(u), u) for u in cands)`` for the key of the module docstring (``cands`` not empty)."""
        ix = self.ix
        n = len(cands)
        u = np.fromiter((ix[c] for c in cands), dtype=np.int64, count=n)
        k = np.fromiter((len(children[c]) for c in cands), dtype=np.float64, count=n)
        r = np.fromiter((rate[c] for c in cands), dtype=np.float64, count=n)
        d = np.fromiter((depth[c] for c in cands), dtype=np.int64, count=n)
        v = ix[top]
        rv = int(self.reg[v])
        ru = self.reg[u]
        down = float(self.down[v])
        bw = np.minimum(np.minimum(self.up[u], down), self.region_bw[ru, rv])
        if self.meas[v]:
            for j in np.flatnonzero(self.meas[u]).tolist():
                bw[j] = model.bandwidth(cands[j], top)
        upk = self.up[u] / (k + 1.0)
        s = np.minimum(np.minimum(bw, upk), down)
        cross = np.flatnonzero((ru != rv) & np.isfinite(self.cap[ru, rv]))
        if cross.size:
            dst = self.region_names[rv]
            per = np.array([flows.get((a, dst), 0) + 1.0 for a in self.region_names])
            rc = ru[cross]
            s[cross] = np.minimum(s[cross], self.cap[rc, rv] / per[rc])
        offer = np.minimum(r, s)
        order = np.lexsort((upk, -d, offer))[::-1]
        # Walk from the best numeric key down to the first candidate that does not slow its children;
        # every candidate with that same numeric key competes on the name.
        first = int(order[0])
        pick = -1
        for j in order.tolist():
            if not harms(cands[j]):
                pick = j
                break
        ok = pick >= 0
        j0 = pick if ok else first
        same = np.flatnonzero((offer == offer[j0]) & (d == d[j0]) & (upk == upk[j0]))
        names = [cands[j] for j in same.tolist() if not ok or not harms(cands[j])]
        name = max(names)
        return (ok, float(offer[j0]), -int(d[j0]), float(upk[j0]), name), name


__all__ = ["Key", "NodeTable"]
