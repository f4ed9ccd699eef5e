"""What a node shows over HTTP: its catalogue, its status, the children that called it.

:class:`NodeRoutes` is the :class:`~p2psync.transport.view.NodeView` that the
server's handlers (``rpc_<verb>`` in :mod:`p2psync.transport.server`) read; the
routes of the node's services are served beside them, behind the same guard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2psync.store import ArtifactInfo, VersionStore
from p2psync.transport.messages import Catalogue

if TYPE_CHECKING:
    from aiohttp import web

    from p2psync.config import NodeConfig
    from p2psync.node.follower import Follower
    from p2psync.node.replica import Replica
    from p2psync.transport.board import Board
    from p2psync.transport.metrics import Metrics
    from p2psync.transport.view import HeadSignal

_CHILD_TTL = 30.0


class NodeRoutes:
    """The node as its HTTP server sees it (``GET /v1/head``, ``/v1/status``, ...)."""

    def __init__(self, config: NodeConfig, store: VersionStore, board: Board, metrics: Metrics, heads: HeadSignal,
                 replica: Replica, follower: Follower | None, address: str,
                 service_routes: Callable[[], list[web.RouteDef]]) -> None:
        self.config = config
        self.store = store
        self.board = board
        self.metrics = metrics
        self.heads = heads
        self.replica = replica
        self.follower = follower
        self.address = address
        self._service_routes = service_routes
        self._children: dict[str, tuple[str, float]] = {}

    def catalogue(self) -> Catalogue:
        arts = self.store.catalogue(complete_only=True)
        # In flight: on the board and not yet complete (an artifact is listed once: a complete one
        # can still be on the board for a moment, and a push stream would send it twice).
        flying = [ArtifactInfo.of(art.manifest, False) for a in self.board.ids
                  if (art := self.store.artifacts.get(a)) is not None and not art.complete] \
            if self.config.cut_through else []
        all_arts = tuple(sorted(arts + flying, key=lambda i: (i.target, i.kind)))
        snaps = tuple(sorted({a.manifest.target_version for a in list(self.store.artifacts.values())
                              if a.manifest.kind == "snapshot"}))
        head = max((a.target for a in all_arts), default=None)
        pending = tuple(sorted(self.replica.snapshots_pending.difference(snaps)))
        return Catalogue(self.config.id, self.config.region, self.replica.version, self.replica.fingerprint, head,
                         all_arts, snaps, pending)

    def note_child(self, node_id: str, address: str) -> None:
        self._children[node_id] = (address, time.time())

    def extra_routes(self) -> list[web.RouteDef]:
        return self._service_routes()

    def status(self) -> dict:
        now = time.time()
        up = self.follower.upstream_cat if self.follower is not None else None
        transfers = {}
        for aid in self.board.ids:
            art = self.store.artifacts.get(aid)
            if art is not None:
                transfers[aid] = {"chunks_held": len(art.held), "chunks": len(art.manifest.chunks),
                                  "bytes_held": art.held_bytes, "bytes": art.manifest.payload_bytes}
        parents = self.follower.upstream.parents if self.follower is not None else None
        return {
            "node": self.config.id, "role": self.config.role, "region": self.config.region,
            "address": self.address, "loaded": self.replica.loaded.is_set(),
            "version": self.replica.version, "fingerprint": self.replica.fingerprint,
            "holds_weights": self.replica.state is not None,
            "head": up.head if up else self.store.head,
            "versions": [a.to_json() for a in self.catalogue().artifacts],
            "parent": parents.current(asyncio.get_running_loop().time()) if parents else None,
            "candidates": parents.candidates if parents else [],
            "avoided": parents.avoided(asyncio.get_running_loop().time()) if parents else [],
            "children": [{"id": k, "address": a, "seen": round(now - t, 1)}
                         for k, (a, t) in sorted(self._children.items()) if now - t < _CHILD_TTL],
            "transfers": transfers,
            "bytes_in": int(self.metrics.total("p2psync_bytes_in_total")),
            "bytes_out": int(self.metrics.total("p2psync_bytes_out_total")),
            "bad_chunks": int(self.metrics.total("p2psync_bad_chunks_total")),
        }
