"""The coordinator on the trainer node: lease table and scheduler behind HTTP, and the trainer's
:class:`~p2psync.control.api.WorkSink` (``node.coordinator``).

HTTP (JSON bodies, behind the cluster-token guard)::

    POST /v1/control/lease        {node, max_items, wait, version?}            -> {grants, ttl}
    POST /v1/control/renew        {node, work_id, lease_id}                    -> {expires_at}
    POST /v1/control/progress     {node, work_id, lease_id, response, offset,
                                   tokens, logprobs, versions, finish_reason?} -> {have}
    POST /v1/control/progress_many {node, reports: [{work_id, lease_id, response, offset,
                                   tokens, logprobs, versions, finish_reason?}, ...]}
                                                                               -> {results: [...]}
    POST /v1/control/complete     {node, work_id, lease_id, responses}         -> {accepted, reason}
    POST /v1/control/release      {node, work_id, lease_id}                    -> {}
    POST /v1/control/release_all  {node}                                       -> {released}
    GET  /v1/control/status                                    -> counts, and the work ids each node holds

Errors: a malformed body is 400 and changes nothing; an unknown work id 404; a
lease that is no longer the caller's 409 ``{"kind": "expired"}``; a progress
report that starts past what is recorded 409 ``{"kind": "gap", "have": n}``
(the client re-sends from ``have``). ``progress_many`` carries up to
``MAX_REPORTS`` progress reports of one node (every response it generates, one
request per report interval instead of one per response): a malformed report
makes the whole request 400 with nothing recorded; otherwise each report gets
its own outcome, in order, as the single call would answer it (``{"have": n}``,
or ``{"status": 404|409|400, "error", "kind"?, "have"?}``).

Contracts:

- Every work id submitted is, at any time, queued, leased to one node, or
  completed (:class:`~p2psync.lease.LeaseTable`); :meth:`results` yields each
  accepted work id exactly once, with every response's full token history
  (tokens, log-probabilities and the version of each token), also when the
  response was started on another node and migrated.
- A lease request long-polls up to ``wait`` seconds. Work is placed by the
  :class:`~p2psync.schedule.Scheduler` over the nodes waiting now plus the nodes
  busy with leases (their estimated finish times), so a long prompt group waits
  for a fast node that frees up soon rather than going to a slow one now. Only
  a node within the staleness bound (version >= head - max_staleness) gets
  work; its version is what its latest lease request said it generates with
  (``version``), or its gossip report if that arrived later.
- Expired leases return their work, with its tokens, to the front of the queue
  (the lease timer) and the waiting nodes are served again at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from p2psync.control.api import ResponseResult, Result
from p2psync.errors import ConfigError, LeaseExpired, ProgressGap, UnknownWork
from p2psync.gossip.messages import LEASES_PREFIX
from p2psync.lease import Lease, LeaseTable, WorkItem
from p2psync.schedule import NodeView, Scheduler
from p2psync.transport.client import cancel_quietly
from p2psync.transport.messages import API

if TYPE_CHECKING:
    from p2psync.control.gossip_service import GossipService
    from p2psync.host import Host

logger = logging.getLogger(__name__)

CONTROL = f"{API}/control"
MAX_ITEMS = 64
MAX_REPORTS = 1024
MAX_WAIT = 60.0
_DEFAULT_TPS = 100.0


class BadRequest(ValueError):
    """A request body that does not follow the schema (400)."""


def _field(body: dict, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    if name not in body or body[name] is None:
        if optional:
            return None
        raise BadRequest(f"{name}: required")
    v = body[name]
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise BadRequest(f"{name}: wrong type {type(v).__name__}")
    return v


def _ints(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise BadRequest(f"{name}: must be a list of integers")
    return v


def _floats(v: Any, name: str) -> list[float]:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise BadRequest(f"{name}: must be a list of numbers")
    return [float(x) for x in v]


@dataclass(frozen=True)
class _Report:
    work_id: str
    lease_id: int
    response: int
    offset: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None


def _report(body: dict[str, Any], where: str) -> _Report:
    """One progress report's fields, checked against the schema (:class:`BadRequest` names the field)."""
    try:
        tokens = _ints(body.get("tokens"), "tokens")
        logprobs = _floats(body.get("logprobs"), "logprobs")
        versions = _ints(body.get("versions"), "versions")
        if not len(tokens) == len(logprobs) == len(versions):
            raise BadRequest("tokens, logprobs and versions differ in length")
        reason = _field(body, "finish_reason", str, optional=True)
        if reason is not None and not 0 < len(reason) <= 32:
            raise BadRequest("finish_reason: must be a short string")
        return _Report(_field(body, "work_id", str), _field(body, "lease_id", int), _field(body, "response", int),
                       _field(body, "offset", int), tokens, logprobs, versions, reason)
    except BadRequest as exc:
        raise BadRequest(f"{where}{exc}") from None


