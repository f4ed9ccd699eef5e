"""The network model the planner and the simulator work on.

A model is a set of nodes (id, region, role, uplink and downlink capacity in
bits/s, an optional node class), region-level figures (the bandwidth one flow
gets and the RTT inside a region and between two regions, optionally the
aggregate capacity of an inter-region pipe), and measured per-pair links
(bandwidth in bits/s, RTT in seconds). Links are directed: ``a -> b`` is what
``b`` gets when it pulls from ``a``, and may differ from ``b -> a``.

Contract:

- ``bandwidth(a, b)`` and ``rtt(a, b)`` answer for every ordered pair of
  distinct nodes: the measurement when there is one, otherwise an estimate from
  the region-level figures capped by ``a``'s uplink and ``b``'s downlink.
- Exactly one node has role ``trainer``; it is the root of every plan.
- Loading a file that does not follow the schema raises ``ValueError``
  (a :class:`topology.errors.ModelError`) whose message starts with the field,
  e.g. ``nodes[3].uplink_bps: must be a positive number``.

Probing (which needs live nodes) produces a list of :class:`Measurement`; the
function :func:`model_from_measurements` turns it into a model of this schema,
so ``p2psync plan --probe`` and ``p2psync plan --from FILE`` plan from the same
object.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import networkx as nx

from topology import model_json
from topology.errors import ModelError
from topology.model_json import FORMAT_VERSION
from topology.model_types import (
    ROLES,
    Defaults,
    Measurement,
    NodeSpec,
    Region,
    RegionLink,
    check_node,
    check_non_negative,
    check_positive,
)


class NetworkModel:
    """Nodes, region-level figures and measured links; read-only once built.

    ``graph`` is a networkx DiGraph whose nodes carry the :class:`NodeSpec`
    fields as attributes and whose edges are the measured links
    (``bandwidth_bps``, ``rtt_s``). Unmeasured pairs are not edges; ask
    :meth:`bandwidth` and :meth:`rtt`, which estimate them.
    """

    def __init__(
        self,
        nodes: Iterable[NodeSpec],
        links: Iterable[Measurement] = (),
        regions: Iterable[Region] = (),
        region_links: Iterable[RegionLink] = (),
        defaults: Defaults = Defaults(),
    ) -> None:
        self.defaults = defaults
        self._spec: dict[str, NodeSpec] = {}
        for i, n in enumerate(nodes):
            check_node(n, f"nodes[{i}]")
            if n.id in self._spec:
                raise ModelError(f"nodes[{i}].id", f"duplicate node id {n.id!r}")
            self._spec[n.id] = n
        trainers = [n.id for n in self._spec.values() if n.role == "trainer"]
        if len(trainers) != 1:
            raise ModelError("nodes", f"exactly one node must have role 'trainer', found {len(trainers)}")
        self.trainer: str = trainers[0]
        self.regions: dict[str, Region] = {}
        for i, r in enumerate(regions):
            check_positive(r.intra_bandwidth_bps, f"regions[{i}].intra_bandwidth_bps")
            check_non_negative(r.intra_rtt_s, f"regions[{i}].intra_rtt_s")
            self.regions[r.name] = r
        self.region_links: dict[tuple[str, str], RegionLink] = {}
        for i, rl in enumerate(region_links):
            if rl.src == rl.dst:
                raise ModelError(f"region_links[{i}].dst", "must differ from src (use regions[] for intra-region figures)")
            check_positive(rl.bandwidth_bps, f"region_links[{i}].bandwidth_bps")
            check_non_negative(rl.rtt_s, f"region_links[{i}].rtt_s")
            if rl.capacity_bps is not None:
                check_positive(rl.capacity_bps, f"region_links[{i}].capacity_bps")
            self.region_links[(rl.src, rl.dst)] = rl
        self._measured: dict[str, dict[str, tuple[float, float]]] = {}
        self._graph: nx.DiGraph | None = None
        for i, m in enumerate(links):
            for end in ("src", "dst"):
                if getattr(m, end) not in self._spec:
                    raise ModelError(f"links[{i}].{end}", f"unknown node {getattr(m, end)!r}")
            if m.src == m.dst:
                raise ModelError(f"links[{i}].dst", "a link needs two distinct nodes")
            check_positive(m.bandwidth_bps, f"links[{i}].bandwidth_bps")
            check_non_negative(m.rtt_s, f"links[{i}].rtt_s")
            self._measured.setdefault(m.src, {})[m.dst] = (m.bandwidth_bps, m.rtt_s)
        self._index()

    def _index(self) -> None:
        """Derived lookups; rebuilt by every constructor and by :meth:`_derive`."""
        self._by_region: dict[str, list[str]] = {}
        for n in self._spec.values():
            self._by_region.setdefault(n.region, []).append(n.id)
        # bandwidth() runs in the planner's inner loops: precompute what an estimate needs.
        self._ends = {n.id: (n.uplink_bps, n.downlink_bps, n.region) for n in self._spec.values()}
        self._region_figures(set(self._by_region) | set(self.regions))
        self._measured_in: set[str] = {b for row in self._measured.values() for b in row}

    def _region_figures(self, names: set[str]) -> None:
        self._region_bw = {(a, b): self.region_bandwidth(a, b) for a in names for b in names}
        self._region_rtt = {(a, b): self.region_rtt(a, b) for a in names for b in names}
        self._region_bw_names = frozenset(names)
        """The regions the two tables above cover (a superset of the regions in use)."""

    @property
    def graph(self) -> nx.DiGraph:
        """The model as a networkx DiGraph (built on first use; see the class docstring)."""
        if self._graph is None:
            g = nx.DiGraph()
            for n in self._spec.values():
                g.add_node(n.id, region=n.region, role=n.role, uplink_bps=n.uplink_bps,
                           downlink_bps=n.downlink_bps, node_class=n.node_class)
            for a, row in self._measured.items():
                for b, (bw, rtt) in row.items():
                    g.add_edge(a, b, bandwidth_bps=bw, rtt_s=rtt)
            self._graph = g
        return self._graph

    # ---- nodes ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._spec)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._spec

    @property
    def node_ids(self) -> list[str]:
        return list(self._spec)

    def node(self, node_id: str) -> NodeSpec:
        return self._spec[node_id]

    def nodes(self) -> list[NodeSpec]:
        return list(self._spec.values())

    def region_of(self, node_id: str) -> str:
        return self._spec[node_id].region

    def by_region(self) -> dict[str, list[str]]:
        """Region name -> node ids in insertion order (the trainer's region included)."""
        return {r: list(ids) for r, ids in self._by_region.items()}

    def nodes_in(self, region: str) -> list[str]:
        """Node ids of one region in insertion order (empty for an unknown region)."""
        return list(self._by_region.get(region, ()))

    def region_names(self) -> list[str]:
        return list(self._by_region)

    # ---- links ---------------------------------------------------------------------------

    def is_measured(self, src: str, dst: str) -> bool:
        return dst in self._measured.get(src, {})

    def measurements(self) -> list[Measurement]:
        return [Measurement(a, b, bw, rtt) for a, row in self._measured.items() for b, (bw, rtt) in row.items()]

    def region_bandwidth(self, src_region: str, dst_region: str) -> float:
        """Per-flow bandwidth between two regions (or inside one) from region-level figures."""
        if src_region == dst_region:
            r = self.regions.get(src_region)
            return r.intra_bandwidth_bps if r else self.defaults.intra_bandwidth_bps
        rl = self.region_links.get((src_region, dst_region))
        return rl.bandwidth_bps if rl else self.defaults.inter_bandwidth_bps

    def region_rtt(self, src_region: str, dst_region: str) -> float:
        if src_region == dst_region:
            r = self.regions.get(src_region)
            return r.intra_rtt_s if r else self.defaults.intra_rtt_s
        rl = self.region_links.get((src_region, dst_region))
        return rl.rtt_s if rl else self.defaults.inter_rtt_s

    def link_capacity(self, src_region: str, dst_region: str) -> float | None:
        """Aggregate capacity of the inter-region pipe ``src -> dst``; None when it is not a shared bottleneck."""
        if src_region == dst_region:
            return None
        rl = self.region_links.get((src_region, dst_region))
        return rl.capacity_bps if rl else None

    def bandwidth(self, src: str, dst: str) -> float:
        """What one flow ``src -> dst`` gets alone: measured, or estimated (region figure capped by the ends)."""
        row = self._measured.get(src)
        if row is not None:
            hit = row.get(dst)
            if hit is not None:
                return hit[0]
        up, _, ra = self._ends[src]
        _, down, rb = self._ends[dst]
        bw = self._region_bw[(ra, rb)]
        return min(up, down, bw)

    def rtt(self, src: str, dst: str) -> float:
        row = self._measured.get(src)
        if row is not None:
            hit = row.get(dst)
            if hit is not None:
                return hit[1]
        return self._region_rtt[(self._ends[src][2], self._ends[dst][2])]

    def has_measurements(self, node_id: str) -> bool:
        """Whether any measured link starts or ends at ``node_id`` (else its links are region figures)."""
        return node_id in self._measured or node_id in self._measured_in

    # ---- changes (a new model; this one is unchanged) -------------------------------------
    # Each derives the new model from this one's validated parts: the cost is a copy of the
    # lookups (linear, no validation of what did not change, no networkx graph).

    def _derive(self, spec: dict[str, NodeSpec], measured: dict[str, dict[str, tuple[float, float]]],
                added: Iterable[NodeSpec] | None = None, removed: Collection[str] = ()) -> NetworkModel:
        """The model of ``spec`` and ``measured``. Given what differs from this model (``added`` nodes,
        new or replaced, and ``removed`` ids), the node lookups are this model's, updated there."""
        out = object.__new__(NetworkModel)
        out.defaults, out.regions, out.region_links = self.defaults, self.regions, self.region_links
        out._spec, out._measured, out._graph = spec, measured, None
        trainers = [n.id for n in spec.values() if n.role == "trainer"] if self.trainer not in spec else [self.trainer]
        if len(trainers) != 1:
            raise ModelError("nodes", f"exactly one node must have role 'trainer', found {len(trainers)}")
        out.trainer = trainers[0]
        if added is None or not out._index_from(self, list(added), removed):
            out._index()
        return out

    def _index_from(self, base: NetworkModel, added: list[NodeSpec], removed: Collection[str]) -> bool:
        """:meth:`_index` as an update of ``base``'s lookups (at 100,000 nodes a rebuild cost ~0.1 s per
        change under churn); False, doing nothing, where a node changed region (its place in its new
        region's list follows the node order, which only a rebuild gets right)."""
        ends = base._ends.copy()  # dict.copy, not dict(): a fast clone even with deleted slots
        by_region = base._by_region.copy()
        cut: dict[str, set[str]] = {}
        for n in removed:
            e = ends.pop(n, None)
            if e is not None:
                cut.setdefault(e[2], set()).add(n)
        grown: dict[str, list[str]] = {}
        for spec in added:
            was = ends.get(spec.id)
            if was is not None and was[2] != spec.region:
                return False
            ends[spec.id] = (spec.uplink_bps, spec.downlink_bps, spec.region)
            if was is None:
                grown.setdefault(spec.region, []).append(spec.id)
        for r, out in cut.items():
            kept = [n for n in by_region[r] if n not in out]
            if kept:
                by_region[r] = kept
            else:
                del by_region[r]
        for r, ids in grown.items():
            by_region[r] = [*by_region.get(r, ()), *ids]
        self._by_region, self._ends = by_region, ends
        names = set(by_region) | set(self.regions)
        if names <= set(base._region_bw_names):
            self._region_bw, self._region_rtt, self._region_bw_names = \
                base._region_bw, base._region_rtt, base._region_bw_names
        else:
            self._region_figures(names)
        self._measured_in = {b for row in self._measured.values() for b in row}
        return True

    def with_nodes(self, added: Iterable[NodeSpec], links: Iterable[Measurement] = ()) -> NetworkModel:
        """This model plus ``added`` nodes (and measurements involving them).

        A node already in the model is replaced by its new figures (a capacity change)."""
        added = list(added)
        for i, n in enumerate(added):
            check_node(n, f"added[{i}]")
            if n.role == "trainer" and n.id != self.trainer:
                raise ModelError(f"added[{i}].role", "the model already has a trainer")
        spec = self._spec.copy()
        for n in added:
            spec[n.id] = n
        return self._derive(spec, self._with_links(spec, links), added)

    def with_links(self, links: Iterable[Measurement]) -> NetworkModel:
        """This model with ``links`` measured (replacing earlier measurements of the same pairs)."""
        return self._derive(self._spec, self._with_links(self._spec, links), ())

    def _with_links(self, spec: Mapping[str, NodeSpec], links: Iterable[Measurement]) -> dict[str, dict[str, tuple[float, float]]]:
        measured = dict(self._measured)
        for i, m in enumerate(links):
            for end in ("src", "dst"):
                if getattr(m, end) not in spec:
                    raise ModelError(f"links[{i}].{end}", f"unknown node {getattr(m, end)!r}")
            if m.src == m.dst:
                raise ModelError(f"links[{i}].dst", "a link needs two distinct nodes")
            check_positive(m.bandwidth_bps, f"links[{i}].bandwidth_bps")
            check_non_negative(m.rtt_s, f"links[{i}].rtt_s")
            measured[m.src] = {**measured.get(m.src, {}), m.dst: (m.bandwidth_bps, m.rtt_s)}
        return measured

    def without_nodes(self, removed: Iterable[str]) -> NetworkModel:
        """This model less the ``removed`` nodes and every measurement touching them."""
        gone = set(removed)
        if self.trainer in gone:
            raise ValueError("the trainer cannot leave the model")
        spec = self._spec.copy()
        for k in gone:
            spec.pop(k, None)
        measured = {a: row for a, row in self._measured.items() if a not in gone}
        for a, row in measured.items():
            if not gone.isdisjoint(row):
                measured[a] = {b: x for b, x in row.items() if b not in gone}
        return self._derive(spec, {a: row for a, row in measured.items() if row}, (), gone)

    # ---- JSON (the format: topology.model_json) --------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return model_json.parts_to_json(self._spec.values(), self.measurements(), self.regions.values(),
                                        self.region_links.values(), self.defaults)

    @classmethod
    def from_json(cls, data: Any) -> NetworkModel:
        """Parse the dict :meth:`to_json` writes; ``ValueError`` names the first bad field."""
        return cls(*model_json.parse(data))

    def save(self, path: str | Path) -> None:
        model_json.write_file(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> NetworkModel:
        return cls(*model_json.read_file(path))


def model_from_measurements(
    nodes: Iterable[NodeSpec],
    measurements: Iterable[Measurement],
    defaults: Defaults = Defaults(),
) -> NetworkModel:
    """Build a model from what a probe run measured.

    At scale a probe measures a sample of pairs inside each region and a few
    representatives across regions; the region-level figures that estimate
    the other pairs are the medians of the measured pairs of that region (or
    region pair). Regions or region pairs with no measurement fall back to
    ``defaults``. Aggregate pipe capacities cannot be inferred from single
    flows, so region links get ``capacity_bps=None``.
    """
    nodes = list(nodes)
    measurements = list(measurements)
    region = {n.id: n.region for n in nodes}
    bw: dict[tuple[str, str], list[float]] = {}
    rtt: dict[tuple[str, str], list[float]] = {}
    for i, m in enumerate(measurements):
        for end in ("src", "dst"):
            if getattr(m, end) not in region:
                raise ModelError(f"measurements[{i}].{end}", f"unknown node {getattr(m, end)!r}")
        key = (region[m.src], region[m.dst])
        bw.setdefault(key, []).append(m.bandwidth_bps)
        rtt.setdefault(key, []).append(m.rtt_s)
    regions = [Region(a, statistics.median(v), statistics.median(rtt[(a, b)])) for (a, b), v in bw.items() if a == b]
    links = [RegionLink(a, b, statistics.median(v), statistics.median(rtt[(a, b)])) for (a, b), v in bw.items() if a != b]
    return NetworkModel(nodes, measurements, regions, links, defaults)


__all__ = [
    "FORMAT_VERSION", "ROLES", "Defaults", "Measurement", "NetworkModel", "NodeSpec", "Region", "RegionLink",
    "model_from_measurements",
]
