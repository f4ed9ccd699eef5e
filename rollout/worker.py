"""The rollout worker: the job a rollout node runs (``p2psync node --role rollout --job rollout.worker:run``).

What it promises:

- **Bit-exact, verified weights.** The engine starts from a copy of the node's
  weights (audited against the node's fingerprint) and then applies, in its own
  copy, the same verified artifacts the node applied (read back from
  ``node.store``), each all-or-nothing. After every version switch the engine's
  fingerprint, recomputed from the engine's own tensors, is compared with the
  manifest's target; on a difference the worker logs an error, hands its work
  back and returns 3 (the node process exits non-zero).
- **Safe points only.** Generation steps and weight applies run one after the
  other in this task, never together: the engine switches version between two
  decode steps (engines with ``switch_mid_generation``) or between batches.
  Every token records the version that produced it.
- **Staleness.** No token of a request is generated with a version below the
  request's ``min_version``: a batch waits for that version first.
- **Work.** Grants come from ``node.work`` (a
  :class:`~p2psync.control.api.WorkSource`), several at a time, batched into
  one generation; progress (tokens, logprobs, versions) streams back every
  ``progress_every`` tokens and when a response ends; a grant is completed as
  soon as its responses are. Resumed responses continue after their prefix;
  responses in ``grant.done`` are not generated again. A lost lease
  (:class:`~p2psync.errors.LeaseExpired`) drops that grant's sequences.
  Without ``node.work`` (control plane not running) the worker keeps its
  engine in sync and serves nothing.
- **Preemption.** Cancellation (SIGTERM on the node) hands every grant back
  with ``node.work.release_all()`` (bounded by ``release_timeout``) and
  re-raises.

- **One decode per node.** The node decodes each delta once, while it downloads
  it, and keeps the decoded changes of the last few (``Node.keep_decoded``);
  the engine adopts them (:meth:`RolloutEngine.prepare_decoded`: base check,
  no decode). Artifacts the node no longer keeps, and snapshots, are decoded
  from the node's store as before.
- **Short pauses.** Preparing the next artifact reads the engine's weights
  only, so it runs while generation goes on; at the safe point only the
  commit (fingerprint check and the writes) pauses generation. The audit
  (fingerprint from every weight) also runs beside generation and must finish
  before the next commit.

Events (``events_path``, JSON lines): ``{"event": "switch", version,
fingerprint (engine's, recomputed from its weights), expected (manifest
target), ok, switch_s (artifact complete -> engine serving it), stall_s
(generation paused for the switch), apply_s (decode start -> serving),
audit_s, how (snapshot, delta, node-decoded, copy), time}`` and ``{"event": "batch", batch_s, tokens, grants,
sequences, versions, switches, time}``. "Artifact complete" is the moment the
node's ``subscribe()`` yielded it (the node had every chunk and applied its own
copy); a version the worker found without that signal counts from when it
began to apply it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from p2psync.control.api import Grant, ProgressReport, ResponseResult, RolloutRequest
from p2psync.errors import ConfigError, FingerprintMismatch, LeaseExpired, P2PSyncError, UnknownWork, WrongBase
from p2psync.logs import NodeAdapter
from p2psync.store import plan_catchup
from rollout.engines import build_engine, check_name
from rollout.engines.base import (
    EngineConfig,
    ParentInfo,
    Prepared,
    RolloutEngine,
    SeqRequest,
    SeqState,
    stream_seed,
)

logger = logging.getLogger(__name__)

EXIT_DIVERGED = 3
_KEEP_DECODED = 3
"""Deltas whose decoded changes the node keeps for the engine (more than one: the engine may lag)."""


class EngineDiverged(P2PSyncError):
    """The engine's recomputed fingerprint differs from the version it claims to hold."""

    def __init__(self, version: int, expected: str, actual: str) -> None:
        super().__init__(f"engine at version {version} has fingerprint {actual}, manifest says {expected}")
        self.version, self.expected, self.actual = version, expected, actual


