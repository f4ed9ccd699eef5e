"""A real HTTP proxy in front of a p2psync node that cuts the chunks it forwards short.

It runs an aiohttp server on a loopback socket (port 0) in a thread of its own
and forwards every request to the node, except chunk 0 of any artifact, whose
body it serves cut short according to :attr:`ChunkProxy.mode`:

- ``"cut"``: the full size is announced (``Content-Length``), half the body is
  sent, then the connection is closed (the answer never completes);
- ``"chunked"``: half the body in a well-formed chunked answer (it completes);
- ``"short"``: half the body with a ``Content-Length`` that says so (it completes);
- ``"pass"``: nothing is cut (a plain forwarding proxy).

With ``tls`` (a :class:`~p2psync.transport.tls.Tls` of a node certificate) it serves and
calls the node over mutual TLS like any cluster member (a misbehaving node); it does
not forward the child's ``X-P2PSync-Node`` header (its certificate names itself).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import ClientSession, web

from p2psync.transport.tls import Tls, connector

MODES = ("cut", "chunked", "short", "pass")
_CHUNK0 = re.compile(r"/artifacts/[^/]+/chunks/0$")


class ChunkProxy:
    def __init__(self, upstream: str, mode: str, tls: Tls | None = None) -> None:
        assert mode in MODES, mode
        self.upstream = upstream
        self.tls = tls
        self.mode = mode
        self.url = ""
        self.cut = 0
        """How many chunk answers were cut short so far."""
        self.requests = 0
        """Requests that reached the proxy's handler (past its TLS handshake)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        drop = ("host", "content-length", "x-p2psync-node")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        async with ClientSession(auto_decompress=False, connector=connector(self.tls)) as s, \
                s.get(self.upstream + request.path_qs, headers=headers) as up:
            body = await up.read()
            status, ctype = up.status, up.headers.get("Content-Type", "application/octet-stream")
        if status != 200 or not _CHUNK0.search(request.path) or self.mode == "pass":
            return web.Response(status=status, body=body, content_type=ctype.split(";")[0])
        self.cut += 1
        half = body[: len(body) // 2]
        if self.mode == "short":
            return web.Response(body=half, content_type="application/octet-stream")
        resp = web.StreamResponse()
        resp.content_type = "application/octet-stream"
        if self.mode == "cut":
            resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(half)
        if self.mode == "cut":
            assert request.transport is not None
            request.transport.close()  # flushes what was written, then closes: the body stops early
        else:
            await resp.write_eof()
        return resp


@contextmanager
def chunk_proxy(upstream: str, mode: str, tls: Tls | None = None) -> Iterator[ChunkProxy]:
    """A :class:`ChunkProxy` serving on loopback for the duration of the block."""
    proxy = ChunkProxy(upstream, mode, tls)
    ready = threading.Event()
    box: dict = {}

    async def serve() -> None:
        # Requests still in flight when the block ends (a node's long-lived stream through the proxy)
        # are cancelled at once: aiohttp's default waits 60 s for them, longer than the join below.
        runner = web.AppRunner(web.Application(), access_log=None, handle_signals=False, shutdown_timeout=0.5)
        runner.app.router.add_route("GET", "/{tail:.*}", proxy.handle)
        await runner.setup()
        ctx = tls.server_context if tls is not None else None
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port = runner.addresses[0][1]
        proxy.url = f"{'https' if ctx else 'http'}://127.0.0.1:{port}"
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        try:
            await box["stop"].wait()
        finally:
            await runner.cleanup()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            box["error"] = exc
            ready.set()

    t = threading.Thread(target=run, name=f"chunk-proxy-{mode}", daemon=True)
    t.start()
    assert ready.wait(30) and "error" not in box, box.get("error")
    try:
        yield proxy
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(30)
        assert not t.is_alive(), "the proxy did not stop within 30 s"
