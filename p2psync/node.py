"""A p2psync peer: version store, HTTP server, and a follower of its candidate parents.

Roles. The trainer node is the root and the only publisher (:meth:`Node.publish`);
relays and rollout nodes follow: they learn new heads from their parent's stream
(``/v1/stream``, or ``/v1/events`` from a parent without it), plan the cheapest
catch-up (:func:`p2psync.store.plan_catchup`), fetch with several streams, verify
every chunk, apply all-or-nothing, and serve what they hold (or are still
fetching: cut-through) to their own children. Deltas up to ``limits.push_bytes``
arrive pushed on that stream instead (:mod:`p2psync.transport.push`): verified
the same way, pulled as before whatever did not arrive.

Snapshots for joiners. Relays cannot sign, so the trainer signs the snapshots a
relay serves. Every ``store.snapshot_interval`` versions the trainer encodes its
weights as a *raw* snapshot (``zstd_level=0``, ``store.snapshot_chunk_size``)
and signs its manifest, beside the next version's announcement and transfer
(housekeeping: see ``Node._after_apply``). Raw segments are a pure function of the weights, the
tensor table and the chunk size, so any node holding version v bit-exactly can
rebuild the very same chunks from its own state without downloading them: a
follower that applied v and sees a signed snapshot manifest for v upstream
fetches only that manifest (a few KiB of hashes), re-encodes, verifies every
rebuilt chunk against the signed hashes, and only then stores and serves it.
A relay can therefore offer a joiner a recent snapshot without the trainer
sending one over the WAN, and a rebuilt chunk that does not match is never
served. (Compressed snapshots would tie the bytes to one zstd build; raw ones
do not. A joiner still takes whichever is fewer bytes: that raw snapshot plus
deltas, or any older, compressed snapshot plus a longer delta chain.)

Contracts: every manifest a node stores or serves verified against the
trainer's key; ``version``/``fingerprint`` change only after
:meth:`Applier.commit` matched the target fingerprint; :meth:`Node.subscribe`
yields applied artifacts in version order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2psync import keys
from p2psync.artifact import ArtifactFile, Manifest
from p2psync.codec.decode import Applier
from p2psync.config import NodeConfig
from p2psync.errors import ChunkHashMismatch, CodecError, P2PSyncError, PeerUnreachable, WrongBase
from p2psync.logs import NodeAdapter
from p2psync.store import ArtifactInfo, VersionStore, plan_catchup
from p2psync.transport.board import Board
from p2psync.transport.client import PeerClient, cancel_quietly
from p2psync.transport.fetch import Pipeline, Upstream, fetch_chunks
from p2psync.transport.listen import advertised, bind
from p2psync.transport.messages import Catalogue
from p2psync.transport.metrics import Metrics
from p2psync.transport.parents import ParentSet
from p2psync.transport.push import CatalogueFrame, ChunkFrame, ManifestFrame, Pushes, PushUnsupported, read_stream
from p2psync.transport.server import serve
from p2psync.transport.view import HeadSignal

if TYPE_CHECKING:
    from p2psync.state import ModelState

logger = logging.getLogger(__name__)

_CHILD_TTL = 30.0
_LOG_KEEP = 1024


async def _nothing() -> None:
    return None


def _slow_start_after_idle() -> bool:
    """Whether this host (network namespace) restarts TCP slow start on idle connections (Linux)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() == "1"
    except OSError:
        return False


def _lower_thread_priority(steps: int) -> None:
    """Pool initializer: run this thread ``steps`` of ``nice`` below the process (Linux threads carry
    their own nice value; threads they start inherit it). Elsewhere, or if refused: unchanged."""
    if steps <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except OSError:
        pass


