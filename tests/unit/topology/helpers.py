"""Small hand-built models for the topology tests."""

from __future__ import annotations

from topology.model import Measurement, NetworkModel, NodeSpec, Region, RegionLink

G = 1e9
MiB = 2**20


def node(id: str, region: str = "A", up: float = 10 * G, down: float = 10 * G, role: str = "rollout") -> NodeSpec:
    return NodeSpec(id, region, role, up, down)


def trainer(region: str = "A", up: float = 1 * G) -> NodeSpec:
    return NodeSpec("T", region, "trainer", up, 10 * G)


def model(nodes, links=(), regions=("A",), region_links=(), intra_bps: float = 10 * G, rtt: float = 0.0) -> NetworkModel:
    """Zero RTT unless asked, so closed forms stay exact."""
    return NetworkModel(
        nodes,
        [Measurement(*x) if isinstance(x, tuple) else x for x in links],
        [Region(r, intra_bps, rtt) for r in regions],
        [RegionLink(*x) if isinstance(x, tuple) else x for x in region_links],
    )
