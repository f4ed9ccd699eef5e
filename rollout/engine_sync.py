"""Keeping a rollout engine on the node's weights: catch-up, prepare and commit at safe points, audits.

:class:`EngineSync` is the weight side of :class:`rollout.worker.RolloutWorker`; the worker
adds the work (grants, batches, progress) on top. What it promises:

- **Bit-exact, verified weights.** The engine starts from a copy of the node's
  weights (audited against the node's fingerprint) and then applies, in its own
  copy, the same verified artifacts the node applied (read back from
  ``node.store``), each all-or-nothing. After every version switch the engine's
  fingerprint, recomputed from the engine's own tensors, is compared with the
  manifest's target; on a difference it logs an error and raises
  :class:`EngineDiverged` (the worker then hands its work back and returns 3).
- **Safe points only.** :meth:`EngineSync.sync` is the only place that writes
  the engine's weights; its caller runs it between two decode steps or between
  batches, never beside a generation step.
- **One copy, one decode per machine.** Once the engine holds the weights, the
  rollout worker has the node drop its own copy (``Node.release_weights``,
  ``store.hold_weights``): the node keeps the verified artifacts and the engine
  decodes them from the node's store. A node that keeps its copy (the trainer's,
  or ``store.hold_weights = true``) decodes each delta once while it downloads
  it and keeps the decoded changes of the last few (``Node.keep_decoded``); the
  engine adopts them (:meth:`RolloutEngine.prepare_decoded`: base check, no
  decode).
- **Short pauses.** Preparing the next artifact reads the engine's weights
  only, so it runs while generation goes on; at the safe point only the
  commit (fingerprint check and the writes) pauses generation. An engine that
  pulls artifacts itself (vLLM) prepares the next one as soon as the node lists
  it, while it is still arriving: it fetches each chunk from the node once the
  node has it (:mod:`rollout.engines.vllm.worker.stage`). The audit
  (fingerprint from every weight) also runs beside generation and must finish
  before the next commit.

Event (``events_path``, JSON lines): ``{"event": "switch", version,
fingerprint (engine's, recomputed from its weights), expected (manifest
target), ok, switch_s (artifact complete -> engine serving it), stall_s
(generation paused for the switch), apply_s (decode start -> serving),
audit_s, how (snapshot, delta, node-decoded, copy), staged (engines that
stage: whether the commit applied what its stage fetched ahead), time}``. "Artifact
complete" is the moment the node's ``subscribe()`` yielded it (the node had
every chunk and applied its own copy); a version found without that signal
counts from when it began to apply it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from p2psync.errors import FingerprintMismatch, P2PSyncError, WrongBase
from p2psync.logs import NodeAdapter
from p2psync.store import plan_catchup
from rollout.engines.base import Prepared, RolloutEngine
from rollout.options import WorkerOptions

logger = logging.getLogger(__name__)


class EngineDiverged(P2PSyncError):
    """The engine's recomputed fingerprint differs from the version it claims to hold."""

    def __init__(self, version: int, expected: str, actual: str) -> None:
        super().__init__(f"engine at version {version} has fingerprint {actual}, manifest says {expected}")
        self.version, self.expected, self.actual = version, expected, actual


