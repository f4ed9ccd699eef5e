"""Optional parts of a node that live beside the data plane: each a *service*.

A service is an object with::

    def routes(self) -> list[aiohttp.web.RouteDef]   # served behind the node's token guard
    async def start(self) -> None                     # after the server listens
    async def stop(self) -> None                      # first thing in Node.close()

:func:`build_services` decides, from the node's config and role, which services
a node runs. Each service keeps its own state and talks to the node only
through the node's public attributes and methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2psync.node import Node


def build_services(node: Node) -> list[Any]:
    """The services ``node`` runs, in start order."""
    services: list[Any] = []
    # Each part registers itself here (one line each; imports stay local so the CLI stays fast).
    from p2psync.control.services import control_services

    services.extend(control_services(node))  # gossip, coordinator (trainer) or work client (rollout)
    from p2psync.probe import ProbeService

    services.append(ProbeService(node))  # probe endpoints, every node
    if node.config.role == "trainer":
        from p2psync.ui.service import UiService

        services.append(UiService(node))  # the live page /ui
    return services
