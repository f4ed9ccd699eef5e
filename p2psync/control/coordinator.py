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

Leasing, scheduling and the contracts on results are :mod:`p2psync.control.lease_core`;
the bodies' schema is :mod:`p2psync.control.bodies`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from p2psync.control.api import Result
from p2psync.control.bodies import (
    CONTROL,
    BadRequest,
    CompleteBody,
    LeaseBody,
    LeaseRef,
    NodeBody,
    ProgressMany,
    Report,
    check_report,
    parse,
    parse_response,
    read_body,
)
from p2psync.control.lease_core import CoordinatorCore, Waiter
from p2psync.errors import LeaseExpired, ProgressGap, UnknownWork
from p2psync.transport.peers import claim_refused

logger = logging.getLogger(__name__)


class Coordinator(CoordinatorCore):
    """Leases, scheduling and results on the trainer node (``node.coordinator``), served over HTTP.

    Built as :class:`~p2psync.control.lease_core.CoordinatorCore`; :meth:`routes` are the
    handlers the node's server mounts."""

    # --- service ---------------------------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [web.post(f"{CONTROL}/lease", self.rpc_lease), web.post(f"{CONTROL}/renew", self.rpc_renew),
                web.post(f"{CONTROL}/progress", self.rpc_progress),
                web.post(f"{CONTROL}/progress_many", self.rpc_progress_many),
                web.post(f"{CONTROL}/complete", self.rpc_complete),
                web.post(f"{CONTROL}/release", self.rpc_release),
                web.post(f"{CONTROL}/release_all", self.rpc_release_all),
                web.get(f"{CONTROL}/status", self.rpc_status)]

    # --- HTTP ----------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        # Control bodies carry tokens and may exceed the node's general body limit.
        raw = await read_body(request, self.host.config.control.max_body_bytes)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"body is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        parse(body, NodeBody)
        return body

    @staticmethod
    def _error(status: int, message: str, **extra: Any) -> web.Response:
        return web.json_response({"error": message, "status": status, **extra}, status=status)

    async def _handle(self, request: web.Request, fn: Any) -> web.Response:
        try:
            body = await self._body(request)
            # The node named in the body is the one the client's certificate names: results, leases
            # and progress are attributed to the authenticated node, never to a claim.
            refused = claim_refused(request, body["node"], "node")
            if refused:
                return self._error(403, refused)
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
        b = parse(body, LeaseBody)
        node, version = b.node, b.version
        max_items = 1 if b.max_items is None else b.max_items
        wait = 0.0 if b.wait is None else b.wait
        if version is not None:
            self._said_version[node] = (time.time(), version)
        if self._stopped:
            return {"grants": [], "ttl": self.table.ttl}
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        w = Waiter(node, max_items, fut)
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

    def _drop_waiter(self, w: Waiter, hand_back: bool) -> list[dict[str, Any]]:
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
            ref = parse(body, LeaseRef)
            lease = self.table.renew(time.time(), ref.node, ref.work_id, ref.lease_id)
            return {"expires_at": lease.expires_at}
        return await self._handle(request, renew)

    async def rpc_progress(self, request: web.Request) -> web.Response:
        async def progress(body: dict[str, Any]) -> dict[str, Any]:
            return {"have": self._record_progress(body["node"], check_report(parse(body, Report)))}
        return await self._handle(request, progress)

    def _record_progress(self, node: str, r: Report) -> int:
        if not 0 <= r.response < self.table.item(r.work_id).responses:
            raise BadRequest(f"response: {r.response} is not a response index of {r.work_id}")
        return self.table.progress(time.time(), node, r.work_id, r.lease_id, r.response, r.offset, r.tokens,
                                   logprobs=r.logprobs, versions=r.versions, finish_reason=r.finish_reason)

    async def rpc_progress_many(self, request: web.Request) -> web.Response:
        return await self._handle(request, self._progress_many)

    async def _progress_many(self, body: dict[str, Any]) -> dict[str, Any]:
        # every report is checked before any is recorded
        reports = [check_report(r, f"reports.{i}") for i, r in enumerate(parse(body, ProgressMany).reports)]
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
        b = parse(body, CompleteBody)
        node, wid, lease_id, raw = b.node, b.work_id, b.lease_id, b.responses
        item = self.table.item(wid)
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
            ref = parse(body, LeaseRef)
            self.table.release(time.time(), ref.node, ref.work_id, ref.lease_id)
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
