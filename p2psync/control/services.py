"""Which control-plane services a node runs (called from :func:`p2psync.services.build_services`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2psync.node import Node


def control_services(node: Node) -> list[Any]:
    """Gossip (when ``gossip.on``), then the coordinator on the trainer or the work client on a
    rollout node that can find the coordinator (gossip or ``control.coordinator_url``). Stopped in
    reverse order: leases are handed back before the gossip leave."""
    cfg = node.config
    out: list[Any] = []
    if cfg.gossip.on(cfg.role):
        from p2psync.control.gossip_service import GossipService

        out.append(GossipService(node))
    if cfg.role == "trainer":
        from p2psync.control.coordinator import Coordinator

        out.append(Coordinator(node))
    elif cfg.role == "rollout" and (cfg.gossip.on(cfg.role) or cfg.control.coordinator_url):
        # Without gossip or a coordinator URL there is nobody to ask for work: node.work stays None.
        from p2psync.control.work_client import WorkClient

        out.append(WorkClient(node))
    return out
