"""Seeded synthetic network models with realistic capacities, for tests and the scale study.

The shape follows the deployments p2psync targets: a trainer whose WAN uplink
is about 1 Gbit/s, rollout machines in several regions (clouds or sites) with
~10 Gbit/s between machines of one region and 0.2-1 Gbit/s between regions,
and machines of a few classes (datacenter GPU boxes, cloud VMs with a capped
egress, edge/consumer GPUs with a weak uplink). Inter-region figures are drawn
per direction, so links are asymmetric.
"""

from __future__ import annotations

import random

from topology.model import Defaults, Measurement, NetworkModel, NodeSpec, Region, RegionLink

GBIT = 1e9

# name: (uplink bits/s, downlink bits/s, share of the fleet)
NODE_CLASSES: dict[str, tuple[float, float, float]] = {
    "dc": (10 * GBIT, 10 * GBIT, 0.5),
    "cloud": (5 * GBIT, 10 * GBIT, 0.3),
    "edge": (1 * GBIT, 2.5 * GBIT, 0.2),
}


def synthetic_model(
    regions: int = 4,
    nodes_per_region: int = 8,
    *,
    seed: int = 0,
    trainer_uplink_bps: float = 1 * GBIT,
    trainer_downlink_bps: float = 10 * GBIT,
    intra_bandwidth_bps: float = 10 * GBIT,
    inter_bandwidth_bps: tuple[float, float] = (0.2 * GBIT, 1 * GBIT),
    intra_rtt_s: tuple[float, float] = (0.0002, 0.001),
    inter_rtt_s: tuple[float, float] = (0.02, 0.15),
    relays_per_region: int = 0,
    measured_fraction: float = 0.0,
    jitter: float = 0.1,
    node_classes: dict[str, tuple[float, float, float]] | None = None,
) -> NetworkModel:
    """A model with ``regions`` x ``nodes_per_region`` machines plus the trainer (in the first region).

    Region ``rNN`` holds nodes ``rNN-nMMM``; the first ``relays_per_region`` of
    each region have role ``relay``, the rest ``rollout``. Every ordered region
    pair gets a per-flow bandwidth drawn from ``inter_bandwidth_bps`` (which is
    also the aggregate capacity of that pipe) and a symmetric RTT. A
    ``measured_fraction`` of the ordered node pairs get a measurement equal to
    the estimate times a factor in ``1 +/- jitter``, capped by the two ends,
    as a probe would report. The same arguments give the same model.
    """
    if regions < 1 or nodes_per_region < 0:
        raise ValueError("regions must be >= 1 and nodes_per_region >= 0")
    rng = random.Random(seed)
    classes = node_classes or NODE_CLASSES
    names, weights = list(classes), [c[2] for c in classes.values()]
    region_names = [f"r{i:02d}" for i in range(regions)]
    nodes = [NodeSpec("trainer", region_names[0], "trainer", trainer_uplink_bps, trainer_downlink_bps, "trainer")]
    for r in region_names:
        for j in range(nodes_per_region):
            cls = rng.choices(names, weights)[0]
            up, down, _ = classes[cls]
            role = "relay" if j < relays_per_region else "rollout"
            nodes.append(NodeSpec(f"{r}-n{j:03d}", r, role, up, down, cls))
    region_objs = [Region(r, intra_bandwidth_bps, rng.uniform(*intra_rtt_s)) for r in region_names]
    rtts = {}
    for i, a in enumerate(region_names):
        for b in region_names[i + 1:]:
            rtts[(a, b)] = rtts[(b, a)] = rng.uniform(*inter_rtt_s)
    links = []
    for a in region_names:
        for b in region_names:
            if a != b:
                bw = rng.uniform(*inter_bandwidth_bps)
                links.append(RegionLink(a, b, bw, rtts[(a, b)], capacity_bps=bw))
    model = NetworkModel(nodes, (), region_objs, links, Defaults())
    if measured_fraction <= 0:
        return model
    measured = []
    ids = model.node_ids
    for a in ids:
        for b in ids:
            if a != b and rng.random() < measured_fraction:
                est = model.bandwidth(a, b)
                cap = min(model.node(a).uplink_bps, model.node(b).downlink_bps)
                bw = min(cap, est * rng.uniform(1 - jitter, 1 + jitter))
                measured.append(Measurement(a, b, bw, model.rtt(a, b) * rng.uniform(1 - jitter, 1 + jitter)))
    return NetworkModel(nodes, measured, region_objs, links, Defaults())