class Node:
    """One peer. Build with ``await Node.create(config)`` (or ``async with``); stop with :meth:`close`."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.log = NodeAdapter(logger, {"node": config.id, "region": config.region})
        self.public_key = keys.load_public(config.trainer_public_key)
        self.private_key = keys.load_private(config.trainer_private_key) if config.trainer_private_key else None
        self.store = VersionStore.open(Path(config.data_dir), self.public_key, fsync=config.store.fsync,
                                       cache_bytes=config.store.cache_bytes)
        self.board = Board()
        self.metrics = Metrics()
        self.heads = HeadSignal()
        self.state: ModelState | None = None
        self.version: int | None = None
        self.fingerprint: str | None = None
        self.address = ""
        self.loaded = asyncio.Event()
        self.upstream: Upstream | None = None
        self._runner: Any = None
        self._client: PeerClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self.failure: BaseException | None = None
        self._applied: list[Manifest] = []
        self._applied_base = 0
        self._applied_signal = HeadSignal()
        self.state_lock = threading.Lock()
        """Held while the node writes ``state`` in place (an apply's commit): a reader that holds
        it (e.g. a rollout engine copying the weights) sees one version's words, never a mix."""
        self._keep_decoded = 0
        self._pushes = Pushes()
        self._no_push: set[str] = set()
        self._decoded: OrderedDict[str, tuple[dict, list[tuple[int, int]]]] = OrderedDict()
        self._decoded_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._decode_pool = ThreadPoolExecutor(config.limits.parallel_streams + 2, thread_name_prefix="p2psync-apply",
                                               initializer=_lower_thread_priority,
                                               initargs=(config.limits.decode_nice,))
        """Decode and apply threads (at ``limits.decode_nice`` below the node's other threads)."""
        self._children: dict[str, tuple[str, float]] = {}
        self._upstream_cat: Catalogue | None = None
        self._wake = asyncio.Event()
        self._parent_changed = asyncio.Event()
        self._codec_warm = False
        self._stream_unpadded = False  # the open push stream asked for no padding (see _watch)
        self._publish_lock = asyncio.Lock()
        self._checkpointed: int | None = None
        self._housekeeping: asyncio.Task | None = None
        """Work on the applied version after its commit (snapshot, checkpoint, retention): see
        :meth:`_after_apply`. The next commit waits for it; nothing else does."""
        self._rebuilt: set[int] = set()  # versions whose signed snapshot we rebuilt (or are rebuilding)
        self._snapshots_pending: set[int] = set()
        """Versions whose signed snapshot this node is making (trainer) or rebuilding (relay), listed
        in the catalogue from before the next version is announced: see :meth:`_materialise`."""
        self._upstream_seen = HeadSignal()  # bumped for every catalogue the parent sends
        self._progress: dict[str, int] = {}
        self.services: list[Any] = []
        """Optional parts (control plane, probes, live page): see :mod:`p2psync.services`."""
        self.gossip: Any = None
        """The gossip service (:class:`p2psync.control.gossip_service.GossipService`) when gossip is on."""
        self.coordinator: Any = None
        """Trainer: the coordinator, a :class:`p2psync.control.api.WorkSink` (``submit``, ``results``)."""
        self.work: Any = None
        """Rollout node: a :class:`p2psync.control.api.WorkSource` (leases on rollout work)."""

    # --- lifecycle ---------------------------------------------------------------------------
    @classmethod
    async def create(cls, config: NodeConfig, *, publish_dir: str | None = None,
                     sock: socket.socket | None = None) -> Node:
        """Serving on return; weights load in the background (:attr:`loaded` is set after).

        ``sock``: an already listening socket (from :func:`p2psync.transport.server.bind`).
        """
        node = cls(config)
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
        self.address = advertised(sock, cfg.listen.host, cfg.listen.advertise)
        from p2psync.services import build_services

        self.services = build_services(self)
        self._runner = await serve(self, sock)
        for svc in self.services:
            await svc.start()
        self._spawn(self._load(), "load")
        if cfg.role != "trainer":
            lim = cfg.limits
            self._client = await PeerClient.create(cfg.token(), cfg.id, stall_timeout=lim.stall_timeout,
                                                   sse_keepalive=lim.sse_keepalive,
                                                   parallel_streams=lim.parallel_streams)
            parents = ParentSet(list(cfg.parents), lim.retry_after, lim.avoid_seconds)
            self.upstream = Upstream(self._client, parents, self.metrics, self._parent_changed.set, self.log)
            self._spawn(self._watch_upstream(), "upstream")
            self._spawn(self._follow(), "follow")
        elif publish_dir is not None:
            self._spawn(self._publish_dir(Path(publish_dir)), "publish-dir")
        self.log.info("%s listening on %s (store: %d artifacts)", cfg.role, self.address, len(self.store.artifacts))
        if _slow_start_after_idle():
            self.log.info("net.ipv4.tcp_slow_start_after_idle is 1 on this host: streams to children restart TCP "
                          "slow start after each idle gap; on WAN links set it to 0 (p2psync.transport.push, "
                          "'TCP windows')")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=f"{self.config.id}:{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        self.log.error("task %s crashed: %r; stopping", task.get_name(), self.failure, exc_info=self.failure)
        self._stop.set()

    async def wait_stopped(self) -> None:
        """Return when a task crashed (see :attr:`failure`) or :meth:`close` began."""
        await self._stop.wait()

    async def close(self) -> None:
        """Stop tasks, checkpoint the weights if they moved (``store.checkpoint_on_exit``), stop serving."""
        self.log.info("stopping at version %s", self.version)
        self._stop.set()
        self.heads.close()
        self._upstream_seen.close()  # a rebuild waiting for a snapshot manifest gives up
        self._applied_signal.close()
        for svc in reversed(self.services):
            try:
                await svc.stop()
            except Exception as exc:  # noqa: BLE001 - one service failing to stop must not block the rest
                self.log.warning("service %s failed to stop: %r", type(svc).__name__, exc)
        for t in self._tasks:
            await cancel_quietly(t)
        await self._settle()
        if (self.config.store.checkpoint_on_exit and self.state is not None and self.version is not None
                and self._checkpointed != self.version):
            await asyncio.to_thread(self._checkpoint)
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        self.log.info("stopped at version %s", self.version)

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- what the server sees ----------------------------------------------------------------
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
        pending = tuple(sorted(self._snapshots_pending.difference(snaps)))
        return Catalogue(self.config.id, self.config.region, self.version, self.fingerprint, head, all_arts, snaps,
                         pending)

    def note_child(self, node_id: str, address: str) -> None:
        self._children[node_id] = (address, time.time())

    # --- control plane ---------------------------------------------------------------------------
    def set_planned_parent(self, url: str | None, parent_id: str | None = None) -> None:
        """Follow the live plan: ``url`` becomes the first candidate parent, the configured ones
        follow. The switch happens at once if the current parent changes; chunks held are kept."""
        if self.upstream is None:
            return
        parents = self.upstream.parents
        if parents.plan(url):
            self.log.info("planned parent: %s (%s); candidates %s", parent_id, url, parents.candidates)
            self._parent_changed.set()  # the watcher re-picks (the same parent: it just reconnects)

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

    def extra_routes(self) -> list:
        return [r for svc in self.services for r in svc.routes()]

    def status(self) -> dict:
        now = time.time()
        up = self._upstream_cat
        transfers = {}
        for aid in self.board.ids:
            art = self.store.artifacts.get(aid)
            if art is not None:
                transfers[aid] = {"chunks_held": len(art.held), "chunks": len(art.manifest.chunks),
                                  "bytes_held": art.held_bytes, "bytes": art.manifest.payload_bytes}
        parents = self.upstream.parents if self.upstream else None
        return {
            "node": self.config.id, "role": self.config.role, "region": self.config.region,
            "address": self.address, "loaded": self.loaded.is_set(),
            "version": self.version, "fingerprint": self.fingerprint,
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

    # --- weights -------------------------------------------------------------------------------
    async def _load(self) -> None:
        """Checkpointed weights, then the local delta chain up to the newest version held.

        Meanwhile a background thread imports torch and loads the codec's compiled kernels
        (seconds on first use), so that the first artifact after start applies at full speed
        instead of paying for them between its last chunk and its commit
        (:mod:`p2psync.transport.warm`).
        """
        async def warm_up() -> None:
            from p2psync.transport.warm import warm_up_process

            try:
                took = await warm_up_process()
            except Exception as exc:  # noqa: BLE001 - only a speed-up: the real apply path reports errors
                self.log.warning("codec warm-up failed (the first apply will be slower): %r", exc)
                took = None
            if took is not None:
                self.metrics.set("p2psync_codec_warm_seconds", took)
                self.log.info("codec warm in %.2f s", took)
            self._codec_warm = True
            self._pad_stream_if_settled()

        self._spawn(warm_up(), "warm-up")
        loaded = await asyncio.to_thread(self.store.load_state)
        if loaded is not None:
            self.state, self.version = loaded
            self.fingerprint = self.state.fingerprint
            self._checkpointed = self.version
        head = self.store.head
        if head is not None and (self.version is None or head > self.version):
            try:
                plan = plan_catchup(self.version, head, self.store.catalogue())
            except P2PSyncError as exc:
                self.log.warning("store holds no path to version %s: %s", head, exc)
                plan = []
            for info in plan:
                art = self.store.artifacts[info.id]
                chunks = await asyncio.to_thread(self.store.chunks, info.id)
                await self._commit(art.manifest, chunks)
        self.metrics.set("p2psync_version", -1 if self.version is None else self.version)
        self.loaded.set()
        self.heads.bump()
        self.log.info("weights loaded: version %s fingerprint %s", self.version, self.fingerprint)

    async def _commit(self, manifest: Manifest, chunks: list[bytes] | None = None, applier: Any = None,
                      changes: dict[int, tuple[Any, Any]] | None = None) -> None:
        """Apply ``manifest`` all-or-nothing (from ``chunks``, an ``applier`` already fed, or the
        delta's ``changes`` as its publisher extracted them: see :meth:`publish`).

        First waits for the previous version's housekeeping: it reads the weights this changes."""
        await self._settle()

        def work() -> tuple[ModelState, str]:
            if changes is not None:
                adopted = Applier.adopting(self.state, manifest, changes)
                with self.state_lock:
                    return adopted.state, adopted.commit()
            ap = applier or Applier.onto(self.state, manifest)
            if chunks is not None:
                ap.add_chunks(enumerate(chunks), 2)
            ap.keep_changes = self._keep_decoded > 0
            with self.state_lock:
                fp = ap.commit()
            if ap.changes is not None:
                self._remember_decoded(manifest.artifact_id, ap.changes, ap.state.tensor_sums())
            return ap.state, fp

        state, fp = await asyncio.get_running_loop().run_in_executor(self._decode_pool, work)
        self.state, self.version, self.fingerprint = state, manifest.target_version, fp
        self.metrics.inc("p2psync_versions_applied_total")
        self.metrics.set("p2psync_version", manifest.target_version)
        self._applied.append(manifest)
        if len(self._applied) > _LOG_KEEP:
            self._applied.pop(0)
            self._applied_base += 1
        self._applied_signal.bump()
        self.heads.bump()  # the catalogue names the applied version: event streams announce it now
        self.log.info("applied %s (%d bytes) -> version %d fingerprint %s", manifest.artifact_id,
                      manifest.payload_bytes, manifest.target_version, fp)

    def _checkpoint(self) -> None:
        # One writer at a time: a stop cancels the task awaiting an interval checkpoint, not its
        # thread, and its own checkpoint would otherwise race it for the same temporary file.
        with self._checkpoint_lock:
            state, version = self.state, self.version
            if state is None or version is None or self._checkpointed == version:
                return
            self.store.save_state(state, version)
            self._checkpointed = version

    def _after_apply(self, first: Any = None, snapshot_of: int | None = None) -> None:
        """Start the applied version's housekeeping and return at once.

        Housekeeping: ``first`` (a coroutine: the trainer signs a raw snapshot, a relay rebuilds
        one), a checkpoint every ``checkpoint_interval`` versions, then retention. On a large
        model the snapshot and the checkpoint each encode and write every weight (tens of
        seconds for 16 GB), so they run beside the next artifact's announcement, transfer and
        forwarding instead of in front of them. They read the weights of the version just
        applied, so the next commit (the only writer) waits for them (:meth:`_commit`). A
        failure is logged and counted and loses nothing: the version stays applied, and the
        snapshot or checkpoint is simply not there (the next interval makes one).

        ``snapshot_of``: the version whose signed snapshot ``first`` makes; the catalogue lists it
        as pending from now until the housekeeping ends (see :class:`Catalogue`).
        """
        prev = self._housekeeping
        if snapshot_of is not None:
            self._snapshots_pending.add(snapshot_of)

        async def run() -> None:
            try:
                if prev is not None:
                    await asyncio.shield(prev)
            except BaseException:
                if first is not None:
                    first.close()  # never started: no "never awaited" warning
                raise
            if first is not None:
                await first
            every = self.config.store.checkpoint_interval
            if every and self.version is not None and (self._checkpointed is None or
                                                       self.version - self._checkpointed >= every):
                await asyncio.to_thread(self._checkpoint)
            removed = self.store.prune(self.config.store.keep_deltas, self._checkpointed, self.board.ids)
            if removed:
                self.log.info("retention removed %d artifacts", len(removed))
                self.heads.bump()

        async def guarded() -> None:
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the applied version stands; see the docstring
                self.metrics.inc("p2psync_housekeeping_errors_total")
                self.log.error("housekeeping after version %s failed: %r", self.version, exc)
            finally:
                if snapshot_of is not None:
                    self._snapshots_pending.discard(snapshot_of)
                    self.heads.bump()

        self._housekeeping = asyncio.get_running_loop().create_task(guarded(), name=f"housekeeping-{self.version}")
        self._pad_stream_if_settled()

    async def _settle(self) -> None:
        """Wait for the housekeeping started after the last commit (a no-op if it is done).

        Shielded: a caller cancelled while waiting does not cancel the housekeeping, whose
        threads would go on reading the weights regardless.
        """
        task = self._housekeeping
        if task is not None and not task.done():
            await asyncio.shield(task)

    def _settled(self) -> bool:
        """Codec warm, weights held and caught up with the parent: the node reads its stream at
        once, so padding sent now opens the stream's TCP windows (see :meth:`_watch`)."""
        cat = self._upstream_cat
        return self._codec_warm and self.version is not None and (cat is None or cat.head is None
                                                                  or cat.head <= self.version)

    def _pad_stream_if_settled(self) -> None:
        if self._stream_unpadded and self._settled():
            self._stream_unpadded = False
            self.log.info("settled: re-opening the push stream to be padded")
            self._parent_changed.set()  # the watcher re-opens its stream to the same parent

    async def subscribe(self) -> AsyncIterator[Manifest]:
        """Each artifact applied from now on, in version order, after it was applied."""
        seen = self._applied_base + len(self._applied)
        while not self._stop.is_set():
            seq = self._applied_signal.seq
            end = self._applied_base + len(self._applied)
            for k in range(max(seen, self._applied_base), end):
                yield self._applied[k - self._applied_base]
            seen = end
            await self._applied_signal.wait(seq, 3600)

    async def wait_version(self, version: int) -> None:
        """Return once the applied version is at least ``version``."""
        while self.version is None or self.version < version:
            if self._stop.is_set():
                raise P2PSyncError(f"node stopped before reaching version {version}")
            await self._applied_signal.wait(self._applied_signal.seq, 1.0)

    # --- trainer --------------------------------------------------------------------------------
    async def publish(self, manifest: Manifest, chunks: list[bytes],
                      changes: dict[int, tuple[Any, Any]] | None = None) -> None:
        """Trainer only: verify, store and announce ``manifest``, then apply it to the trainer's copy.

        ``changes`` (a delta only): ``tensor index -> (positions, new words)``, the changes the
        chunks encode, as the publisher extracted them. The trainer's copy then takes them
        directly, after checking that they turn its weights into the manifest's signed target
        fingerprint (work proportional to the changed elements), instead of decoding every
        chunk again: on a large model that decode is seconds of the trainer's CPU per step.
        What this skips is a self-test of the encoder; every receiver still decodes and checks
        the target fingerprint before it applies anything, so a wrong encoding is refused
        everywhere and lost nowhere.

        Children are told about the artifact as soon as its manifest is stored, and may fetch
        each chunk the moment it is verified and stored here (cut-through, as on a relay): the
        trainer's own apply (decode, fingerprint check, write) runs after the announcement, not
        in front of it. That is safe because no node ever commits an artifact whose result does
        not hash to the signed target fingerprint; if the trainer's own commit fails, the
        artifact is withdrawn (removed and the head announced again) and the error raised, so a
        publisher learns about it at once.

        A delta must have the current version as its base; a snapshot may start or restart the
        chain. Raises (and stores nothing new) if the signature, a chunk or the result is wrong.
        Returns once the trainer's copy is at the new version.
        """
        if self.config.role != "trainer":
            raise P2PSyncError(f"only the trainer publishes (this node is a {self.config.role})")
        await self.loaded.wait()
        async with self._publish_lock:
            manifest.verify(self.public_key)
            if manifest.kind == "delta" and manifest.base_version != self.version:
                raise WrongBase(str(manifest.base_fingerprint), str(self.fingerprint), manifest.base_version)
            if self.version is not None and manifest.target_version <= self.version:
                raise CodecError(f"version {manifest.target_version} is not newer than {self.version}")
            if len(chunks) != len(manifest.chunks):
                raise CodecError(f"{len(chunks)} chunks given, manifest has {len(manifest.chunks)}")
            aid = manifest.artifact_id
            fresh = aid not in self.store.artifacts
            self.store.add_manifest(manifest)
            announced = self.config.cut_through
            if announced:
                self.board.begin(aid, len(manifest.chunks))
                self.heads.bump()
            loop = asyncio.get_running_loop()

            def store_all() -> None:
                for i, c in enumerate(chunks):
                    self.store.put_chunk(aid, i, c)
                    if announced:
                        loop.call_soon_threadsafe(self.board.arrived, aid, i)

            try:
                await asyncio.to_thread(store_all)
                if announced:
                    self.board.end(aid)
                self.heads.bump()  # complete: listed as held from now on
                self.log.info("published %s", aid)
                await self._commit(manifest, chunks, changes=changes if manifest.kind == "delta" else None)
                self.heads.bump()  # the trainer's own version moved
            except BaseException:
                self.board.end(aid)
                if fresh:
                    self.store.remove(aid)
                    self.log.error("withdrew %s: it did not apply to the trainer's own copy", aid)
                self.heads.bump()
                raise
            every = self.config.store.snapshot_interval
            first = None
            if self.private_key is not None and every and manifest.kind == "delta" \
                    and manifest.target_version % every == 0:
                first = self._sign_snapshot_task(manifest.model_id)
            # Listed as pending before the lock is released, so before any newer version is
            # announced: a relay then waits for this snapshot instead of moving past it.
            self._after_apply(first, manifest.target_version if first is not None else None)

    async def _snapshot_signed(self, version: int) -> bool:
        """Wait until the parent lists the signed snapshot manifest of ``version`` (see :meth:`_materialise`)."""
        lim = self.config.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.store.snapshot_wait
        while True:
            seq = self._upstream_seen.seq
            cat = self._upstream_cat
            if self._stop.is_set():
                return False
            if cat is not None and version in cat.snapshot_manifests:
                return True
            if cat is not None and version not in cat.snapshots_pending:
                self.log.warning("parent no longer makes the snapshot of version %d; not rebuilding it", version)
                return False
            left = deadline - loop.time()
            if left <= 0:
                self.log.warning("no signed snapshot of version %d after %.0f s; not rebuilding it", version,
                                 self.config.store.snapshot_wait)
                return False
            await self._upstream_seen.wait(seq, min(left, lim.poll_interval))
            if self._upstream_seen.seq == seq:
                await self._poll()  # nothing heard: the push stream may be down

    async def _sign_snapshot_task(self, model_id: str) -> None:
        snap = await asyncio.to_thread(self._sign_snapshot, model_id)
        self.heads.bump()
        self.log.info("signed raw snapshot %s", snap.artifact_id)

    def _sign_snapshot(self, model_id: str) -> Manifest:
        """Sign and store a raw snapshot of the weights in two passes (the manifest from every
        chunk's hash, then the chunks encoded again and stored), in a few chunks of memory. The
        manifest is listed from the first pass on, before the chunks: relays rebuild the chunks
        from their own weights, and joiners only use complete snapshots."""
        from p2psync.artifact import snapshot_chunks_to, snapshot_manifest
        from p2psync.codec.encode import CodecOptions

        assert self.state is not None and self.version is not None
        opts = CodecOptions(chunk_size=self.config.store.snapshot_chunk_size, zstd_level=0)
        m = snapshot_manifest(self.state, opts, model_id=model_id, target_version=self.version,
                              private_key=self.private_key)
        self.store.add_manifest(m)
        try:
            snapshot_chunks_to(self.state, m, opts, lambda i, c: self.store.put_chunk(m.artifact_id, i, c),
                               verify=False)  # put_chunk verifies
        except BaseException:
            self.store.remove(m.artifact_id)
            raise
        return m

    async def _publish_dir(self, directory: Path) -> None:
        """Publish every artifact file appearing in ``directory``, in version order.

        Each file's manifest is parsed and its signature checked once (again only if the file
        changes: inode, size or mtime); a file is read whole, off the event loop, when its turn
        comes. Files at or below the node's version are left alone."""
        await self.loaded.wait()
        bad: set[Path] = set()
        headers: dict[Path, tuple[tuple[int, int, int], int, str, int | None]] = {}

        def read(path: Path) -> tuple[Manifest, list[bytes]]:
            with ArtifactFile(path, self.public_key) as art:
                return art.manifest, [c for _, c in art.chunks()]

        while True:
            ready = []
            present: set[Path] = set()
            for path in sorted(directory.glob("*")):
                if path in bad or path.name.endswith(".tmp"):
                    continue
                try:
                    st = path.stat()
                except OSError:  # removed meanwhile
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                present.add(path)
                key = (st.st_ino, st.st_size, st.st_mtime_ns)
                head = headers.get(path)
                if head is None or head[0] != key:
                    try:
                        with ArtifactFile(path, self.public_key) as art:
                            m = art.manifest
                            head = headers[path] = (key, m.target_version, m.kind, m.base_version)
                    except P2PSyncError as exc:
                        self.log.error("publish-dir: skipping %s: %s", path.name, exc)
                        bad.add(path)
                        continue
                ready.append((head[1], head[2] != "snapshot", path))
            for gone in headers.keys() - present:
                del headers[gone]
            for target, is_delta, path in sorted(ready):
                if self.version is not None and target <= self.version:
                    continue
                if is_delta and headers[path][3] != self.version:
                    break  # wait for the file that fills the gap
                try:
                    m, chunks = await asyncio.to_thread(read, path)
                    await self.publish(m, chunks)
                except FileNotFoundError:
                    break  # taken away meanwhile: look again
                except P2PSyncError as exc:
                    self.log.error("publish-dir: %s not published: %s", path.name, exc)
                    bad.add(path)
                    break
            await asyncio.sleep(0.2)

    # --- follower -------------------------------------------------------------------------------
    async def _watch_upstream(self) -> None:
        """Keep an event stream open to the current parent; move when the parent changes."""
        assert self.upstream is not None
        up = self.upstream
        while True:
            url = await up.pick()
            self._parent_changed.clear()
            watch = asyncio.create_task(self._watch(url), name=f"{self.config.id}:watch:{url}")
            moved = asyncio.create_task(self._parent_changed.wait(), name=f"{self.config.id}:moved")
            try:
                await asyncio.wait({watch, moved}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                moved.cancel()  # at once: if we are being cancelled, the next await re-raises
                await cancel_quietly(watch)
                await cancel_quietly(moved)
            if watch.done() and not watch.cancelled() and isinstance(watch.exception(), PeerUnreachable):
                up.failed(url, watch.exception())  # type: ignore[arg-type]

    async def _watch(self, url: str) -> None:
        assert self._client is not None and self.upstream is not None
        lim = self.config.limits
        if lim.push_bytes > 0 and url not in self._no_push:
            # Padding opens the stream's TCP windows only if this node reads it at once: a node still
            # starting (compiling its codec, loading or catching up: seconds of CPU, and the link busy
            # with its snapshot) read it slowly on the WAN testbed, and the windows stayed small. Such
            # a node opens its stream unpadded and re-opens it padded once settled.
            warm = lim.stream_warmup_bytes if self._settled() else 0
            self._stream_unpadded = lim.stream_warmup_bytes > 0 and not warm
            try:
                async for frame in read_stream(self._client, url, lim.push_bytes, self._pushed_chunk_size, warm):
                    self.upstream.ok(url)
                    await self._on_frame(url, frame)
                return
            except PushUnsupported:
                self._stream_unpadded = False
                self._no_push.add(url)
                self.log.info("parent %s cannot push; following its event stream instead", url)
        async for cat in self._client.call_events(url):
            self.upstream.ok(url)
            self._note_upstream(cat)

    def _pushed_chunk_size(self, aid: str, index: int) -> int | None:
        m = self._pushes.manifest(aid)
        return m.chunks[index].size if m is not None and 0 <= index < len(m.chunks) else None

    async def _on_frame(self, url: str, frame: CatalogueFrame | ManifestFrame | ChunkFrame) -> None:
        """A frame the parent pushed: verified exactly like pulled data before anything is kept."""
        assert self.upstream is not None
        if isinstance(frame, CatalogueFrame):
            self._note_upstream(frame.catalogue)
            return
        if isinstance(frame, ManifestFrame):
            m = frame.manifest
            try:
                m.verify(self.public_key)
                if m.kind != "delta" or m.payload_bytes > self.config.limits.push_bytes:
                    raise CodecError(f"a {m.kind} of {m.payload_bytes} bytes was not asked for")
            except P2PSyncError as exc:
                self.upstream.corrupt(url, f"a pushed manifest that does not verify ({exc})")
                raise PeerUnreachable(url, "pushed a bad manifest") from None
            if m.artifact_id not in self.store.artifacts:
                await asyncio.to_thread(self.store.add_manifest, m)
            self._pushes.expect(m)
            return
        aid, i = frame.artifact_id, frame.index
        if aid not in self.store.artifacts or self.store.has_chunk(aid, i):
            return  # pruned meanwhile, or already held
        try:
            await asyncio.to_thread(self.store.put_chunk, aid, i, frame.data)
        except ChunkHashMismatch as exc:
            self.upstream.corrupt(url, f"corrupt pushed chunk {i} of {aid} ({exc.actual} != {exc.expected})")
            raise PeerUnreachable(url, "pushed a corrupt chunk") from None
        self.metrics.inc("p2psync_bytes_in_total", len(frame.data))
        self.metrics.inc("p2psync_chunks_in_total")
        self.metrics.inc("p2psync_chunks_pushed_in_total")
        self.board.arrived(aid, i)
        self._pushes.arrived()

    def _note_upstream(self, cat: Catalogue) -> None:
        self._upstream_cat = cat
        self._upstream_seen.bump()
        self.metrics.set("p2psync_head", -1 if cat.head is None else cat.head)
        self._wake.set()

    async def _follow(self) -> None:
        """Catch up to the parent's head whenever it moves.

        Also rebuilds the trainer-signed snapshot of the version held when the parent announces
        its manifest only after we applied that version (the trainer signs it just after it
        publishes the delta), once per version.
        """
        assert self.upstream is not None and self._client is not None
        await self.loaded.wait()
        lim = self.config.limits
        while True:
            cat = self._upstream_cat
            if (cat is not None and self.config.materialise and self.version is not None
                    and self.version not in self._rebuilt and _snapshot_named(cat, self.version)):
                self._rebuilt.add(self.version)
                self._after_apply(self._materialise(self.version), self.version)  # beside the next catch-up
                continue
            if cat is None or cat.head is None or (self.version is not None and cat.head <= self.version):
                self._wake.clear()
                try:
                    async with asyncio.timeout(lim.poll_interval):
                        await self._wake.wait()
                except TimeoutError:
                    await self._poll()
                continue
            try:
                await self._catch_up(cat)
            except P2PSyncError as exc:
                self.log.warning("catch-up to version %s interrupted: %s", cat.head, exc)
                self._upstream_cat = None
                await self._poll()
                await asyncio.sleep(lim.retry_after)

    async def _poll(self) -> None:
        assert self.upstream is not None and self._client is not None
        url = await self.upstream.pick()
        try:
            self._note_upstream(await self._client.call_head(url))
        except PeerUnreachable as exc:
            self.upstream.failed(url, exc)

    async def _catch_up(self, cat: Catalogue) -> None:
        assert cat.head is not None
        plan = plan_catchup(self.version, cat.head, cat.artifacts)
        self.log.info("catching up %s -> %d via %s", self.version, cat.head, [a.id for a in plan])
        for info in plan:
            await self._fetch_apply(info)
            latest = self._upstream_cat or cat  # it may list a snapshot signed while we fetched
            first = None
            if self.config.materialise and self.version is not None and _snapshot_named(latest, self.version):
                self._rebuilt.add(self.version)
                first = self._materialise(self.version)
            self._after_apply(first, self.version if first is not None else None)

    async def _fetch_apply(self, info: ArtifactInfo) -> None:
        assert self.upstream is not None
        aid = info.id
        art = self.store.artifacts.get(aid)
        if art is None:
            m = await self.upstream.manifest(aid, lambda m: m.verify(self.public_key))
            art = self.store.add_manifest(m)
        manifest = art.manifest
        t0 = time.perf_counter()
        # Children hear of it first (cut-through: they fetch, or are pushed, each chunk the moment
        # it is verified here), before this node spends anything on its own decode and apply.
        self.board.begin(aid, len(manifest.chunks))
        self.heads.bump()
        try:
            await self._receive_apply(art, t0)
        finally:
            self.board.end(aid)
            self.heads.bump()

    async def _receive_apply(self, art: Any, t0: float) -> None:
        manifest = art.manifest
        aid = manifest.artifact_id
        assert self.upstream is not None
        applier = await asyncio.to_thread(Applier.onto, self.state, manifest)
        # Chunks decode in worker threads while later ones download (bounded, so memory is too).
        decode = Pipeline(applier.add_chunk, self.config.limits.parallel_streams + 2, self._decode_pool)
        submitted: set[int] = set()

        async def submit(i: int, data: bytes | memoryview) -> None:
            if i not in submitted:
                submitted.add(i)
                await decode.submit(i, data)

        async def submit_held() -> None:
            # Kept from an interrupted fetch or an earlier run, or pushed by the parent.
            while extra := sorted(set(art.held) - submitted):
                for i in extra:
                    data = self.store.cached_chunk(aid, i)
                    await submit(i, data if data is not None else
                                 await asyncio.to_thread(self.store.read_chunk, aid, i))

        await submit_held()
        pushed = len(submitted)
        if self._pushes.manifest(aid) is not None:
            # forward_first: a pushed delta arrives in one burst; hold it all before decoding, so
            # that receiving (and forwarding to children) does not share the CPU with its decode.
            await self._take_pushed(art, _nothing if self.config.limits.forward_first else submit_held)
            pushed = len(set(art.held) | submitted)

        def held() -> None:
            self.heads.bump()  # held complete (listed so) while it decodes and applies
            self.log.info("holds %s: %d chunks (%d held or pushed) %.3f s after its manifest", aid,
                          len(manifest.chunks), pushed, time.perf_counter() - t0)

        # All here already (pushed, forward_first): say so before the decode, whose bounded queue
        # makes submitting them wait for the first chunks' decode.
        early = len(art.held) >= len(manifest.chunks)
        if early:
            held()
        await submit_held()  # no await between its last look and fetch_chunks' look at the store
        await fetch_chunks(self.upstream, self.store, self.board, manifest,
                           self.config.limits.parallel_streams, submit)
        if not early:
            held()
        await decode.drain()
        await self._commit(manifest, applier=applier)

    async def _take_pushed(self, art: Any, submit_held: Any) -> None:
        """Decode pushed chunks as they arrive, until all are here or the push stalls for
        ``limits.stall_timeout`` (then the rest is pulled)."""
        n = len(art.manifest.chunks)
        while True:
            await submit_held()
            if len(art.held) >= n:
                break
            if not await self._pushes.wait(self.config.limits.stall_timeout):
                self.log.warning("push of %s stalled at %d of %d chunks; pulling the rest",
                                 art.manifest.artifact_id, len(art.held), n)
                break

    async def _materialise(self, version: int) -> None:
        """Rebuild the trainer-signed raw snapshot of ``version`` from our weights (see module doc).

        If the parent lists it as pending (the trainer is still signing it, or the parent still
        rebuilding it), first waits until the parent lists the manifest: this runs as the
        version's housekeeping, so the next commit waits with it (the weights must still be
        ``version``'s), while the next artifact is already received and forwarded. Gives up,
        keeping nothing, when the parent stops listing it as pending without a manifest or after
        ``store.snapshot_wait`` seconds.
        """
        assert self.upstream is not None and self._client is not None
        if self.store.find("snapshot", version, complete=True) is not None:
            return
        if not await self._snapshot_signed(version):
            return
        url = await self.upstream.pick()
        try:
            m = await self._client.call_version_manifest(url, version, "snapshot")
            m.verify(self.public_key)
        except P2PSyncError as exc:
            self.log.warning("no snapshot manifest for version %d from %s: %s", version, url, exc)
            return
        if m.target_fingerprint != self.fingerprint:
            self.log.warning("snapshot manifest for version %d names another fingerprint; ignored", version)
            return

        def rebuild() -> bool:
            # Chunk by chunk, each verified against the signed manifest as it is stored: a few
            # chunks of memory whatever the model's size. A difference removes what was stored.
            from p2psync.artifact import snapshot_chunks_to
            from p2psync.codec.encode import CodecOptions

            assert self.state is not None
            self.store.add_manifest(m)
            try:
                snapshot_chunks_to(self.state, m, CodecOptions(chunk_size=m.chunk_size, zstd_level=0),
                                   lambda i, c: self.store.put_chunk(m.artifact_id, i, c), verify=False)
            except BaseException as exc:
                self.store.remove(m.artifact_id)
                if isinstance(exc, P2PSyncError):
                    return False
                raise
            return True

        if await asyncio.to_thread(rebuild):
            self.metrics.inc("p2psync_snapshots_materialised_total")
            self.log.info("materialised signed snapshot %s from local weights", m.artifact_id)
            self.heads.bump()
        else:
            self.log.warning("rebuilt snapshot of version %d does not match the signed manifest; not serving it",
                             version)

    # --- decoded changes for an engine in this process ----------------------------------------
    def keep_decoded(self, count: int = 2) -> None:
        """Keep the decoded changes of the last ``count`` deltas this node applied (0: none), so
        that an engine in the same process adopts them (:meth:`decoded`) instead of decoding
        every artifact a second time. Memory: about 10 bytes per changed element per delta."""
        with self._decoded_lock:
            self._keep_decoded = max(0, int(count))
            while len(self._decoded) > self._keep_decoded:
                self._decoded.popitem(last=False)

    def decoded(self, artifact_id: str) -> tuple[dict, list[tuple[int, int]]] | None:
        """``(changes, sums)`` of a delta this node applied, if still kept: ``changes`` maps a
        tensor index to (positions, new words), exactly as written to the node's weights, and
        ``sums`` are the per-tensor fingerprint sums after it (they hold for any copy of the
        weights whose fingerprint equals the delta's base). Treat both as read-only."""
        with self._decoded_lock:
            return self._decoded.get(artifact_id)

    def _remember_decoded(self, artifact_id: str, changes: dict, sums: list[tuple[int, int]]) -> None:
        with self._decoded_lock:
            if self._keep_decoded <= 0:
                return
            self._decoded[artifact_id] = (changes, sums)
            while len(self._decoded) > self._keep_decoded:
                self._decoded.popitem(last=False)


def _snapshot_named(cat: Catalogue, version: int) -> bool:
    """``cat`` lists a signed snapshot manifest of ``version``, or one being made."""
    return version in cat.snapshot_manifests or version in cat.snapshots_pending