def parse_response(d: Any, where: str) -> ResponseResult:
    """A :class:`ResponseResult` from JSON, checked (400 on anything off)."""
    if not isinstance(d, dict):
        raise BadRequest(f"{where}: must be an object")
    tokens = _ints(d.get("tokens"), f"{where}.tokens")
    logprobs = _floats(d.get("logprobs"), f"{where}.logprobs")
    versions = _ints(d.get("versions"), f"{where}.versions")
    if not len(tokens) == len(logprobs) == len(versions):
        raise BadRequest(f"{where}: tokens, logprobs and versions differ in length")
    reason = d.get("finish_reason")
    if not isinstance(reason, str) or not reason or len(reason) > 32:
        raise BadRequest(f"{where}.finish_reason: must be a short string")
    return ResponseResult(tokens, logprobs, versions, reason)


def grant_json(lease: Lease, item: WorkItem, history: dict[int, tuple[tuple[int, ...], tuple[float, ...],
                                                                       tuple[int, ...]]]) -> dict[str, Any]:
    """What a rollout node receives for one lease (see :class:`~p2psync.control.api.Grant`)."""
    resume = {str(r): {"tokens": list(t), "logprobs": list(lease.resume_logprobs.get(r, ())),
                       "versions": list(lease.resume_versions.get(r, ()))} for r, t in lease.resume.items()}
    done = {}
    for r in sorted(lease.done):
        tokens, logprobs, versions = history.get(r, ((), (), ()))
        done[str(r)] = ResponseResult(list(tokens), list(logprobs), list(versions),
                                      lease.finish.get(r, "stop")).to_json()
    return {"work_id": lease.work_id, "lease_id": lease.lease_id, "payload": item.payload,
            "responses": item.responses, "resume": resume, "done": done, "expires_at": lease.expires_at}


@dataclass
class _Waiter:
    node: str
    max_items: int
    future: asyncio.Future


