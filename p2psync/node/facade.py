"""A p2psync peer: the facade over the rooms that each do one job.

Roles. The trainer node is the root and the only publisher (:meth:`Node.publish`,
:class:`~p2psync.node.origin.Origin`); relays and rollout nodes follow their
candidate parents (:class:`~p2psync.node.follower.Follower`). Every node holds
its versions in a :class:`~p2psync.node.replica.Replica` (weights, the
all-or-nothing apply, housekeeping) and serves what it holds, or is still
fetching (cut-through), to its children (:class:`~p2psync.node.routes.NodeRoutes`
behind :mod:`p2psync.transport.server`). Optional services (gossip, coordinator
or work client, probes, the live page) are built here by
:func:`p2psync.services.build_services` and handed what they need.

Contracts: every manifest a node stores or serves verified against the
trainer's key; ``version``/``fingerprint`` change only after
:meth:`Applier.commit <p2psync.codec.decode.Applier.commit>` matched the target
fingerprint; :meth:`Node.subscribe` yields applied artifacts in version order.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2psync import keys
from p2psync.config import NodeConfig
from p2psync.errors import P2PSyncError
from p2psync.logs import NodeAdapter
from p2psync.node.follower import Follower
from p2psync.node.origin import Origin
from p2psync.node.replica import Replica
from p2psync.node.routes import NodeRoutes
from p2psync.node.tasks import Tasks
from p2psync.services import build_services
from p2psync.store import VersionStore
from p2psync.transport.board import Board
from p2psync.transport.listen import advertised, bind
from p2psync.transport.metrics import Metrics
from p2psync.transport.server import serve
from p2psync.transport.tls import Tls
from p2psync.transport.view import HeadSignal

if TYPE_CHECKING:
    from aiohttp import web

    from p2psync.artifact import Manifest
    from p2psync.control.api import WorkSink, WorkSource
    from p2psync.control.gossip_service import GossipService
    from p2psync.state import ModelState
    from p2psync.transport.fetch import Upstream
    from p2psync.transport.messages import Catalogue

logger = logging.getLogger(__name__)


def _slow_start_after_idle() -> bool:
    """Whether this host (network namespace) restarts TCP slow start on idle connections (Linux)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() == "1"
    except OSError:
        return False