class EngineSync:
    """One engine kept on one node's weights (see module doc).

    Not used alone: :class:`rollout.worker.RolloutWorker` builds it, starts ``_watch_applied``
    and loads the node's weights (``RolloutWorker.create``)."""

    _logger: logging.Logger = logger
    """Where :attr:`log` writes; the worker points it at its own module's logger."""

    def __init__(self, node: Any, opts: WorkerOptions, engine: RolloutEngine) -> None:
        self.node = node
        self.opts = opts
        self.engine = engine
        cfg = getattr(node, "config", None)
        self.log = NodeAdapter(self._logger, {"node": getattr(cfg, "id", "?"), "region": getattr(cfg, "region", "?")})
        self._events = open(opts.events_path, "a", buffering=1) if opts.events_path else None
        self._arrived: dict[int, float] = {}
        self._newer = asyncio.Event()
        self._watch: asyncio.Task | None = None
        self._prep: tuple[str, float, asyncio.Task] | None = None
        """The artifact being decoded ahead of its safe point: (id, start time, task)."""
        self._audit: asyncio.Task | None = None
        self._syncing = False
        self.switches = 0

    # --- events ------------------------------------------------------------------------------
    def _record(self, event: dict[str, Any]) -> None:
        if self._events is not None:
            self._events.write(json.dumps({**event, "time": round(time.time(), 4)}) + "\n")

    async def _watch_applied(self) -> None:
        heads = getattr(self.node, "heads", None)
        early = asyncio.create_task(self._watch_announced(heads), name="rollout:watch-announced") \
            if self.engine.pulls_artifacts and heads is not None else None
        try:
            async for m in self.node.subscribe():
                self._arrived.setdefault(m.target_version, time.time())
                self._newer.set()
                self._prefetch()
        finally:
            if early is not None:
                early.cancel()

    async def _watch_announced(self, heads: Any) -> None:
        """An engine that pulls artifacts itself (vLLM) starts preparing the next one as soon as the
        node lists it, while it is still arriving: the node serves each chunk once it came
        (cut-through), so the engine's fetch and decode run beside the node's download, not after it."""
        seq = None
        while not heads.closed:
            if heads.seq != seq:
                seq = heads.seq
                self._prefetch(announced=True)
            await heads.wait(seq, 60.0)

    # --- weights -----------------------------------------------------------------------------
    # Three things touch the engine's weights: generation steps and audits only read them,
    # prepare (decoding the next artifact) only reads them, commit writes them. So prepare and
    # audit run in threads beside generation, and commit runs only at a safe point (in sync(),
    # between steps or batches) after the running prepare and audit finished.
    def _threads(self) -> int:
        return max(1, self.opts.threads or 2)

    def _finish_switch(self, version: int, expected: str, fp: str, info: dict[str, Any]) -> None:
        self._record({"event": "switch", "version": version, "fingerprint": fp, "expected": expected,
                      "ok": fp == expected, **info})
        if fp != expected:
            self.log.error("engine fingerprint %s at version %d differs from the manifest's %s", fp, version, expected)
            raise EngineDiverged(version, expected, fp)

    def _switched(self, version: int, expected: str, t0: float, t_safe: float, how: str,
                  fp: str | None = None) -> None:
        """Record the engine serving ``version``; its fingerprint is recomputed from the engine's
        own weights (in a thread, beside generation) and checked against ``expected``."""
        now = time.time()
        arrived = self._arrived.get(version, t0)
        for v in [v for v in self._arrived if v <= version]:
            del self._arrived[v]
        info = {"switch_s": round(max(0.0, now - arrived), 6), "stall_s": round(now - t_safe, 6),
                "apply_s": round(now - t0, 6), "how": how}
        staged = getattr(self.engine, "last_staged", None)
        if staged is not None and how != "copy":
            info["staged"] = staged
        self.switches += 1
        self.log.info("engine serving version %d (%s; generation paused %.3f s)", version, how, now - t_safe)
        if fp is not None or not self.opts.audit:
            self._finish_switch(version, expected, fp or self.engine.fingerprint, info)
            return

        async def audit() -> None:
            t = time.time()
            got = await asyncio.to_thread(self.engine.audit, self._threads())
            self._finish_switch(version, expected, got, {**info, "audit_s": round(time.time() - t, 6)})
        self._audit = asyncio.create_task(audit(), name=f"rollout:audit-{version}")

    async def _audit_done(self, wait: bool = True) -> None:
        """Surface the last audit's verdict (raises :class:`EngineDiverged`); ``wait=False``: only if finished."""
        task = self._audit
        if task is None or (not wait and not task.done()):
            return
        self._audit = None
        await task

    async def _load_from_node(self) -> None:
        """Copy the node's current weights (retry if the node moved on during the copy); from a
        node that holds none (``store.hold_weights``), rebuild them from the artifacts it keeps."""
        await self._drain()
        if getattr(self.node, "state", None) is None and self.node.version is not None:
            await self._load_from_store()
            return
        lock = getattr(self.node, "state_lock", None) or contextlib.nullcontext()

        def copy(state: Any, version: int, fp: str) -> str:
            with lock:  # the node writes no weights meanwhile
                return self.engine.load(state, version, fp)

        for attempt in range(5):
            state, version, fp = self.node.state, self.node.version, self.node.fingerprint
            t0 = time.time()
            try:
                got = await asyncio.to_thread(copy, state, version, fp)
            except FingerprintMismatch:
                # The node committed its next version after ``version`` was read here and before
                # the copy began: wait until it says so, then copy that one.
                self.log.info("node changed while copying its weights (attempt %d); again", attempt + 1)
                try:
                    async with asyncio.timeout(5.0):
                        await self.node.wait_version(version + 1)
                except TimeoutError:
                    pass
                continue
            self._switched(version, fp, t0, t0, "copy", fp=got)
            return
        raise P2PSyncError("could not copy a consistent version of the node's weights in 5 attempts")

    async def _load_from_store(self) -> None:
        """Rebuild the engine from the artifacts the node keeps (the node holds no weights).

        An engine that pulls artifacts itself (vLLM) reaches the node's version from the node's
        server; another loads the newest snapshot the store keeps, decoded here (a passing copy,
        freed once loaded), then replays the deltas after it (:meth:`sync`)."""
        store, target, t0 = self.node.store, self.node.version, time.time()
        if self.engine.pulls_artifacts:
            fp = self.node.fingerprint
            got = await asyncio.to_thread(self.engine.load, None, target, fp)
            self._switched(target, fp, t0, t0, "pulled", fp=got)
            return
        plan = plan_catchup(None, target, store.catalogue())
        snap = store.artifacts[plan[0].id].manifest

        def load() -> str:
            from p2psync.codec.decode import decode_state

            state = decode_state(list(snap.tensors), enumerate(store.chunks(snap.artifact_id)), len(snap.chunks),
                                 snap.target_fingerprint, self._threads())
            return self.engine.load(state, snap.target_version, snap.target_fingerprint)

        got = await asyncio.to_thread(load)
        self._switched(snap.target_version, snap.target_fingerprint, t0, t0, "snapshot", fp=got)
        if self._behind():
            await self.sync()

    def _behind(self) -> bool:
        v = self.node.version
        return v is not None and (self.engine.version is None or v > self.engine.version)

    def _prepare(self, aid: str, manifest: Any) -> Prepared:
        if self.engine.pulls_artifacts:  # it fetches the chunks itself
            return self.engine.prepare(manifest, [], self._threads())
        decoded = getattr(self.node, "decoded", None)
        got = decoded(aid) if decoded is not None and manifest.kind == "delta" else None
        if got is not None:  # the node decoded it already (one decode per node, not two)
            return self.engine.prepare_decoded(manifest, *got)
        return self.engine.prepare(manifest, self.node.store.chunks(aid), self._threads())

    def _prefetch(self, announced: bool = False) -> None:
        """Start decoding the next artifact against the current weights (reads them only); with
        ``announced``, the next one the node lists, held or still arriving (engines that pull)."""
        if self._prep is not None or self._syncing:
            return
        store = self.node.store
        listed = store.catalogue(complete_only=not announced)
        if announced:
            head = max((a.target for a in listed), default=None)
            if self.engine.version is None or head is None or head <= self.engine.version:
                return
        elif not self._behind():
            return
        else:
            head = self.node.version
        try:
            aid = plan_catchup(self.engine.version, head, listed)[0].id
            manifest = store.artifacts[aid].manifest
        except (P2PSyncError, KeyError, IndexError):
            return  # sync() finds its own way (or copies the node's weights)
        task = asyncio.create_task(asyncio.to_thread(self._prepare, aid, manifest), name=f"rollout:prepare-{aid}")
        self._prep = (aid, time.time(), task)

    async def _drain(self) -> None:
        """Let a running prepare finish (its result is dropped) and surface the last audit."""
        if self._prep is not None:
            _, _, task = self._prep
            self._prep = None
            await asyncio.gather(task, return_exceptions=True)
        await self._audit_done()

    def _diverged(self, exc: WrongBase) -> EngineDiverged:
        # The engine's weights no longer hash to the version it serves: changed behind its back.
        # Tokens may already have come from them; that is not recoverable here.
        self.log.error("engine weights at version %s changed behind its back: %s", self.engine.version, exc)
        self._record({"event": "switch", "version": self.engine.version, "fingerprint": exc.actual,
                      "expected": exc.expected, "ok": False, "how": "base-check"})
        return EngineDiverged(self.engine.version if self.engine.version is not None else -1, exc.expected,
                              exc.actual)

    async def sync(self) -> None:
        """Bring the engine to the node's version. A safe point: nothing generates meanwhile."""
        self._newer.clear()
        if not self._behind():
            await self._audit_done(wait=False)
            return
        target = self.node.version
        store = self.node.store
        t_safe = time.time()
        self._syncing = True
        try:
            plan = plan_catchup(self.engine.version, target, store.catalogue())
            for info in plan:
                manifest = store.artifacts[info.id].manifest
                prepared, t0 = None, time.time()
                if self._prep is not None:
                    aid, t_prep, task = self._prep
                    self._prep = None
                    try:
                        got = await task
                    except P2PSyncError:
                        got = None  # decoded again below; a real problem shows up there
                    if aid == info.id:
                        prepared, t0 = got, t_prep
                if prepared is None:
                    prepared = await asyncio.to_thread(self._prepare, info.id, manifest)
                assert prepared is not None
                await self._audit_done()  # the audit reads what commit is about to write
                await asyncio.to_thread(self.engine.commit, prepared)
                how = "node-decoded" if prepared.applier is not None and prepared.applier.adopted else manifest.kind
                self._switched(manifest.target_version, manifest.target_fingerprint, t0, t_safe, how)
                t_safe = time.time()
        except WrongBase as exc:
            raise self._diverged(exc) from exc
        except EngineDiverged:
            raise
        except (P2PSyncError, KeyError) as exc:
            # Pruned from the store, or an artifact that does not apply to our copy: nothing was
            # written (commit is all-or-nothing); take the node's verified weights instead.
            self.log.warning("cannot replay artifacts to version %s (%s); copying the node's weights", target, exc)
            await self._load_from_node()
        finally:
            self._syncing = False
        self._prefetch(announced=self.engine.pulls_artifacts)  # the next one, if the node lists it already

    async def reach(self, version: int) -> None:
        """Return once the engine serves ``version`` or newer (waits for the node to get it)."""
        while self.engine.version is None or self.engine.version < version:
            if not self._behind():
                self.log.info("waiting for version %d (min_version of a grant)", version)
                await self.node.wait_version(version)
            await self.sync()

    def close(self) -> None:
        for task in (self._watch, self._audit, self._prep[2] if self._prep else None):
            if task is not None:
                task.cancel()
        if self._events is not None:
            self._events.close()
            self._events = None
        self.engine.close()