class Coordinator:
    """Leases, scheduling and results on the trainer node (``node.coordinator``).

    ``gossip``: the node's gossip service when gossip is on (the live plan, the lease table's
    publication and the members' figures ride on it)."""

    def __init__(self, host: Host, gossip: GossipService | None = None) -> None:
        self.host = host
        self.gossip = gossip
        cfg = host.config.control
        self.table = LeaseTable(cfg.lease_ttl)
        self.scheduler = Scheduler(max_staleness=cfg.max_staleness)
        self._results: asyncio.Queue[Result] = asyncio.Queue()
        self._waiters: list[_Waiter] = []
        self._granted_at: dict[int, float] = {}
        self._tps: dict[str, float] = {}
        self._said_version: dict[str, tuple[float, int]] = {}
        """node -> (time, version) its latest lease request said it generates with."""
        self._dirty_holders: set[str] = set()
        self._published_holders: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._kick = asyncio.Event()
        self._stopped = False

    # --- service ---------------------------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [web.post(f"{CONTROL}/lease", self.rpc_lease), web.post(f"{CONTROL}/renew", self.rpc_renew),
                web.post(f"{CONTROL}/progress", self.rpc_progress),
                web.post(f"{CONTROL}/progress_many", self.rpc_progress_many),
                web.post(f"{CONTROL}/complete", self.rpc_complete),
                web.post(f"{CONTROL}/release", self.rpc_release),
                web.post(f"{CONTROL}/release_all", self.rpc_release_all),
                web.get(f"{CONTROL}/status", self.rpc_status)]

    async def start(self) -> None:
        self._feed_probe_figures()
        t = asyncio.create_task(self._timer(), name=f"{self.host.config.id}:lease-timer")
        t.add_done_callback(self._task_done)
        self._tasks.append(t)

    def _feed_probe_figures(self) -> None:
        """Give the live planner (gossip starts first) the probe run named by ``probe.measurements``."""
        path = self.host.config.probe.measurements
        planner = getattr(self.gossip, "planner", None)
        if not path or planner is None:
            return
        from topology.model import NetworkModel

        try:
            measured = NetworkModel.load(path)
        except OSError as exc:
            raise ConfigError("probe.measurements", f"cannot read {path}: {exc.strerror}") from None
        planner.use_measurements(measured)
        self.host.log.info("live plan uses probe figures from %s (%d nodes, %d pairs)", path, len(measured),
                           len(measured.measurements()))

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.host.log.error("coordinator task crashed: %r", task.exception(), exc_info=task.exception())

    async def stop(self) -> None:
        self._stopped = True
        for w in self._waiters:
            if not w.future.done():
                w.future.set_result([])
        self._waiters.clear()
        for t in self._tasks:
            await cancel_quietly(t)
        self._results.put_nowait(None)  # type: ignore[arg-type]  # wakes results() so it ends

    # --- WorkSink ------------------------------------------------------------------------------
    def submit(self, work_id: str, payload: dict[str, Any], *, prompt_key: str = "", responses: int = 1) -> None:
        """Queue a prompt group; idempotent by ``work_id``. ``ValueError`` for a bad id or count."""
        if not isinstance(work_id, str) or not 0 < len(work_id) <= 128:
            raise ValueError(f"work_id must be a non-empty string of at most 128 characters, got {work_id!r}")
        if not isinstance(responses, int) or not 1 <= responses <= 1024:
            raise ValueError(f"responses must be 1..1024, got {responses!r}")
        self.table.submit(WorkItem(work_id, prompt_key or work_id, payload, responses))
        self._kick.set()

    async def results(self) -> AsyncIterator[Result]:
        """Accepted results in completion order, each work id once; ends when the node stops."""
        while True:
            r = await self._results.get()
            if r is None:
                self._results.put_nowait(None)  # for any other reader
                return
            yield r

    def pending(self) -> int:
        return self.table.pending()

    # --- scheduling ----------------------------------------------------------------------------
    def _head(self) -> int:
        return self.host.version if self.host.version is not None else 0

    def _member_info(self, node_id: str) -> tuple[str, float | None, int | None]:
        """(node class, reported throughput or None, newest reported version or None).

        The version is the fresher of the node's last gossip report and what its last
        lease request said: a report waits for the next gossip round (a second by
        default, several training steps of a small model), so a node that took a new
        version since would look stale and get no work in between."""
        said = self._said_version.get(node_id)
        g = self.gossip.gossip if self.gossip is not None else None
        if g is None:
            return "reserved", None, None if said is None else said[1]
        e = g.members.get(node_id)
        got = g.reports.get(node_id)
        rep = None if got is None else got[1]
        cls = e.node_class if e is not None else "reserved"
        tps = rep.throughput if rep is not None and rep.throughput > 0 else None
        version = rep.versions[-1] if rep is not None and rep.versions else None
        if said is not None and (version is None or got is None or said[0] >= got[0]):
            version = said[1]
        return cls, tps, version

    def _views(self, now: float) -> list[NodeView]:
        head = self._head()
        waiting: dict[str, int] = {}
        for w in self._waiters:
            waiting[w.node] = waiting.get(w.node, 0) + w.max_items
        holders = {n for n, leases in self.table.holders().items() if leases}
        info = {n: self._member_info(n) for n in set(waiting) | holders}
        known = [tps for _, tps, _ in info.values() if tps] + [v for v in self._tps.values()]
        default_tps = sum(known) / len(known) if known else _DEFAULT_TPS
        views = []
        for n in sorted(set(waiting) | holders):
            cls, tps, version = info[n]
            tps = tps or self._tps.get(n) or default_tps
            held = self.table.leases_of(n)
            slots = len(held) + waiting.get(n, 0)
            per_slot = tps / max(1, slots)
            busy = []
            for lease in held:
                item = self.table.item(lease.work_id)
                done = sum(len(t) for t in self.table.tokens(lease.work_id).values())
                left = max(1.0, self.scheduler.predictor.predict(item.prompt_key) - done)
                # A busy node that does not ask for more is not free now, whatever the estimate says.
                floor = now if n in waiting else now + 1.0
                busy.append(max(floor, now + left / per_slot))
            if version is None:
                version = head  # nothing reported (no gossip): assume current
            views.append(NodeView(n, cls, tps, slots, tuple(busy), version, None, None))
        return views

    def _dispatch(self) -> None:
        """Serve waiting lease requests from the queue, as the scheduler places the work."""
        if not self._waiters or not self.table.queued():
            return
        now = time.time()
        placements = self.scheduler.assign(now, self.table.queued(), self._views(now), self._head())
        want: dict[str, int] = {}
        for w in self._waiters:
            want[w.node] = want.get(w.node, 0) + w.max_items
        granted: dict[str, list[dict[str, Any]]] = {}
        for wid, nid in placements:
            if want.get(nid, 0) <= 0:
                continue  # planned on a busy node: stays queued for it
            lease = self.table.grant(now, nid, wid)
            self._granted_at[lease.lease_id] = now
            granted.setdefault(nid, []).append(grant_json(lease, self.table.item(wid), self.table.history(wid)))
            want[nid] -= 1
            self._dirty_holders.add(nid)
        if not granted:
            return
        keep = []
        for w in self._waiters:
            mine = granted.get(w.node, [])
            if mine and not w.future.done():
                w.future.set_result(mine[:w.max_items])
                granted[w.node] = mine[w.max_items:]
            else:
                keep.append(w)
        self._waiters = keep
        self._kick.set()

    async def _timer(self) -> None:
        """Expire leases when due, re-dispatch, publish lease entries; at least every 0.5 s."""
        while True:
            now = time.time()
            expired = self.table.expire(now)
            for wid in expired:
                self.host.log.info("lease on %s expired; back to the queue", wid)
            self._dirty_holders.update(self._published_holders - set(self.table.holders()))
            self._reconcile_leases()
            self._dispatch()
            self._publish_leases(now)
            nxt = self.table.next_expiry()
            timeout = 0.5 if nxt is None else min(0.5, max(0.01, nxt - time.time()))
            self._kick.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._kick.wait()
            except TimeoutError:
                pass

    def _reconcile_leases(self) -> None:
        """Mark holders whose gossiped ``leases/<node>`` entry names other work than the table (an
        old entry a straggler brought back after its tombstone was removed): republished next."""
        g = self.gossip.gossip if self.gossip is not None else None
        if g is None:
            return
        holders = self.table.holders()
        for name, e in g.coord.entries.items():
            if name.startswith(LEASES_PREFIX) and e.value:
                node = name[len(LEASES_PREFIX):]
                if sorted(w for w, _ in e.value) != [w for w, _ in holders.get(node, [])]:
                    self._dirty_holders.add(node)

    def _publish_leases(self, now: float) -> None:
        """``leases/<node>`` entries for holders whose lease set changed; an empty list (a tombstone
        every node drops after a while) for a node that holds nothing any more."""
        g = self.gossip.gossip if self.gossip is not None else None
        if g is None or g.coord.sign is None or not self._dirty_holders:
            self._dirty_holders.clear()
            return
        holders = self.table.holders()
        for n in sorted(self._dirty_holders):
            leases = [[w, round(t, 3)] for w, t in holders.get(n, [])]
            g.publish(f"leases/{n}", leases, now)
            if leases:
                self._published_holders.add(n)
            else:
                self._published_holders.discard(n)
        self._dirty_holders.clear()

    # --- HTTP ----------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        # Read here, not with request.read(): control bodies may exceed the node's general body limit
        # (the transport guard already refused a Content-Length over control.max_body_bytes).
        limit = self.host.config.control.max_body_bytes
        n = request.content_length
        if request.body_exists and n is None:
            raise BadRequest("Content-Length required")
        try:
            raw = await request.content.readexactly(n) if n else b""
        except asyncio.IncompleteReadError:
            raise BadRequest("body shorter than its Content-Length") from None
        if len(raw) > limit:
            raise BadRequest(f"body over {limit} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"body is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        node = _field(body, "node", str)
        if not 0 < len(node) <= 128:
            raise BadRequest("node: must be a node id")
        return body

    @staticmethod
    def _error(status: int, message: str, **extra: Any) -> web.Response:
        return web.json_response({"error": message, "status": status, **extra}, status=status)

    async def _handle(self, request: web.Request, fn: Any) -> web.Response:
        try:
            body = await self._body(request)
            return web.json_response(await fn(body))
        except BadRequest as exc:
            return self._error(400, str(exc))
        except UnknownWork as exc:
            return self._error(404, str(exc), work_id=exc.work_id)
        except ProgressGap as exc:
            return self._error(409, str(exc), kind="gap", have=exc.have)
        except LeaseExpired as exc:
            return self._error(409, str(exc), kind="expired", work_id=exc.work_id)

    async def rpc_lease(self, request: web.Request) -> web.Response:
        return await self._handle(request, self._lease)

    async def _lease(self, body: dict[str, Any]) -> dict[str, Any]:
        node = body["node"]
        max_items = _field(body, "max_items", int, optional=True)
        max_items = 1 if max_items is None else max_items
        wait = _field(body, "wait", (int, float), optional=True)
        wait = 0.0 if wait is None else float(wait)
        if not 1 <= max_items <= MAX_ITEMS:
            raise BadRequest(f"max_items: must be 1..{MAX_ITEMS}")
        if not 0 <= wait <= MAX_WAIT or not math.isfinite(wait):
            raise BadRequest(f"wait: must be 0..{MAX_WAIT} seconds")
        version = _field(body, "version", int, optional=True)
        if version is not None and version < 0:
            raise BadRequest("version: must be >= 0")
        if version is not None:
            self._said_version[node] = (time.time(), version)
        if self._stopped:
            return {"grants": [], "ttl": self.table.ttl}
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        w = _Waiter(node, max_items, fut)
        self._waiters.append(w)
        self._dispatch()
        try:
            if not fut.done():
                await asyncio.wait({fut}, timeout=wait)
        except asyncio.CancelledError:
            self._drop_waiter(w, hand_back=True)
            raise
        grants = self._drop_waiter(w, hand_back=False)
        return {"grants": grants, "ttl": self.table.ttl}

    def _drop_waiter(self, w: _Waiter, hand_back: bool) -> list[dict[str, Any]]:
        if w in self._waiters:
            self._waiters.remove(w)
        if not w.future.done():
            w.future.cancel()
            return []
        grants = w.future.result()
        if hand_back:
            # The caller went away with grants it never saw: give them back at once.
            for g in grants:
                try:
                    self.table.release(time.time(), w.node, g["work_id"], g["lease_id"])
                except LeaseExpired:
                    pass
            self._dirty_holders.add(w.node)
            self._kick.set()
        return grants

    async def rpc_renew(self, request: web.Request) -> web.Response:
        async def renew(body: dict[str, Any]) -> dict[str, Any]:
            lease = self.table.renew(time.time(), body["node"], _field(body, "work_id", str),
                                     _field(body, "lease_id", int))
            return {"expires_at": lease.expires_at}
        return await self._handle(request, renew)

    async def rpc_progress(self, request: web.Request) -> web.Response:
        async def progress(body: dict[str, Any]) -> dict[str, Any]:
            return {"have": self._record_progress(body["node"], _report(body, ""))}
        return await self._handle(request, progress)

    def _record_progress(self, node: str, r: _Report) -> int:
        if not 0 <= r.response < self.table.item(r.work_id).responses:
            raise BadRequest(f"response: {r.response} is not a response index of {r.work_id}")
        return self.table.progress(time.time(), node, r.work_id, r.lease_id, r.response, r.offset, r.tokens,
                                   logprobs=r.logprobs, versions=r.versions, finish_reason=r.finish_reason)

    async def rpc_progress_many(self, request: web.Request) -> web.Response:
        return await self._handle(request, self._progress_many)

    async def _progress_many(self, body: dict[str, Any]) -> dict[str, Any]:
        raw = _field(body, "reports", list)
        if len(raw) > MAX_REPORTS:
            raise BadRequest(f"reports: at most {MAX_REPORTS} per request")
        reports = []
        for i, r in enumerate(raw):  # every report is checked before any is recorded
            if not isinstance(r, dict):
                raise BadRequest(f"reports.{i}: must be an object")
            reports.append(_report(r, f"reports.{i}."))
        results: list[dict[str, Any]] = []
        for r in reports:
            try:
                results.append({"have": self._record_progress(body["node"], r)})
            except BadRequest as exc:
                results.append({"status": 400, "error": str(exc)})
            except UnknownWork as exc:
                results.append({"status": 404, "error": str(exc), "work_id": exc.work_id})
            except ProgressGap as exc:
                results.append({"status": 409, "error": str(exc), "kind": "gap", "have": exc.have})
            except LeaseExpired as exc:
                results.append({"status": 409, "error": str(exc), "kind": "expired", "work_id": exc.work_id})
        return {"results": results}

    async def rpc_complete(self, request: web.Request) -> web.Response:
        return await self._handle(request, self._complete)

    async def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        node = body["node"]
        wid = _field(body, "work_id", str)
        lease_id = _field(body, "lease_id", int)
        item = self.table.item(wid)
        raw = _field(body, "responses", dict)
        want = {str(i) for i in range(item.responses)}
        if set(raw) != want:
            raise BadRequest(f"responses: need exactly the indices 0..{item.responses - 1}")
        responses = [parse_response(raw[str(i)], f"responses.{i}") for i in range(item.responses)]
        now = time.time()
        c = self.table.complete(now, node, wid, lease_id, responses)
        self._dirty_holders.add(node)
        if c.accepted:
            holders = self.table.holders_of(wid)
            tokens = sum(len(r.tokens) for r in responses)
            self.scheduler.predictor.observe(item.prompt_key, tokens)
            started = self._granted_at.pop(lease_id, None)
            if started is not None and now > started and len(holders) == 1:
                rate = tokens / (now - started)
                old = self._tps.get(node)
                self._tps[node] = rate if old is None else 0.7 * old + 0.3 * rate
            self._results.put_nowait(Result(wid, node, item.payload, responses, len(holders) > 1))
            self.host.log.info("work %s completed by %s (%s)", wid, node, c.reason)
        self._kick.set()
        return {"accepted": c.accepted, "reason": c.reason}

    async def rpc_release(self, request: web.Request) -> web.Response:
        async def release(body: dict[str, Any]) -> dict[str, Any]:
            self.table.release(time.time(), body["node"], _field(body, "work_id", str),
                               _field(body, "lease_id", int))
            self._dirty_holders.add(body["node"])
            self._kick.set()
            return {}
        return await self._handle(request, release)

    async def rpc_release_all(self, request: web.Request) -> web.Response:
        async def release_all(body: dict[str, Any]) -> dict[str, Any]:
            out = self.table.release_all(time.time(), body["node"])
            if out:
                self.host.log.info("%s handed back %d leases: %s", body["node"], len(out), out)
            self._dirty_holders.add(body["node"])
            self._kick.set()
            return {"released": out}
        return await self._handle(request, release_all)

    async def rpc_status(self, request: web.Request) -> web.Response:
        c: dict[str, Any] = dict(self.table.counts())
        c["pending"] = self.table.pending()
        c["requeued"] = self.table.requeued
        c["waiting"] = len(self._waiters)
        c["holders"] = {n: [w for w, _ in leases] for n, leases in self.table.holders().items() if leases}
        return web.json_response(c)