class Node:
    """One peer. Build with ``await Node.create(config)`` (or ``async with``); stop with :meth:`close`."""

    def __init__(self, config: NodeConfig, tls: Tls | None = None) -> None:
        """The parts that need no event-loop work; :meth:`create` builds the rest and starts them.

        ``tls``: the node's TLS (default: :meth:`Tls.for_node` of ``config``)."""
        self.config = config
        self.log = NodeAdapter(logger, {"node": config.id, "region": config.region})
        self.tls = tls if tls is not None else Tls.for_node(config)
        """Certificates, contexts and revoked ids of every link this node serves or opens."""
        self.public_key = keys.load_public(config.trainer_public_key)
        self.private_key = keys.load_private(config.trainer_private_key) if config.trainer_private_key else None
        self.store = VersionStore.open(Path(config.data_dir), self.public_key, fsync=config.store.fsync,
                                       cache_bytes=config.store.cache_bytes)
        self.board = Board()
        self.metrics = Metrics()
        self.heads = HeadSignal()
        self.address = ""
        self._tasks = Tasks(config.id, self.log)
        self.replica = Replica(config, self.log, self.store, self.board, self.metrics, self.heads,
                               self._tasks.stop, self._tasks.spawn)
        self.origin: Origin | None = None
        """The trainer node's publisher."""
        self.follower: Follower | None = None
        """A relay's or rollout node's follower of its parents."""
        self.routes: NodeRoutes | None = None
        self._runner: web.AppRunner | None = None
        self.services: list[Any] = []
        """Optional parts (control plane, probes, live page), in start order: see :mod:`p2psync.services`."""
        self.gossip: GossipService | None = None
        """The gossip service when gossip is on."""
        self.coordinator: WorkSink | None = None
        """Trainer: the coordinator (``submit``, ``results``)."""
        self.work: WorkSource | None = None
        """Rollout node: leases on rollout work."""

    # --- lifecycle ---------------------------------------------------------------------------
    @classmethod
    async def create(cls, config: NodeConfig, *, publish_dir: str | None = None,
                     sock: socket.socket | None = None, tls: Tls | None = None) -> Node:
        """Serving on return; weights load in the background (:attr:`loaded` is set after).

        ``sock``: an already listening socket (from :func:`p2psync.transport.server.bind`).
        ``tls``: the node's TLS, if already built (default: from ``config``).
        """
        node = cls(config, tls)
        try:
            await node._start(publish_dir, sock or bind(config.listen.host, config.listen.port))
        except BaseException:
            await node.close()
            raise
        return node

    async def _start(self, publish_dir: str | None, sock: socket.socket) -> None:
        cfg = self.config
        if publish_dir is not None and cfg.role != "trainer":
            raise P2PSyncError("only the trainer node publishes (--publish-dir needs --role trainer)")
        self.address = advertised(sock, cfg.listen.host, cfg.listen.advertise, cfg.tls.enabled)
        parts = build_services(self)
        self.services, self.gossip, self.coordinator, self.work = parts.started, parts.gossip, parts.coordinator, \
            parts.work
        if cfg.role == "trainer":
            self.origin = Origin(cfg, self.log, self.store, self.board, self.heads, self.public_key,
                                 self.private_key, self.replica)
        else:
            self.follower = await Follower.create(cfg, self.log, self.store, self.board, self.metrics, self.heads,
                                                  self.public_key, self.replica, self._tasks.stop,
                                                  self._tasks.spawn, self.tls)
        self.routes = NodeRoutes(cfg, self.store, self.board, self.metrics, self.heads, self.replica, self.follower,
                                 self.address, self.extra_routes)
        self._runner = await serve(self.routes, sock, self.tls)
        for svc in self.services:
            await svc.start()
        self._tasks.spawn(self.replica.load(), "load")
        if self.follower is not None:
            self.follower.start()
        elif publish_dir is not None:
            assert self.origin is not None
            self._tasks.spawn(self.origin.publish_dir(Path(publish_dir)), "publish-dir")
        self.log.info("%s listening on %s (store: %d artifacts)", cfg.role, self.address, len(self.store.artifacts))
        if _slow_start_after_idle():
            self.log.info("net.ipv4.tcp_slow_start_after_idle is 1 on this host: streams to children restart TCP "
                          "slow start after each idle gap; on WAN links set it to 0 (p2psync.transport.push, "
                          "'TCP windows')")

    @property
    def failure(self) -> BaseException | None:
        """The exception of the task that crashed, if one did (the node then stops)."""
        return self._tasks.failure

    async def wait_stopped(self) -> None:
        """Return when a task crashed (see :attr:`failure`) or :meth:`close` began."""
        await self._tasks.stop.wait()

    async def close(self) -> None:
        """Stop tasks, checkpoint the weights if they moved (``store.checkpoint_on_exit``), stop serving."""
        self.log.info("stopping at version %s", self.version)
        self._tasks.stop.set()
        self.heads.close()
        if self.follower is not None:
            self.follower.halt()
        self.replica.applied_signal.close()
        for svc in reversed(self.services):
            try:
                await svc.stop()
            except Exception as exc:  # noqa: BLE001 - one service failing to stop must not block the rest
                self.log.warning("service %s failed to stop: %r", type(svc).__name__, exc)
        await self._tasks.cancel_all()
        await self.replica.close()
        if self.follower is not None:
            await self.follower.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.replica.shutdown_pool()
        self.log.info("stopped at version %s", self.version)

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- weights (the replica) -------------------------------------------------------------------
    @property
    def state(self) -> ModelState | None:
        return self.replica.state

    @property
    def version(self) -> int | None:
        return self.replica.version

    @property
    def fingerprint(self) -> str | None:
        return self.replica.fingerprint

    @property
    def loaded(self) -> asyncio.Event:
        """Set once the checkpoint and the local delta chain are applied."""
        return self.replica.loaded

    def release_weights(self) -> bool:
        """Drop this node's decoded copy of the weights once an engine holds them (see
        ``store.hold_weights``); returns whether the node holds none now."""
        return self.replica.release_weights()

    @property
    def state_lock(self) -> threading.Lock:
        """Held while the node writes ``state`` in place: a reader that holds it sees one version's words."""
        return self.replica.state_lock

    def subscribe(self) -> AsyncIterator[Manifest]:
        """Each artifact applied from now on, in version order, after it was applied."""
        return self.replica.subscribe()

    async def wait_version(self, version: int) -> None:
        """Return once the applied version is at least ``version``."""
        await self.replica.wait_version(version)

    async def settle(self) -> None:
        """Wait for the housekeeping of the last applied version (snapshot, checkpoint, retention)."""
        await self.replica.settle()

    def keep_decoded(self, count: int = 2) -> None:
        """See :meth:`p2psync.node.replica.Replica.keep_decoded`."""
        self.replica.keep_decoded(count)

    def decoded(self, artifact_id: str) -> tuple[dict, list[tuple[int, int]]] | None:
        """See :meth:`p2psync.node.replica.Replica.decoded`."""
        return self.replica.decoded(artifact_id)

    # --- trainer (the origin) ----------------------------------------------------------------------
    async def publish(self, manifest: Manifest, chunks: list[bytes],
                      changes: dict[int, tuple[Any, Any]] | None = None) -> None:
        """Trainer only: see :meth:`p2psync.node.origin.Origin.publish`."""
        if self.origin is None:
            raise P2PSyncError(f"only the trainer publishes (this node is a {self.config.role})")
        await self.origin.publish(manifest, chunks, changes)

    # --- follower ------------------------------------------------------------------------------
    @property
    def upstream(self) -> Upstream | None:
        """A follower's candidate parents and the fetches from them (None on the trainer)."""
        return self.follower.upstream if self.follower is not None else None

    def set_planned_parent(self, url: str | None, parent_id: str | None = None) -> None:
        """Follow the live plan: ``url`` becomes the first candidate parent, the configured ones
        follow. The switch happens at once if the current parent changes; chunks held are kept."""
        if self.follower is not None:
            self.follower.set_planned_parent(url, parent_id)

    # --- what the server and the services see --------------------------------------------------
    def catalogue(self) -> Catalogue:
        assert self.routes is not None
        return self.routes.catalogue()

    def status(self) -> dict:
        """``GET /v1/status``."""
        assert self.routes is not None
        return self.routes.status()

    def note_child(self, node_id: str, address: str) -> None:
        assert self.routes is not None
        self.routes.note_child(node_id, address)

    def extra_routes(self) -> list:
        return [r for svc in self.services for r in svc.routes()]

    def update_self(self, *, throughput: float | None = None, bandwidth: float | None = None) -> None:
        """Report a measured decode throughput (tokens/s) or download bandwidth (bytes/s) to the
        coordinator (through gossip; a no-op without it)."""
        if self.gossip is not None:
            self.gossip.update_self(throughput=throughput, bandwidth=bandwidth)

    def cluster(self) -> list[dict]:
        """Every node this one knows, for status pages: ``id``, ``role``, ``region``, ``address``
        (advertised URL), ``version`` (the coordinator knows every node's; others know their own),
        ``status`` (alive, suspect, dead, left) and ``parent`` (planned parent id, or None)."""
        if self.gossip is not None:
            found = self.gossip.cluster()
            if found:
                return found
        cfg = self.config
        return [{"id": cfg.id, "role": cfg.role, "region": cfg.region, "address": self.address,
                 "version": self.version, "status": "alive", "parent": None}]
