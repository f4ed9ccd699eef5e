"""The rollout worker: the job a rollout node runs (``p2psync node --role rollout --job rollout.worker:run``).

The weight side (bit-exact verified weights, version switches at safe points,
one decode per node, short pauses, the ``switch`` event) is
:class:`rollout.engine_sync.EngineSync`, which :class:`RolloutWorker` extends with
the work. What the worker adds:

- **Safe points only.** Generation steps and weight applies run one after the
  other in this task, never together: the engine switches version between two
  decode steps (engines with ``switch_mid_generation``) or between batches.
  Every token records the version that produced it. A diverged engine
  (:class:`~rollout.engine_sync.EngineDiverged`) makes the worker log an error,
  hand its work back and return 3 (the node process exits non-zero).
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

Events (``events_path``, JSON lines): the engine's ``switch`` events (see
:mod:`rollout.engine_sync`) and ``{"event": "batch", batch_s, tokens, grants,
sequences, versions, switches, time}``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2psync.control.api import Grant, ProgressReport, ResponseResult, RolloutRequest
from p2psync.errors import LeaseExpired, P2PSyncError, UnknownWork
from p2psync.transport.leaf import Parent
from rollout.engine_sync import EngineDiverged, EngineSync
from rollout.engines import build_engine
from rollout.engines.base import RolloutEngine, SeqRequest, SeqState, stream_seed
from rollout.options import WorkerOptions

logger = logging.getLogger(__name__)

EXIT_DIVERGED = 3
_KEEP_DECODED = 3
"""Deltas whose decoded changes the node keeps for the engine (more than one: the engine may lag)."""


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


class RolloutWorker(EngineSync):
    """One engine fed by one node (see module doc). Build with ``await RolloutWorker.create(...)``."""

    _logger = logger

    def __init__(self, node: Any, opts: WorkerOptions, engine: RolloutEngine) -> None:
        super().__init__(node, opts, engine)
        self._group = 1
        self._warned_no_work = False
        self._finish_ok: bool | None = None
        self.held: list[Grant] = []

    @classmethod
    async def create(cls, node: Any, opts: WorkerOptions, engine: RolloutEngine | None = None) -> RolloutWorker:
        """Wait for the node's first version, build the engine, load the node's weights into it."""
        if opts.events_path:
            Path(opts.events_path).parent.mkdir(parents=True, exist_ok=True)
        if engine is None:
            engine = await asyncio.to_thread(build_engine, opts.engine_config())
        self = cls(node, opts, engine)
        keep = getattr(node, "keep_decoded", None)
        if keep is not None:
            keep(_KEEP_DECODED)
        try:
            self._watch = asyncio.create_task(self._watch_applied(), name="rollout:watch-versions")
            await asyncio.sleep(0)  # let the watcher subscribe before we read the node's version
            await node.wait_version(0)
            if engine.pulls_artifacts:
                # The engine (vLLM's p2psync backend) pulls the same verified artifacts from this node's
                # server; attached once the node holds one, since the attach checks the key against it
                # (in a thread: the check asks this node's server, which runs on this event loop). It
                # presents the node's own certificate (mutual TLS).
                cfg = node.config
                tls_dir = node.tls.directory
                parent = Parent.create(node.address, cfg.token(), str(Path(cfg.trainer_public_key).resolve()),
                                       f"{cfg.id}/engine", tls_dir.resolve() if tls_dir else "")
                await asyncio.to_thread(engine.attach, parent)
            await self._load_from_node()
            release = getattr(node, "release_weights", None)
            if release is not None:
                release()  # the engine holds the weights now; the node keeps the artifacts (store.hold_weights)
        except BaseException:
            self.close()
            raise
        return self

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
