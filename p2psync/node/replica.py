"""The versions a node holds: its weights, loading, the all-or-nothing apply, housekeeping.

:class:`Replica` owns the node's :class:`~p2psync.state.ModelState` and the one
writer of it, :meth:`Replica.commit` (the codec's
:class:`~p2psync.codec.decode.Applier`: base, table and target fingerprint
checked before anything is written). After each commit the applied version's
*housekeeping* (a snapshot the trainer signs or a relay rebuilds, a checkpoint,
retention) runs beside the next artifact's transfer; the next commit waits for
it, since it reads the weights that commit changes.

Contracts: ``version``/``fingerprint`` change only after a commit matched the
target fingerprint; :meth:`Replica.subscribe` yields applied artifacts in version
order; a reader holding :attr:`Replica.state_lock` sees one version's words.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from p2psync.codec.decode import Applier
from p2psync.errors import P2PSyncError
from p2psync.node.priority import DecodeOrder, choose, load_average, usable_cores
from p2psync.store import VersionStore, plan_catchup
from p2psync.transport.view import HeadSignal

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from p2psync.config import NodeConfig
    from p2psync.logs import NodeAdapter
    from p2psync.node.tasks import Spawn
    from p2psync.state import ModelState
    from p2psync.transport.board import Board
    from p2psync.transport.metrics import Metrics

_LOG_KEEP = 1024



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


def _give_back_memory() -> None:
    """Return freed heap memory to the system (glibc's ``malloc_trim``; elsewhere nothing): the
    dropped weights and the received chunks leave free pages inside the allocator's heaps, which
    it would otherwise keep resident."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Replica:
    """The weights and versions of one node; the only writer of its state."""

    def __init__(self, config: NodeConfig, log: NodeAdapter, store: VersionStore, board: Board, metrics: Metrics,
                 heads: HeadSignal, stop: asyncio.Event, spawn: Spawn) -> None:
        self.config = config
        self.log = log
        self.store = store
        self.board = board
        self.metrics = metrics
        self.heads = heads
        self._stop = stop
        self._spawn = spawn
        self.state: ModelState | None = None
        """The decoded weights; always None where the node does not hold them (``store.hold_weights``)."""
        self.holds_weights = config.holds_weights
        self.version: int | None = None
        self.fingerprint: str | None = None
        self.loaded = asyncio.Event()
        """Set once the checkpoint and the local delta chain are applied (:meth:`load`)."""
        self.warm = asyncio.Event()
        """Set once the codec's compiled kernels are loaded (or failed to: the apply path reports errors)."""
        self.checkpointed: int | None = None
        self.state_lock = threading.Lock()
        """Held while the node writes ``state`` in place (an apply's commit): a reader that holds
        it (e.g. a rollout engine copying the weights) sees one version's words, never a mix."""
        self._pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
        """Decode and apply threads by (``nice`` offset below the node's other threads, threads): a
        thread's nice is set once, when it starts (going back up needs privileges)."""
        self._applied: list[Manifest] = []
        self._applied_base = 0
        self.applied_signal = HeadSignal()
        self._keep_decoded = 0
        self._decoded: OrderedDict[str, tuple[dict, list[tuple[int, int]]]] = OrderedDict()
        self._decoded_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._housekeeping: asyncio.Task | None = None
        """Work on the applied version after its commit (snapshot, checkpoint, retention): see
        :meth:`after_apply`. The next commit waits for it; nothing else does."""
        self.snapshots_pending: set[int] = set()
        """Versions whose signed snapshot this node is making (trainer) or rebuilding (relay), listed
        in the catalogue from before the next version is announced."""

    async def close(self) -> None:
        """Wait for the housekeeping, checkpoint the weights if they moved (``store.checkpoint_on_exit``)."""
        await self.settle()
        if (self.config.store.checkpoint_on_exit and self.state is not None and self.version is not None
                and self.checkpointed != self.version):
            try:
                await asyncio.to_thread(self.checkpoint)
            except OSError as exc:  # a full disk: the last checkpoint stays, and the deltas after it replay
                self.metrics.inc("p2psync_housekeeping_errors_total")
                self.log.error("checkpoint of version %s at exit failed (%s); the node restarts from its "
                               "last checkpoint and the deltas it holds", self.version, exc)

    def shutdown_pool(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def pool(self, nice: int, threads: int) -> ThreadPoolExecutor:
        """``threads`` decode and apply threads that run ``nice`` steps below the node's other threads."""
        pool = self._pools.get((nice, threads))
        if pool is None:
            pool = self._pools[nice, threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"p2psync-apply-n{nice}",
                                                                   initializer=_lower_thread_priority, initargs=(nice,))
        return pool

    def decode_order(self) -> DecodeOrder:
        """How to decode and apply the next artifact, from the cores, the children following this
        node and the load now, and the settings given (:mod:`p2psync.node.priority`)."""
        lim = self.config.limits
        return choose(usable_cores(), self.board.children, load_average(), lim.parallel_streams + 2,
                      forward_first=lim.forward_first, nice=lim.decode_nice, threads=lim.decode_threads)

    async def load(self) -> None:
        """Checkpointed weights, then the local delta chain up to the newest version held.

        Meanwhile a background thread imports torch and loads the codec's compiled kernels
        (seconds on first use), so that the first artifact after start applies at full speed
        instead of paying for them between its last chunk and its commit
        (:mod:`p2psync.transport.warm`).
        """
        async def warm_up() -> None:
            from p2psync.transport.warm import warm_up_process

            try:
                # Not in the trainer's process: it is the training loop's (p2psync.transport.warm).
                took = await warm_up_process(freeze_gc=self.config.role != "trainer")
            except Exception as exc:  # noqa: BLE001 - only a speed-up: the real apply path reports errors
                self.log.warning("codec warm-up failed (the first apply will be slower): %r", exc)
                took = None
            if took is not None:
                self.metrics.set("p2psync_codec_warm_seconds", took)
                self.log.info("codec warm in %.2f s", took)
            self.warm.set()

        self._spawn(warm_up(), "warm-up")
        loaded = await asyncio.to_thread(self.store.load_state) if self.holds_weights else None
        if loaded is not None:
            self.state, self.version = loaded
            self.fingerprint = self.state.fingerprint
            self.checkpointed = self.version
        head = self.store.head
        if head is not None and (self.version is None or head > self.version):
            try:
                plan = plan_catchup(self.version, head, self.store.catalogue())
            except P2PSyncError as exc:
                self.log.warning("store holds no path to version %s: %s", head, exc)
                plan = []
            for info in plan:
                art = self.store.artifacts[info.id]
                chunks = await asyncio.to_thread(self.store.chunks, info.id) if self.holds_weights else None
                await self.commit(art.manifest, chunks)
        self.metrics.set("p2psync_version", -1 if self.version is None else self.version)
        self.loaded.set()
        self.heads.bump()
        self.log.info("weights loaded: version %s fingerprint %s", self.version, self.fingerprint)

    async def commit(self, manifest: Manifest, chunks: Sequence[bytes | memoryview] | None = None, applier: Any = None,
                     changes: dict[int, tuple[Any, Any]] | None = None, order: DecodeOrder | None = None) -> None:
        """Apply ``manifest`` all-or-nothing (from ``chunks``, an ``applier`` already fed, or the
        delta's ``changes`` as its publisher extracted them: see :meth:`p2psync.node.origin.Origin.publish`),
        on the threads ``order`` names (default: :meth:`decode_order` now).

        First waits for the previous version's housekeeping: it reads the weights this changes."""
        await self.settle()
        order = order or self.decode_order()
        if not self.holds_weights:
            self._follow(manifest)
            self._committed(manifest, manifest.target_fingerprint)
            return

        def work() -> tuple[ModelState, str]:
            if changes is not None:
                adopted = Applier.adopting(self.state, manifest, changes)
                adopted.threads = order.threads
                with self.state_lock:
                    return adopted.state, adopted.commit()
            ap = applier or Applier.onto(self.state, manifest)
            ap.threads = order.threads
            if chunks is not None:
                ap.add_chunks(enumerate(chunks), order.threads)
            ap.keep_changes = self._keep_decoded > 0
            with self.state_lock:
                fp = ap.commit()
            if ap.changes is not None:
                self._remember_decoded(manifest.artifact_id, ap.changes, ap.state.tensor_sums())
            return ap.state, fp

        state, fp = await asyncio.get_running_loop().run_in_executor(self.pool(order.nice, order.threads), work)
        if self.holds_weights:  # not dropped meanwhile (release_weights)
            self.state = state
        self._committed(manifest, fp)

    def _follow(self, manifest: Manifest) -> None:
        """Without weights: take ``manifest``'s version if it continues the signed chain.

        Its chunks were checked against the signed manifest as they arrived; the decode and the
        fingerprint check happen in the engine, which applies the same artifacts (all or
        nothing). What is checked here is the chain: a delta's signed base must be the version
        held, as a node with weights checks it against its own."""
        from p2psync.errors import WrongBase

        if manifest.kind == "delta" and manifest.base_fingerprint != self.fingerprint:
            raise WrongBase(str(manifest.base_fingerprint), str(self.fingerprint), manifest.base_version)

    def _committed(self, manifest: Manifest, fp: str) -> None:
        self.version, self.fingerprint = manifest.target_version, fp
        self.metrics.inc("p2psync_versions_applied_total")
        self.metrics.set("p2psync_version", manifest.target_version)
        self._applied.append(manifest)
        if len(self._applied) > _LOG_KEEP:
            self._applied.pop(0)
            self._applied_base += 1
        self.applied_signal.bump()
        self.heads.bump()  # the catalogue names the applied version: event streams announce it now
        self.log.info("applied %s (%d bytes) -> version %d fingerprint %s", manifest.artifact_id,
                      manifest.payload_bytes, manifest.target_version, fp)

    def release_weights(self) -> bool:
        """Drop the decoded copy of the weights, unless ``store.hold_weights`` keeps it (True), the
        node is the trainer, or it rebuilds snapshots; from now on artifacts are stored, relayed
        and followed (:meth:`_follow`), not decoded. Returns whether the node holds none now."""
        if self.config.store.hold_weights or self.config.role == "trainer" or self.config.materialise:
            return not self.holds_weights
        with self.state_lock:
            self.holds_weights = False
            self.state = None
        with self._decoded_lock:
            self._decoded.clear()
        with self._checkpoint_lock:
            self.store.drop_state()
            self.checkpointed = None
        # The chunks cached while the weights came in (up to store.cache_bytes of the snapshot, a
        # tenth of a 1B-parameter model) served the engine's load; it holds the weights now.
        self.store.clear_cache()
        _give_back_memory()
        self.log.info("weights dropped: the engine holds them; this node keeps the signed artifacts")
        return True

    def checkpoint(self) -> None:
        # One writer at a time: a stop cancels the task awaiting an interval checkpoint, not its
        # thread, and its own checkpoint would otherwise race it for the same temporary file.
        with self._checkpoint_lock:
            state, version = self.state, self.version
            if state is None or version is None or self.checkpointed == version:
                return
            self.store.save_state(state, version)
            self.checkpointed = version

    def after_apply(self, first: Any = None, snapshot_of: int | None = None) -> None:
        """Start the applied version's housekeeping and return at once.

        Housekeeping: ``first`` (a coroutine: the trainer signs a raw snapshot, a relay rebuilds
        one), a checkpoint every ``checkpoint_interval`` versions, then retention. On a large
        model the snapshot and the checkpoint each encode and write every weight (tens of
        seconds for 16 GB), so they run beside the next artifact's announcement, transfer and
        forwarding instead of in front of them. They read the weights of the version just
        applied, so the next commit (the only writer) waits for them (:meth:`commit`). A
        failure is logged and counted and loses nothing: the version stays applied, and the
        snapshot or checkpoint is simply not there (the next interval makes one).

        ``snapshot_of``: the version whose signed snapshot ``first`` makes; the catalogue lists it
        as pending from now until the housekeeping ends (see :class:`Catalogue`).
        """
        prev = self._housekeeping
        if snapshot_of is not None:
            self.snapshots_pending.add(snapshot_of)

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
            if every and self.version is not None and (self.checkpointed is None or
                                                       self.version - self.checkpointed >= every):
                await asyncio.to_thread(self.checkpoint)
            removed = self.store.prune(self.config.store.keep_deltas, self.checkpointed, self.board.ids)
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
                    self.snapshots_pending.discard(snapshot_of)
                    self.heads.bump()

        self._housekeeping = asyncio.get_running_loop().create_task(guarded(), name=f"housekeeping-{self.version}")

    async def settle(self) -> None:
        """Wait for the housekeeping started after the last commit (a no-op if it is done).

        Shielded: a caller cancelled while waiting does not cancel the housekeeping, whose
        threads would go on reading the weights regardless.
        """
        task = self._housekeeping
        if task is not None and not task.done():
            await asyncio.shield(task)

    async def subscribe(self) -> AsyncIterator[Manifest]:
        """Each artifact applied from now on, in version order, after it was applied."""
        seen = self._applied_base + len(self._applied)
        while not self._stop.is_set():
            seq = self.applied_signal.seq
            end = self._applied_base + len(self._applied)
            for k in range(max(seen, self._applied_base), end):
                yield self._applied[k - self._applied_base]
            seen = end
            await self.applied_signal.wait(seq, 3600)

    async def wait_version(self, version: int) -> None:
        """Return once the applied version is at least ``version``."""
        while self.version is None or self.version < version:
            if self._stop.is_set():
                raise P2PSyncError(f"node stopped before reaching version {version}")
            await self.applied_signal.wait(self.applied_signal.seq, 1.0)

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
