"""The dissemination plan (a tree rooted at the trainer), its JSON form, and the completion-time estimate.

The estimate is the planner's objective. For an edge ``p -> c`` the expected
share is the least of: the pair's bandwidth, ``p``'s uplink divided by its
number of children, ``c``'s downlink, and the aggregate capacity of the
inter-region pipe divided by the number of plan edges that use it. A node's
rate is the tightest share on its path from the root. With chunk-level
cut-through a node at depth d finishes at about::

    payload / rate  +  sum(chunk / share_e for e on the path) - chunk / rate  +  sum(rtt_e / 2 on the path)

(the bottleneck edge's own chunk time is already inside ``payload / rate``;
every byte is delayed by each hop's one-way delay, half its RTT), so a chain
of d equal links costs ``payload/bw + (d-1) * chunk/bw`` plus the delays.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from topology.errors import ModelError
from topology.model import NetworkModel

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """Who pulls from whom, for one membership epoch. Treat the dicts as read-only.

    Contract: ``parents`` maps every node except ``root`` to exactly one
    parent, and following parents from any node reaches ``root`` without a
    cycle. ``fallbacks[n]`` lists, best first, the nodes ``n`` fails over to
    when its parent stops serving; each has a smaller depth than ``n`` in
    this plan, so concurrent fail-overs cannot form a cycle.
    """

    root: str
    parents: dict[str, str]
    edge_bps: dict[str, float]
    """Expected bandwidth of the edge into each non-root node (its share, see module doc)."""
    eta_s: dict[str, float]
    """Estimated time at which each node holds the whole artifact."""
    est_completion_s: float
    """Estimated time until the last node holds the artifact (the objective)."""
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    payload_bytes: int = 0
    chunk_bytes: int = 0
    epoch: int = 0

    @property
    def nodes(self) -> list[str]:
        return [self.root, *self.parents]

    def children(self) -> dict[str, list[str]]:
        return children_of(self.parents, self.root)

    def depths(self) -> dict[str, int]:
        return depths_of(self.parents, self.root)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "epoch": self.epoch,
            "root": self.root,
            "payload_bytes": self.payload_bytes,
            "chunk_bytes": self.chunk_bytes,
            "est_completion_s": self.est_completion_s,
            "nodes": {
                n: {
                    "region": self.regions.get(n, ""),
                    "role": self.roles.get(n, ""),
                    "parent": self.parents.get(n),
                    "edge_bps": self.edge_bps.get(n),
                    "eta_s": self.eta_s.get(n, 0.0),
                    "fallbacks": self.fallbacks.get(n, []),
                }
                for n in self.nodes
            },
        }

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """Parse what :meth:`to_json` writes; ``ValueError`` names the first bad field."""
        if not isinstance(data, dict):
            raise ModelError("<root>", "a plan must be a JSON object")
        if data.get("format_version") != PLAN_FORMAT_VERSION:
            raise ModelError("format_version", f"unsupported plan format version {data.get('format_version')!r} (this build reads {PLAN_FORMAT_VERSION})")
        root = data.get("root")
        nodes = data.get("nodes")
        if not isinstance(nodes, dict) or not nodes:
            raise ModelError("nodes", "must be a non-empty object")
        if not isinstance(root, str) or root not in nodes:
            raise ModelError("root", f"must name a node of the plan, got {root!r}")
        parents: dict[str, str] = {}
        edge_bps: dict[str, float] = {}
        eta: dict[str, float] = {}
        fallbacks: dict[str, list[str]] = {}
        regions: dict[str, str] = {}
        roles: dict[str, str] = {}
        for n, o in nodes.items():
            where = f"nodes.{n}"
            if not isinstance(o, dict):
                raise ModelError(where, "must be an object")
            p = o.get("parent")
            if n == root:
                if p is not None:
                    raise ModelError(f"{where}.parent", "the root has no parent")
            else:
                if not isinstance(p, str) or p not in nodes:
                    raise ModelError(f"{where}.parent", f"must name a node of the plan, got {p!r}")
                parents[n] = p
                edge_bps[n] = _num(o.get("edge_bps"), f"{where}.edge_bps")
            eta[n] = _num(o.get("eta_s", 0.0), f"{where}.eta_s")
            fb = o.get("fallbacks", [])
            if not isinstance(fb, list) or any(f not in nodes for f in fb):
                raise ModelError(f"{where}.fallbacks", "must be a list of node ids of the plan")
            if n != root:
                fallbacks[n] = list(fb)
            for key, out in (("region", regions), ("role", roles)):
                v = o.get(key, "")
                if not isinstance(v, str):
                    raise ModelError(f"{where}.{key}", "must be a string")
                out[n] = v
        try:
            depths_of(parents, root)
        except ValueError as exc:
            raise ModelError("nodes", str(exc)) from exc
        ints = {}
        for key in ("epoch", "payload_bytes", "chunk_bytes"):
            v = data.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ModelError(key, f"must be a non-negative integer, got {v!r}")
            ints[key] = v
        return cls(
            root, parents, edge_bps, eta, _num(data.get("est_completion_s"), "est_completion_s"),
            fallbacks, regions, roles, **ints,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(str(path), f"not valid JSON ({exc})") from exc
        return cls.from_json(data)


def _num(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ModelError(where, "missing" if v is None else f"must be a non-negative finite number, got {v!r}")
    return float(v)


# ---- tree helpers -------------------------------------------------------------------------


def children_of(parents: Mapping[str, str], root: str) -> dict[str, list[str]]:
    """Parent -> children, children in the order they appear in ``parents``; every node has an entry."""
    out: dict[str, list[str]] = {root: []}
    for c in parents:
        out.setdefault(c, [])
    for c, p in parents.items():
        out.setdefault(p, []).append(c)
    return out


def depths_of(parents: Mapping[str, str], root: str) -> dict[str, int]:
    """Depth of every node (root 0); ``ValueError`` if some node does not reach the root or sits on a cycle."""
    depth = {root: 0}
    for start in parents:
        path = []
        n = start
        while n not in depth:
            path.append(n)
            if len(path) > len(parents) + 1 or n not in parents:
                raise ValueError(f"node {start!r} does not reach the root {root!r} (cycle or missing parent)")
            n = parents[n]
        d = depth[n]
        for m in reversed(path):
            d += 1
            depth[m] = d
    return depth


def subtree(children: Mapping[str, list[str]], top: str) -> set[str]:
    out = {top}
    stack = [top]
    while stack:
        for c in children.get(stack.pop(), ()):
            out.add(c)
            stack.append(c)
    return out


def bfs_order(children: Mapping[str, list[str]], root: str) -> list[str]:
    order = [root]
    i = 0
    while i < len(order):
        order.extend(children.get(order[i], ()))
        i += 1
    return order


# ---- the objective ------------------------------------------------------------------------


@dataclass
class Estimate:
    edge_bps: dict[str, float]
    rate_bps: dict[str, float]
    eta_s: dict[str, float]
    completion_s: float


def edge_share(model: NetworkModel, children: Mapping[str, list[str]], p: str, c: str,
               pipe_flows: Mapping[tuple[str, str], int]) -> float:
    """The expected share of edge ``p -> c`` in a tree with these children (see module doc)."""
    sp, sc = model.node(p), model.node(c)
    share = min(model.bandwidth(p, c), sp.uplink_bps / max(1, len(children.get(p, ()))), sc.downlink_bps)
    if sp.region != sc.region:
        cap = model.link_capacity(sp.region, sc.region)
        if cap is not None:
            share = min(share, cap / max(1, pipe_flows.get((sp.region, sc.region), 1)))
    return share


def pipe_flows_of(model: NetworkModel, parents: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """Number of plan edges on each inter-region pipe."""
    out: dict[tuple[str, str], int] = {}
    for c, p in parents.items():
        a, b = model.region_of(p), model.region_of(c)
        if a != b:
            out[(a, b)] = out.get((a, b), 0) + 1
    return out


def estimate(model: NetworkModel, root: str, parents: Mapping[str, str], payload_bytes: int,
             chunk_bytes: int, children: Mapping[str, list[str]] | None = None) -> Estimate:
    """Score a tree with the pipelined completion-time model of the module docstring.

    Runs over arrays (:mod:`topology.vector`); :func:`estimate_walk` is the same model node by node.
    """
    from topology.vector import arrays_of, child_counts, layout, pipe_flow_matrix, propagate

    children = children if children is not None else children_of(parents, root)
    a = arrays_of(model)
    lay = layout(a, children, [root])
    one = np.ones(1)
    paths = propagate(model, a, lay, child_counts(a, lay), pipe_flow_matrix(a, lay), payload_bytes, chunk_bytes,
                      one * math.inf, one * 0.0, one * 0.0)
    ids = [a.ids[i] for i in lay.nodes.tolist()]
    below = ids[1:]
    eta = dict(zip(ids, paths.eta.tolist()))
    eta[root] = 0.0
    return Estimate(dict(zip(below, paths.share[1:].tolist())), dict(zip(ids, paths.rate.tolist())), eta,
                    float(paths.eta[1:].max()) if len(below) else 0.0)


def completion(model: NetworkModel, root: str, children: Mapping[str, list[str]], payload_bytes: int,
               chunk_bytes: int) -> tuple[float, str]:
    """:func:`estimate`'s completion time and the node that finishes last (first in breadth-first order)."""
    from topology.vector import arrays_of, child_counts, layout, pipe_flow_matrix, propagate

    a = arrays_of(model)
    lay = layout(a, children, [root])
    one = np.ones(1)
    paths = propagate(model, a, lay, child_counts(a, lay), pipe_flow_matrix(a, lay), payload_bytes, chunk_bytes,
                      one * math.inf, one * 0.0, one * 0.0)
    paths.eta[0] = 0.0
    j = int(np.argmax(paths.eta))
    return (float(paths.eta[j]) if len(lay.nodes) > 1 else 0.0), a.ids[int(lay.nodes[j])]


def estimate_walk(model: NetworkModel, root: str, parents: Mapping[str, str], payload_bytes: int,
                  chunk_bytes: int, children: Mapping[str, list[str]] | None = None) -> Estimate:
    """:func:`estimate`, one node at a time (the reference the array version is tested against)."""
    children = children if children is not None else children_of(parents, root)
    flows = pipe_flows_of(model, parents)
    bits, chunk_bits = payload_bytes * 8.0, min(chunk_bytes, payload_bytes) * 8.0
    edge: dict[str, float] = {}
    rate = {root: math.inf}
    pipe = {root: 0.0}
    lat = {root: 0.0}
    eta = {root: 0.0}
    worst = 0.0
    for p in bfs_order(children, root):
        for c in children.get(p, ()):
            s = edge_share(model, children, p, c, flows)
            edge[c] = s
            r = min(rate[p], s)
            rate[c] = r
            pipe[c] = pipe[p] + chunk_bits / s
            lat[c] = lat[p] + model.rtt(p, c) / 2
            t = bits / r + pipe[c] - chunk_bits / r + lat[c]
            eta[c] = t
            if t > worst:
                worst = t
    return Estimate(edge, rate, eta, worst)
