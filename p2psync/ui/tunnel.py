"""A local window onto a node's live page: a loopback HTTP server that forwards ``/ui`` over mutual TLS.

Every node serves only mutual TLS, and a browser holds no certificate of the
cluster CA. ``p2psync ui --node URL --tls-dir DIR`` listens on the operator's
own loopback (``127.0.0.1`` only: nothing else on the network reaches it) and
forwards the live page's requests (``/ui``, ``/ui/state``, ``/ui/assets/...``,
with their query, cookie and answer headers, the page's Content-Security-Policy,
X-Content-Type-Options and Referrer-Policy included) to the node, presenting the
operator's client certificate and checking the node's against the cluster CA.
The page's own token check is unchanged (``?token=`` once, then its cookie).
Nothing but ``GET /ui...`` is forwarded.
"""

from __future__ import annotations

import socket

import aiohttp
from aiohttp import web

from p2psync.transport.tls import Tls

_PASS_UP = ("Cookie", "Authorization", "Accept", "If-None-Match")
_PASS_DOWN = ("Content-Type", "Set-Cookie", "Cache-Control", "ETag", "Location",
              # The page's own protections (p2psync.ui.service): the browser must see them too.
              "Content-Security-Policy", "X-Content-Type-Options", "Referrer-Policy")


class Tunnel:
    """Build with ``await Tunnel.start(node_url, tls, sock)``; stop with :meth:`close`."""

    def __init__(self, node_url: str, tls: Tls) -> None:
        self.node_url = node_url.rstrip("/")
        self.tls = tls
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    @classmethod
    async def start(cls, node_url: str, tls: Tls, sock: socket.socket) -> Tunnel:
        t = cls(node_url, tls)
        t._session = aiohttp.ClientSession(connector=tls.connector(limit=16), auto_decompress=False)
        app = web.Application()
        app.router.add_get("/ui", t.rpc_forward)
        app.router.add_get("/ui/{tail:.*}", t.rpc_forward)
        t._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await t._runner.setup()
        await web.SockSite(t._runner, sock).start()
        return t

    async def rpc_forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        headers = {k: request.headers[k] for k in _PASS_UP if k in request.headers}
        try:
            async with self._session.get(self.node_url + request.path_qs, headers=headers, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=30)) as up:
                body = await up.read()
                out = web.Response(status=up.status, body=body)
                for k in _PASS_DOWN:
                    for v in up.headers.getall(k, []):
                        out.headers.add(k, v)
                return out
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return web.json_response({"error": f"node {self.node_url} unreachable: {exc}", "status": 502}, status=502)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
