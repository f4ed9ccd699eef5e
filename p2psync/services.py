"""Optional parts of a node that live beside the data plane: each a *service*.

A service is an object with::

    def routes(self) -> list[aiohttp.web.RouteDef]   # served behind the node's token guard
    async def start(self) -> None                     # after the server listens
    async def stop(self) -> None                      # first thing in Node.close()

:func:`build_services` decides, from the node's config and role, which services a
node runs, builds them, and hands each the :class:`~p2psync.host.Host` view of the
node and the other services it needs (the coordinator and the work client get the
gossip service). The node keeps what it returns; no service attaches itself to the
node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from p2psync.control.api import WorkSink, WorkSource
    from p2psync.control.gossip_service import GossipService
    from p2psync.host import Host


class Service(Protocol):
    def routes(self) -> list[web.RouteDef]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class Services:
    """What :func:`build_services` built, by name, and all of it in start order."""

    gossip: GossipService | None = None
    """The gossip service when ``gossip.on`` for the node's role."""
    coordinator: WorkSink | None = None
    """Trainer: the coordinator (leases, scheduling, results)."""
    work: WorkSource | None = None
    """Rollout node that can find the coordinator: leases on rollout work."""
    started: list[Any] = field(default_factory=list)
    """Every service, in start order (stopped in reverse: leases are handed back before the gossip leave)."""


def build_services(host: Host) -> Services:
    """The services the node ``host`` runs: gossip (when on), then the coordinator on the trainer
    or the work client on a rollout node that can find the coordinator (gossip or
    ``control.coordinator_url``), the probe endpoints, and the live page on the trainer.
    Imports stay local so that the CLI stays fast."""
    cfg = host.config
    out = Services()
    if cfg.gossip.on(cfg.role):
        from p2psync.control.gossip_service import GossipService

        out.gossip = GossipService(host)
        out.started.append(out.gossip)
    if cfg.role == "trainer":
        from p2psync.control.coordinator import Coordinator

        coordinator = Coordinator(host, out.gossip)
        out.coordinator = coordinator
        out.started.append(coordinator)
    elif cfg.role == "rollout" and (cfg.gossip.on(cfg.role) or cfg.control.coordinator_url):
        # Without gossip or a coordinator URL there is nobody to ask for work: no work client.
        from p2psync.control.work_client import WorkClient

        work = WorkClient(host, out.gossip)
        out.work = work
        out.started.append(work)
    from p2psync.probe.service import ProbeService

    out.started.append(ProbeService(host))
    if cfg.role == "trainer":
        from p2psync.ui.service import UiService

        out.started.append(UiService(host))
    return out
