"""The HTTP API a node serves (aiohttp), versioned under ``/v1``.

``GET /v1/head``                          catalogue: version, head, artifacts held or in flight
``GET /v1/events``                        server-sent events: one ``head`` event per catalogue change
``GET /v1/stream?push=N``                 binary frames: catalogues, plus new deltas up to N bytes pushed whole
``GET /v1/artifacts/{id}/manifest``       signed manifest bytes
``GET /v1/artifacts/{id}/chunks/{i}``     chunk i (``Range`` honoured); waits while it is in flight
``GET /v1/versions/{v}/manifest?kind=``   manifest of the delta (default) or snapshot reaching version v
``GET /v1/snapshots``                     snapshot manifests held (JSON)
``GET /v1/status``                        JSON: role, region, versions, parent, children, transfers, bytes
``GET /metrics``                          Prometheus text

Contract: with TLS on (the default) a client without a certificate of the
cluster CA is refused in the handshake; a request from a revoked node id, or one
whose ``X-P2PSync-Node`` header names another node than its certificate, gets
403 (:mod:`p2psync.transport.tls`); every request without the cluster token gets
401 before any other work (routing included); a declared body above the limit gets 413 unread; a
request line or header field above ``limits.max_header_bytes`` gets 431; a
chunk leaves this node only after it matched the signed manifest (re-checked
on every read from disk; recent chunks are served from the store's memory copy
of the bytes it verified). Each connection is its own task, and every write to
a client is bounded by ``limits.idle_timeout``, so a slow or idle client is cut
off without holding up anyone else.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
from contextlib import AbstractContextManager, nullcontext

from aiohttp import web, web_protocol, web_server
from aiohttp.http_exceptions import LineTooLong

from p2psync.errors import IntegrityError
from p2psync.transport.messages import API, NODE_HEADER, valid_artifact_id
from p2psync.transport.metrics import CONTENT_TYPE, Metrics
from p2psync.transport.push import serve_stream
from p2psync.transport.peers import PEER_KEY, claim_refused
from p2psync.transport.tls import Tls
from p2psync.transport.view import HeadSignal, NodeView

CONTROL_PREFIX = f"{API}/control/"
GOSSIP_PATH = f"{API}/gossip"

logger = logging.getLogger(__name__)

_WRITE_PIECE = 256 << 10
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


class Server:
    """Request handlers (``rpc_<verb>``) bound to one node."""

    def __init__(self, view: NodeView, tls: Tls | None = None) -> None:
        self.view = view
        self.tls = tls
        self.token = view.config.token().encode()
        self.limits = view.config.limits
        self.control_body_limit = view.config.control.max_body_bytes
        self.gossip_body_limit = view.config.gossip.max_body_bytes

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=self.limits.max_body_bytes)
        r = app.router
        r.add_get(f"{API}/head", self.rpc_head)
        r.add_get(f"{API}/events", self.rpc_events)
        r.add_get(f"{API}/stream", self.rpc_stream)
        r.add_get(f"{API}/artifacts/{{aid}}/manifest", self.rpc_manifest)
        r.add_get(f"{API}/artifacts/{{aid}}/chunks/{{index}}", self.rpc_chunk)
        r.add_get(f"{API}/versions/{{version}}/manifest", self.rpc_version_manifest)
        r.add_get(f"{API}/snapshots", self.rpc_snapshots)
        r.add_get(f"{API}/status", self.rpc_status)
        r.add_get("/metrics", self.rpc_metrics)
        r.add_routes(self.view.extra_routes())
        return app

    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        peer = self.tls.admit(request) if self.tls is not None else None
        if isinstance(peer, str):
            self.view.metrics.inc("p2psync_requests_total", code="403")
            resp = _error(403, peer)
            resp.force_close()
            return resp
        if peer is not None:
            request[PEER_KEY] = peer
        auth = request.headers.get("Authorization", "")
        presented = auth[7:].encode() if auth.startswith("Bearer ") else b""
        if not presented and (request.path == "/ui" or request.path.startswith("/ui/")):
            # The live page (p2psync.ui): a browser brings the token once as ?token=, then as its cookie.
            presented = (request.query.get("token") or request.cookies.get("p2psync_ui", "")).encode()
        if not hmac.compare_digest(presented, self.token):
            self.view.metrics.inc("p2psync_requests_total", code="401")
            return _error(401, "missing or wrong cluster token")
        length = request.content_length
        # Control requests (results, progress batches) carry tokens and gossip messages a table's worth
        # of entries after a partition: they have their own, larger limits, and their handlers read the
        # body themselves (aiohttp's client_max_size is the general limit).
        if request.path.startswith(CONTROL_PREFIX):
            limit = self.control_body_limit
        elif request.path == GOSSIP_PATH:
            limit = self.gossip_body_limit
        else:
            limit = self.limits.max_body_bytes
        if length is not None and length > limit:
            self.view.metrics.inc("p2psync_requests_total", code="413")
            resp = _error(413, f"request body of {length} bytes exceeds the {limit} limit")
            resp.force_close()
            return resp
        child = request.headers.get(NODE_HEADER)
        refused = claim_refused(request, child, NODE_HEADER, parts=True) if child else None
        if refused:
            self.view.metrics.inc("p2psync_requests_total", code="403")
            return _error(403, refused)
        if child:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.view.note_child(child[:64], f"{peer[0]}:{peer[1]}" if peer else "?")
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            self.view.metrics.inc("p2psync_requests_total", code=str(exc.status))
            raise
        self.view.metrics.inc("p2psync_requests_total", code=str(resp.status))
        return resp

    # --- catalogue ----------------------------------------------------------------------
    async def rpc_head(self, request: web.Request) -> web.Response:
        return web.json_response(text=self.view.catalogue().dumps())

    def _following(self, request: web.Request) -> AbstractContextManager[None]:
        """Counts the stream on the board while open if a node (a child) opened it."""
        child = request.headers.get(NODE_HEADER)
        return self.view.board.following(child[:64]) if child else nullcontext()

    async def rpc_events(self, request: web.Request) -> web.StreamResponse:
        with self._following(request):
            return await self._events(request)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        heads = self.view.heads
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        seq = -1
        try:
            await resp.prepare(request)
            while not heads.closed:
                if heads.seq != seq:
                    seq = heads.seq
                    payload = f"event: head\ndata: {self.view.catalogue().dumps()}\n\n"
                else:
                    payload = ": keepalive\n\n"
                await self.write(resp, payload.encode())
                await heads.wait(seq, self.limits.sse_keepalive)
        except ConnectionError:  # reset, broken pipe, or aiohttp's 'Connection lost' while draining
            pass  # the child went away; nothing else to do for it
        except TimeoutError:
            self.cut(request)
        return resp

    async def rpc_stream(self, request: web.Request) -> web.StreamResponse:
        """Catalogues plus new small deltas pushed whole (:mod:`p2psync.transport.push`)."""
        with self._following(request):
            return await serve_stream(self, request)

    async def rpc_snapshots(self, request: web.Request) -> web.Response:
        snaps = [{"version": a.manifest.target_version, "id": aid, "bytes": a.manifest.payload_bytes,
                  "complete": a.complete} for aid, a in list(self.view.store.artifacts.items())
                 if a.manifest.kind == "snapshot"]
        return web.json_response({"format": 1, "snapshots": sorted(snaps, key=lambda s: s["version"])})

    async def rpc_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.view.status())

    async def rpc_metrics(self, request: web.Request) -> web.Response:
        cfg = self.view.config
        text = self.view.metrics.render(node=cfg.id, region=cfg.region, role=cfg.role)
        return web.Response(text=text, headers={"Content-Type": CONTENT_TYPE})

    # --- artifacts ----------------------------------------------------------------------
    def _artifact(self, request: web.Request):
        aid = request.match_info["aid"]
        if not valid_artifact_id(aid):
            raise web.HTTPBadRequest(text="malformed artifact id")
        art = self.view.store.artifacts.get(aid)
        if art is None:
            raise web.HTTPNotFound(text=f"artifact {aid} not held")
        return aid, art

    async def rpc_manifest(self, request: web.Request) -> web.Response:
        _, art = self._artifact(request)
        return web.Response(body=art.manifest.to_bytes(), content_type="application/octet-stream")

    async def rpc_version_manifest(self, request: web.Request) -> web.Response:
        try:
            version = int(request.match_info["version"])
        except ValueError:
            raise web.HTTPBadRequest(text="version must be an integer") from None
        kind = request.query.get("kind", "delta")
        if kind not in ("delta", "snapshot"):
            raise web.HTTPBadRequest(text="kind must be delta or snapshot")
        art = self.view.store.find(kind, version)
        if art is None:
            raise web.HTTPNotFound(text=f"no {kind} manifest for version {version}")
        return web.Response(body=art.manifest.to_bytes(), content_type="application/octet-stream",
                            headers={"X-P2PSync-Artifact": art.manifest.artifact_id})

    async def rpc_chunk(self, request: web.Request) -> web.StreamResponse:
        aid, art = self._artifact(request)
        try:
            index = int(request.match_info["index"])
        except ValueError:
            raise web.HTTPBadRequest(text="chunk index must be an integer") from None
        n = len(art.manifest.chunks)
        if not 0 <= index < n:
            raise web.HTTPBadRequest(text=f"chunk index {index} out of range (artifact has {n})")
        size = art.manifest.chunks[index].size
        start, stop = self._range(request.headers.get("Range"), size)
        store, board = self.view.store, self.view.board
        if not store.has_chunk(aid, index):
            if not board.active(aid):
                raise web.HTTPNotFound(text=f"chunk {index} of {aid} not held")
            # Cut-through: the chunk is on its way to us; answer as soon as it is verified.
            await board.wait(aid, index, self.limits.chunk_wait_timeout)
            if not store.has_chunk(aid, index):
                raise web.HTTPServiceUnavailable(text=f"chunk {index} of {aid} not here yet",
                                                 headers={"Retry-After": "1"})
        try:
            data = store.cached_chunk(aid, index)  # verified when stored: no disk read, no re-hash
            if data is None:
                data = await asyncio.to_thread(store.read_chunk, aid, index)
        except IntegrityError as exc:
            logger.error("store: %s; not serving it", exc)
            raise web.HTTPServiceUnavailable(text="chunk failed its re-check", headers={"Retry-After": "1"}) from None
        if self.view.config.testing.serve_delay:
            await asyncio.sleep(self.view.config.testing.serve_delay)
        if self.view.config.testing.corrupt_served_chunks:
            buf = bytearray(data)
            buf[len(buf) // 2] ^= 0xFF
            data = bytes(buf)
        body = memoryview(data)[start:stop]
        status = 206 if (start, stop) != (0, size) else 200
        resp = web.StreamResponse(status=status, headers={"Content-Type": "application/octet-stream",
                                                          "Accept-Ranges": "bytes"})
        if status == 206:
            resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        resp.content_length = len(body)
        try:
            await resp.prepare(request)
            for off in range(0, len(body), _WRITE_PIECE):
                await self.write(resp, body[off:off + _WRITE_PIECE])
            await resp.write_eof()
        except ConnectionError:  # reset, broken pipe, or aiohttp's 'Connection lost' while draining
            return resp  # the child went away; it resumes elsewhere with Range
        except TimeoutError:
            self.cut(request)  # it stopped reading; it may resume elsewhere with Range
            return resp
        self.view.metrics.inc("p2psync_bytes_out_total", len(body))
        self.view.metrics.inc("p2psync_chunks_out_total")
        return resp

    @staticmethod
    def _range(header: str | None, size: int) -> tuple[int, int]:
        if header is None:
            return 0, size
        m = _RANGE.match(header.strip())
        if not m or (not m.group(1) and not m.group(2)):
            raise web.HTTPBadRequest(text="malformed Range (one range, bytes=a-b, a- or -n)")
        a, b = m.group(1), m.group(2)
        if not a:
            start, stop = max(0, size - int(b)), size
        else:
            start, stop = int(a), size if not b else min(size, int(b) + 1)
        if start >= size or stop <= start:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
        return start, stop

    def cut(self, request: web.Request) -> None:
        """Drop a client that stopped reading (closing, not finishing, the response: finishing
        it would wait on that client again)."""
        self.view.metrics.inc("p2psync_slow_clients_cut_total")
        if request.transport is not None:
            request.transport.abort()

    async def write(self, resp: web.StreamResponse, data: bytes | memoryview) -> None:
        # A client that does not read for idle_timeout is dropped; others are unaffected.
        async with asyncio.timeout(self.limits.idle_timeout):
            await resp.write(data)


class _Connection(web_protocol.RequestHandler):
    """aiohttp's per-connection protocol, except that a request line or header field longer
    than ``limits.max_header_bytes`` gets 431 (aiohttp answers every parse error with 400),
    counted in the metrics and without an error-level log line per offending client."""

    metrics: Metrics

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, LineTooLong):
            return super().handle_error(request, status, exc, message)
        self.metrics.inc("p2psync_requests_total", code="431")
        resp = _error(431, f"request line or header field longer than {exc.args[1]} bytes")
        resp.force_close()
        return resp


class _Connections(web_server.Server):
    """Makes :class:`_Connection` protocols (the runner builds this server; we only swap the class)."""

    metrics: Metrics

    def __call__(self) -> web_protocol.RequestHandler:
        conn = _Connection(self, loop=self._loop, **self._kwargs)
        conn.metrics = self.metrics
        return conn


async def serve(view: NodeView, sock: socket.socket, tls: Tls | None = None) -> web.AppRunner:
    """Serve on ``sock`` (from :func:`bind`), over mutually authenticated TLS when ``tls`` has a server
    context; returns the runner (for cleanup)."""
    lim = view.config.limits
    runner = web.AppRunner(Server(view, tls).app(), access_log=None, handle_signals=False,
                           keepalive_timeout=lim.idle_timeout, max_line_size=lim.max_header_bytes,
                           max_field_size=lim.max_header_bytes, shutdown_timeout=1.0)
    await runner.setup()
    server = runner.server
    assert type(server) is web_server.Server, type(server)
    server.__class__ = _Connections  # same object and layout, different protocol factory
    assert isinstance(server, _Connections)
    server.metrics = view.metrics
    ctx = tls.server_context if tls is not None else None
    await web.SockSite(runner, sock, ssl_context=ctx).start()
    return runner


def status_json(d: dict) -> str:
    return json.dumps(d, indent=1, sort_keys=True)
