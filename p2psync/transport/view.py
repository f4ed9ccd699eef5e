"""What the HTTP server and the push stream need from a node, and the signal they wait on."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from p2psync.config import LimitsConfig, NodeConfig
    from p2psync.store import VersionStore
    from p2psync.transport.board import Board
    from p2psync.transport.messages import Catalogue
    from p2psync.transport.metrics import Metrics


class HeadSignal:
    """A sequence number bumped whenever the catalogue changes, that event streams wait on."""

    def __init__(self) -> None:
        self.seq = 0
        self.closed = False
        self._event = asyncio.Event()

    def bump(self) -> None:
        self.seq += 1
        ev, self._event = self._event, asyncio.Event()
        ev.set()

    def close(self) -> None:
        self.closed = True
        self.bump()

    async def wait(self, seq: int, timeout: float) -> None:
        if self.seq != seq:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            pass


class NodeView(Protocol):
    """What the server needs from a node."""

    config: NodeConfig
    store: VersionStore
    board: Board
    metrics: Metrics
    heads: HeadSignal

    def catalogue(self) -> Catalogue: ...

    def status(self) -> dict: ...

    def note_child(self, node_id: str, address: str) -> None: ...

    def extra_routes(self) -> list[web.RouteDef]:
        """Routes of the node's services (:mod:`p2psync.services`), behind the same guard."""
        ...


class Responder(Protocol):
    """A request handler's side of one response: what :mod:`p2psync.transport.push` writes through."""

    view: NodeView
    limits: LimitsConfig

    async def write(self, resp: web.StreamResponse, data: bytes | memoryview) -> None:
        """Write ``data``; a client that does not read for ``limits.idle_timeout`` raises TimeoutError."""
        ...

    def cut(self, request: web.Request) -> None:
        """Drop a client that stopped reading."""
        ...
