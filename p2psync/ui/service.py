"""The live page's service on the trainer node: ``/ui`` (page), ``/ui/state`` (JSON), ``/ui/assets/*``.

Cluster view: ``node.cluster()`` (the control plane's membership: id, role,
region, advertised address, version, status, planned parent) when the node
has it, plus the children the trainer has seen pulling from it that the view
lacks (without gossip: the trainer and those children; their advertised
addresses are unknown, so only their ids and last-seen ages are shown). Each reachable member's ``GET /v1/status`` is
fetched concurrently with a short timeout; the assembled state is cached for
``REFRESH_S`` and concurrent page polls share one refresh, so any number of
open pages cost the cluster one status round per ``REFRESH_S``.

Auth: every route sits behind the node's cluster-token guard. A browser
cannot send the ``Authorization`` header, so the guard also accepts, for
paths under ``/ui`` only, the token as ``?token=`` or as the ``p2psync_ui``
cookie; ``GET /ui?token=...`` sets that cookie (HttpOnly, SameSite=Strict,
Path=/ui) and redirects to ``/ui`` so the token does not stay in the address
bar or the history. Everything the page loads comes from this node
(a Content-Security-Policy says so); nothing outside is fetched.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from p2psync.ui.state import build_state

if TYPE_CHECKING:
    from p2psync.host import Host

logger = logging.getLogger(__name__)

COOKIE = "p2psync_ui"
"""Cookie name; the guard in :mod:`p2psync.transport.server` reads the same literal."""
REFRESH_S = 0.5
STATUS_TIMEOUT_S = 1.0
MAX_POLLED = 256
"""Members whose status is fetched per refresh (a larger cluster shows the rest from the cluster view only)."""
_PARALLEL = 32
_ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _asset(name: str) -> bytes:
    return resources.files("p2psync.ui").joinpath("assets", name).read_bytes()


class UiService:
    """The live page. Contract: see the module doc; read-only (no route changes any state but the cookie)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._session: aiohttp.ClientSession | None = None
        self._state: dict[str, Any] | None = None
        self._at = 0.0
        self._refresh: asyncio.Task | None = None
        self._assets = {name: _asset(name) for name in (*_ASSETS, "index.html")}

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/ui", self.rpc_page), web.get("/ui/", self.rpc_page),
                web.get("/ui/state", self.rpc_state), web.get("/ui/assets/{name}", self.rpc_asset)]

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.host.config.token()}"},
            connector=self.host.tls.connector(limit=_PARALLEL, enable_cleanup_closed=True))

    async def stop(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            try:
                await self._refresh
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping; its outcome no longer matters
                pass
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- routes ---------------------------------------------------------------------------------
    async def rpc_page(self, request: web.Request) -> web.StreamResponse:
        if "token" in request.query:
            # The guard checked the token. Keep it in an HttpOnly cookie, drop it from the URL.
            resp = web.HTTPSeeOther("/ui", headers=_HEADERS)
            resp.set_cookie(COOKIE, request.query["token"], path="/ui", httponly=True, samesite="Strict",
                            secure=request.secure)
            raise resp
        return web.Response(body=self._assets["index.html"], content_type="text/html", charset="utf-8",
                            headers=_HEADERS)

    async def rpc_asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _ASSETS:
            raise web.HTTPNotFound(text=f"no asset {name!r}")
        return web.Response(body=self._assets[name], content_type=_ASSETS[name], charset="utf-8", headers=_HEADERS)

    async def rpc_state(self, request: web.Request) -> web.Response:
        return web.json_response(await self.state(), headers=_HEADERS)

    # --- state ----------------------------------------------------------------------------------
    async def state(self) -> dict[str, Any]:
        """The current state document, at most ``REFRESH_S`` old; one refresh at a time."""
        loop = asyncio.get_running_loop()
        if self._state is not None and loop.time() - self._at < REFRESH_S:
            return self._state
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._build(), name=f"{self.host.config.id}:ui-refresh")
        # shield: a page that disconnects must not cancel the refresh other pages wait on.
        state = await asyncio.shield(self._refresh)
        self._state, self._at = state, loop.time()
        return state

    async def members(self) -> tuple[list[dict[str, Any]], str]:
        """The cluster view and where it came from (``cluster``, or ``children`` without a membership view).

        Children the trainer has seen pulling from it that the view does not list are added by id
        (their advertised addresses are unknown, so their status is not fetched).
        """
        node = self.host
        cfg = node.config
        me = {"id": cfg.id, "role": cfg.role, "region": cfg.region, "address": node.address,
              "version": node.version, "status": "alive", "parent": None}
        members: list[dict[str, Any]] = []
        source = "children"
        view = getattr(node, "cluster", None)
        if callable(view):
            got = view()
            if inspect.isawaitable(got):
                got = await got
            members = [dict(m) for m in got if isinstance(m, dict) and m.get("id")]
            source = "cluster" if any(m["id"] != cfg.id for m in members) else "children"
        if not any(m["id"] == cfg.id for m in members):
            members.insert(0, me)
        known = {m["id"] for m in members}
        for child in node.status().get("children", []):
            if child["id"] not in known:
                members.append({"id": child["id"], "parent": cfg.id, "status": "seen", "seen": child.get("seen")})
        return members, source

    async def _build(self) -> dict[str, Any]:
        members, source = await self.members()
        me = self.host.config.id
        statuses: dict[str, dict[str, Any]] = {me: self.host.status()}
        errors: dict[str, str] = {}
        gate = asyncio.Semaphore(_PARALLEL)

        async def fetch(m: dict[str, Any]) -> None:
            async with gate:
                try:
                    statuses[m["id"]] = await self._status(str(m["address"]))
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    errors[m["id"]] = f"{type(exc).__name__}: {exc}"[:200]

        polled = [m for m in members if m["id"] != me and m.get("address")
                  and m.get("status") not in ("dead", "left")][:MAX_POLLED]
        await asyncio.gather(*(fetch(m) for m in polled))
        return build_state(me, members, statuses, errors, time.time(), source)

    async def _status(self, address: str) -> dict[str, Any]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)
        async with self._session.get(address.rstrip("/") + "/v1/status", timeout=timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            data = await resp.json(content_type=None)
        if not isinstance(data, dict):
            raise ValueError("status is not a JSON object")
        return data
