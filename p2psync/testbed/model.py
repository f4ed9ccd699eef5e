"""The testbed as the planner sees it: a :class:`topology.model.NetworkModel` built from the configuration.

Uncapped links are given ``UNCAPPED_BPS`` (a veth pair carries several Gbit/s on
this kind of host, far above any cap). Each ordered pair of regions becomes a
region link whose per-flow bandwidth and pipe capacity are the smaller of the
two regions' WAN caps, and whose RTT is twice the configured one-way delay. (The
testbed's WAN is a hub: one region's uplink is shared by all its destinations,
which the model's per-pair pipes do not express.)
"""

from __future__ import annotations

from p2psync.testbed.config import TestbedConfig
from topology.model import Defaults, NetworkModel, NodeSpec, Region, RegionLink

UNCAPPED_BPS = 10e9


def _bps(mbit: float) -> float:
    return mbit * 1e6 if mbit > 0 else UNCAPPED_BPS


def network_model(cfg: TestbedConfig) -> NetworkModel:
    nodes = [NodeSpec(m.id, m.region, m.role, _bps(m.uplink_mbit), _bps(m.downlink_mbit), m.node_class)
             for m in cfg.machines()]
    regions = [Region(r.name, UNCAPPED_BPS, 0.0001) for r in cfg.regions]
    links = []
    for a in cfg.regions:
        for b in cfg.regions:
            if a.name != b.name:
                bw = min(_bps(a.wan_mbit), _bps(b.wan_mbit))
                links.append(RegionLink(a.name, b.name, bw, 2 * cfg.one_way_ms(a.name, b.name) / 1000.0, bw))
    return NetworkModel(nodes, regions=regions, region_links=links,
                        defaults=Defaults(intra_bandwidth_bps=UNCAPPED_BPS, intra_rtt_s=0.0001))