@dataclass(frozen=True)
class WorkerOptions:
    """The job config (``--job-config``), validated; unknown keys are an error."""

    engine: str = "hf"
    """An engine of :data:`rollout.engines.ENGINES`: ``"hf"`` (transformers) or ``"vllm"``."""
    preset: str = "small"
    """Model preset (as the trainer's); ignored with ``model_path`` or ``model_config``."""
    model_path: str | None = None
    model_config: dict[str, Any] | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    threads: int = 0
    """torch threads for generation and codec threads for applying (0: torch default, 2 for the codec)."""
    max_batch: int = 16
    """Most sequences (responses) in one engine batch."""
    max_grants: int = 8
    """Most prompt groups requested at once."""
    progress_every: int = 8
    """Stream progress every this many new tokens of a response."""
    request_wait: float = 2.0
    """Seconds one ``request`` may wait for work."""
    switch: str = "step"
    """``"step"``: switch version between decode steps; ``"batch"``: only between batches."""
    audit: bool = True
    """Recompute the engine's fingerprint from every weight after each switch (else the incremental one)."""
    events_path: str | None = None
    seed: int = 0
    """Sampling seed of requests that carry none."""
    release_timeout: float = 5.0
    vllm: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name(self.engine)
        for name in ("max_batch", "max_grants", "progress_every"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.switch not in ("step", "batch"):
            raise ConfigError("switch", f"must be 'step' or 'batch', got {self.switch!r}")
        if self.request_wait <= 0 or self.release_timeout <= 0:
            raise ConfigError("request_wait" if self.request_wait <= 0 else "release_timeout", "must be > 0")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> WorkerOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown rollout worker option (known: {', '.join(sorted(known))})")
        return cls(**options)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(engine=self.engine, preset=self.preset, model_path=self.model_path,
                            model_config=self.model_config, dtype=self.dtype, device=self.device,
                            threads=self.threads, vllm=dict(self.vllm))


async def run(node: Any, options: dict[str, Any]) -> int:
    """The node job: serve rollouts until cancelled; returns 3 if the engine ever diverged."""
    opts = WorkerOptions.from_dict(dict(options))
    worker = await RolloutWorker.create(node, opts)
    try:
        return await worker.serve()
    except asyncio.CancelledError:
        await worker.hand_back()
        raise
    finally:
        worker.close()


@dataclass
class _Seq:
    grant: Grant
    response: int
    state: SeqState | None = None
    reported: int = 0
    """Response tokens (prefix included) the coordinator has."""


class RolloutWorker:
    """One engine fed by one node (see module doc). Build with ``await RolloutWorker.create(...)``."""

    def __init__(self, node: Any, opts: WorkerOptions, engine: RolloutEngine) -> None:
        self.node = node
        self.opts = opts
        self.engine = engine
        cfg = getattr(node, "config", None)
        self.log = NodeAdapter(logger, {"node": getattr(cfg, "id", "?"), "region": getattr(cfg, "region", "?")})
        self._events = open(opts.events_path, "a", buffering=1) if opts.events_path else None
        self._arrived: dict[int, float] = {}
        self._newer = asyncio.Event()
        self._watch: asyncio.Task | None = None
        self._group = 1
        self._warned_no_work = False
        self._finish_ok: bool | None = None
        self._prep: tuple[str, float, asyncio.Task] | None = None
        """The artifact being decoded ahead of its safe point: (id, start time, task)."""
        self._audit: asyncio.Task | None = None
        self._syncing = False
        self.switches = 0
        self.held: list[Grant] = []

    @classmethod
    async def create(cls, node: Any, opts: WorkerOptions, engine: RolloutEngine | None = None) -> RolloutWorker:
        """Wait for the node's first version, build the engine, load the node's weights into it."""
        if opts.events_path:
            Path(opts.events_path).parent.mkdir(parents=True, exist_ok=True)
        if engine is None:
            engine = await asyncio.to_thread(build_engine, opts.engine_config())
        self = cls(node, opts, engine)
        if engine.pulls_artifacts:
            # The engine (vLLM's p2psync backend) pulls the same verified artifacts from this node's server.
            cfg = node.config
            engine.attach(ParentInfo(node.address, cfg.token(), str(Path(cfg.trainer_public_key).resolve()),
                                     f"{cfg.id}-engine"))
        keep = getattr(node, "keep_decoded", None)
        if keep is not None:
            keep(_KEEP_DECODED)
        try:
            self._watch = asyncio.create_task(self._watch_applied(), name="rollout:watch-versions")
            await asyncio.sleep(0)  # let the watcher subscribe before we read the node's version
            await node.wait_version(0)
            await self._load_from_node()
        except BaseException:
            self.close()
            raise
        return self

    # --- events ------------------------------------------------------------------------------
    def _record(self, event: dict[str, Any]) -> None:
        if self._events is not None:
            self._events.write(json.dumps({**event, "time": round(time.time(), 4)}) + "\n")

    async def _watch_applied(self) -> None:
        async for m in self.node.subscribe():
            self._arrived.setdefault(m.target_version, time.time())
            self._newer.set()
            self._prefetch()

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
        """Copy the node's current weights (retry if the node moved on during the copy)."""
        await self._drain()
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

    def _behind(self) -> bool:
        v = self.node.version
        return v is not None and (self.engine.version is None or v > self.engine.version)

    def _prepare(self, aid: str, manifest: Any) -> Prepared:
        decoded = getattr(self.node, "decoded", None)
        got = decoded(aid) if decoded is not None and manifest.kind == "delta" else None
        if got is not None:  # the node decoded it already (one decode per node, not two)
            return self.engine.prepare_decoded(manifest, *got)
        return self.engine.prepare(manifest, self.node.store.chunks(aid), self._threads())

    def _prefetch(self) -> None:
        """Start decoding the next artifact against the current weights (reads them only)."""
        if self._prep is not None or self._syncing or not self._behind():
            return
        store = self.node.store
        try:
            aid = plan_catchup(self.engine.version, self.node.version, store.catalogue())[0].id
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

    async def reach(self, version: int) -> None:
        """Return once the engine serves ``version`` or newer (waits for the node to get it)."""
        while self.engine.version is None or self.engine.version < version:
            if not self._behind():
                self.log.info("waiting for version %d (min_version of a grant)", version)
                await self.node.wait_version(version)
            await self.sync()

    # --- work --------------------------------------------------------------------------------
    async def serve(self) -> int:
        """Request, generate, stream, complete, until cancelled. Returns 3 if the engine diverged."""
        try:
            while True:
                await self.sync()
                work = getattr(self.node, "work", None)
                if work is None:
                    if not self._warned_no_work:
                        self.log.warning("node has no work source (control plane off): keeping weights in sync only")
                        self._warned_no_work = True
                    try:
                        async with asyncio.timeout(1.0):
                            await self._newer.wait()
                    except TimeoutError:
                        pass
                    continue
                want = max(1, min(self.opts.max_grants, self.opts.max_batch // max(1, self._group)))
                grants = await self._request(work, want)
                if grants:
                    await self.run_grants(work, grants)
        except EngineDiverged:
            await self.hand_back()
            return EXIT_DIVERGED

    async def _request(self, work: Any, want: int) -> list[Grant]:
        """``work.request``, switching versions while it waits (nothing generates meanwhile)."""
        req = asyncio.create_task(work.request(max_items=want, wait=self.opts.request_wait, version=self.engine.version),
                                  name="rollout:request")
        try:
            while True:
                newer = asyncio.create_task(self._newer.wait(), name="rollout:newer")
                try:
                    await asyncio.wait({req, newer}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    newer.cancel()
                if req.done():
                    return req.result()
                await self.sync()
        except BaseException:
            req.cancel()  # a grant it may still return is handed back by release_all on the way out
            raise

    async def hand_back(self) -> None:
        """Release every grant (preemption or failure), within ``release_timeout``."""
        work = getattr(self.node, "work", None)
        if work is None:
            return
        try:
            async with asyncio.timeout(self.opts.release_timeout):
                await work.release_all()
            self.log.info("handed back %d grants", len(self.held))
        except (P2PSyncError, TimeoutError, OSError) as exc:
            self.log.warning("could not hand back grants (their leases will expire instead): %r", exc)
        self.held = []

    def _seqs_of(self, grant: Grant, req: RolloutRequest) -> list[tuple[_Seq, SeqRequest]]:
        out = []
        for r in range(grant.responses):
            if r in grant.done:
                continue
            tokens, lps, vers = grant.resume.get(r, ([], [], []))
            if req.seed is not None:
                seed = stream_seed(req.seed, r)
            else:
                seed = stream_seed(self.opts.seed, grant.work_id, r)
            sreq = SeqRequest(list(req.prompt_ids), req.max_new_tokens, req.temperature, req.top_p,
                              list(req.stop_token_ids), seed, list(tokens), req.min_version, (grant.work_id, r))
            out.append((_Seq(grant, r, reported=len(tokens)), sreq))
        return out

    async def run_grants(self, work: Any, grants: list[Grant]) -> None:
        """Generate every open response of ``grants`` (in batches of ``max_batch``) and complete them."""
        self.held.extend(grants)
        self._group = max(g.responses for g in grants)
        reqs = {g.work_id: RolloutRequest.from_json(g.payload) for g in grants}
        items: list[tuple[_Seq, SeqRequest]] = []
        for g in grants:
            items.extend(self._seqs_of(g, reqs[g.work_id]))
        open_by_grant: dict[str, int] = {g.work_id: 0 for g in grants}
        for s, _ in items:
            open_by_grant[s.grant.work_id] += 1
        lost: set[str] = set()
        results: dict[str, dict[int, ResponseResult]] = {}
        for g in grants:  # nothing left to generate (all done elsewhere)
            if open_by_grant[g.work_id] == 0:
                await self._complete(work, g, {}, lost)
        for k in range(0, len(items), self.opts.max_batch):
            chunk = [it for it in items[k:k + self.opts.max_batch] if it[0].grant.work_id not in lost]
            if not chunk:
                continue
            await self.reach(max(sreq.min_version for _, sreq in chunk))
            await self._generate(work, chunk, open_by_grant, lost, results)
        self.held = [g for g in self.held if g not in grants]

    async def _generate(self, work: Any, items: list[tuple[_Seq, SeqRequest]], open_by_grant: dict[str, int],
                        lost: set[str], results: dict[str, dict[int, ResponseResult]]) -> None:
        eng = self.engine
        gen = eng.start([sreq for _, sreq in items])
        seqs = [s for s, _ in items]
        for s, st in zip(seqs, gen.seqs):
            s.state = st
        t0, tokens, switches = time.time(), 0, 0
        versions: set[int] = set()
        # Sequences that ended before any step (e.g. a resumed response already at its cap).
        ended = {i for i, st in enumerate(gen.seqs) if st.done}
        await self._finish_ready(work, seqs, sorted(ended), results, open_by_grant, lost)
        while not gen.done:
            self._prefetch()
            await self._audit_done(wait=False)
            if eng.switch_mid_generation and self.opts.switch == "step" and self._behind():
                before = eng.version
                await self.sync()
                switches += eng.version != before
            events = await asyncio.to_thread(gen.step)
            tokens += len(events)
            versions.update(e.version for e in events)
            # Sequences with a new token, plus any that ended without one (context limit).
            touched = {e.index for e in events} | {i for i, st in enumerate(gen.seqs) if st.done} - ended
            ended |= {i for i, st in enumerate(gen.seqs) if st.done}
            await self._stream(work, seqs, gen, results, open_by_grant, lost, sorted(touched))
        self._record({"event": "batch", "batch_s": round(time.time() - t0, 6), "tokens": tokens,
                      "grants": len({s.grant.work_id for s in seqs}), "sequences": len(seqs),
                      "versions": sorted(versions), "switches": switches})

    async def _stream(self, work: Any, seqs: list[_Seq], gen: Any, results: dict, open_by_grant: dict[str, int],
                      lost: set[str], touched: list[int]) -> None:
        due: list[tuple[_Seq, ProgressReport]] = []
        finished = []
        for i in touched:
            s = seqs[i]
            st = s.state
            assert st is not None
            if s.grant.work_id in lost:
                continue
            if st.done:
                finished.append(i)
            if st.done or st.length - s.reported >= self.opts.progress_every:
                due.append((s, self._report(s, work)))
        if due:
            many = getattr(work, "progress_many", None)
            if many is not None:  # every due response in one request
                outcomes = await many([r for _, r in due])
            else:
                outcomes = await asyncio.gather(*(self._progress(work, r) for _, r in due), return_exceptions=True)
            for (s, r), out in zip(due, outcomes):
                if out is None:
                    s.reported = r.offset + len(r.tokens)
                elif isinstance(out, LeaseExpired):
                    if out.work_id not in lost:
                        self._lose(out.work_id, seqs, gen, lost)
                elif not isinstance(out, (P2PSyncError, OSError)):
                    raise out
                else:
                    self.log.warning("progress report failed (the final result still carries it): %r", out)
        await self._finish_ready(work, seqs, finished, results, open_by_grant, lost)

    def _report(self, s: _Seq, work: Any) -> ProgressReport:
        """What of ``s`` was not reported yet (all of it from the last report on)."""
        st = s.state
        assert st is not None
        req = st.request
        toks = list(req.prefix) + st.tokens
        g = s.grant
        pre = g.resume.get(s.response, ([], [], []))
        lps = list(pre[1]) + st.logprobs
        vers = list(pre[2]) + st.versions
        off = s.reported
        reason = None
        if st.done and self._finish_kw(work):
            # The final report marks the response finished, so a later holder does not continue it.
            reason = "length" if st.finish_reason == "length" else "stop"
        return ProgressReport(g, s.response, off, toks[off:], lps[off:], vers[off:], reason)

    @staticmethod
    async def _progress(work: Any, r: ProgressReport) -> None:
        if r.finish_reason is not None:
            await work.progress(r.grant, r.response, r.offset, r.tokens, r.logprobs, r.versions,
                                finish_reason=r.finish_reason)
        else:
            await work.progress(r.grant, r.response, r.offset, r.tokens, r.logprobs, r.versions)

    def _finish_kw(self, work: Any) -> bool:
        """Whether ``work.progress`` takes ``finish_reason`` (an extension of the WorkSource contract)."""
        if self._finish_ok is None:
            try:
                self._finish_ok = "finish_reason" in inspect.signature(work.progress).parameters
            except (TypeError, ValueError):
                self._finish_ok = False
        return self._finish_ok

    def _lose(self, work_id: str, seqs: list[_Seq], gen: Any, lost: set[str]) -> None:
        self.log.warning("lease on %s lost; dropping its sequences", work_id)
        lost.add(work_id)
        gen.cancel([i for i, s in enumerate(seqs) if s.grant.work_id == work_id])
        self.held = [g for g in self.held if g.work_id != work_id]

    async def _finish_ready(self, work: Any, seqs: list[_Seq], finished: list[int], results: dict,
                            open_by_grant: dict[str, int], lost: set[str]) -> None:
        for i in finished:
            s = seqs[i]
            st = s.state
            assert st is not None
            g = s.grant
            if g.work_id in lost or st.finish_reason == "cancelled":
                continue
            pre = g.resume.get(s.response, ([], [], []))
            results.setdefault(g.work_id, {})[s.response] = ResponseResult(
                list(pre[0]) + st.tokens, [float(x) for x in pre[1]] + st.logprobs, list(pre[2]) + st.versions,
                "length" if st.finish_reason == "length" else "stop")
            open_by_grant[g.work_id] -= 1
            if open_by_grant[g.work_id] == 0:
                await self._complete(work, g, results.pop(g.work_id), lost)

    async def _complete(self, work: Any, grant: Grant, mine: dict[int, ResponseResult], lost: set[str]) -> None:
        responses = {int(r): ResponseResult.from_json(d) for r, d in grant.done.items()}
        responses.update(mine)
        try:
            if not await work.complete(grant, responses):
                self.log.info("result for %s was a duplicate", grant.work_id)
        except (LeaseExpired, UnknownWork) as exc:
            self.log.warning("result for %s dropped: %s", grant.work_id, exc)
            lost.add(grant.work_id)
        except (P2PSyncError, OSError) as exc:  # the source retried already; its lease will expire and move it
            self.log.error("result for %s not delivered: %r", grant.work_id, exc)
            lost.add(grant.work_id)
        self.held = [g for g in self.held if g.work_id != grant.work_id]

    def close(self) -> None:
        for task in (self._watch, self._audit, self._prep[2] if self._prep else None):
            if task is not None:
                task.cancel()
        if self._events is not None:
            self._events.close()
            self._events = None
        self.engine.close()
