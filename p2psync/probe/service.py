"""Probe endpoints of a node (a service, see :mod:`p2psync.services`), and the client that calls them.

``GET  /v1/probe/ping``             small JSON answer (node id, region, role): one RTT sample
``GET  /v1/probe/blob?bytes=N``     N incompressible bytes, streamed; ``N <= MAX_BLOB_BYTES``
``POST /v1/probe/measure``          body :class:`MeasureRequest`: *this* node measures RTT and throughput
                                    to each target in turn and answers :class:`MeasureReply`

A measurement ``a.measure(targets=[b])`` is what ``a`` gets when it pulls from
``b``: the direction of :class:`topology.model.Measurement` ``(src=b, dst=a)``.

Contracts:

- Bad input is answered 400 with a JSON ``{"error": ...}`` naming the field; nothing is measured.
- Limits hold whatever the request says (the node's ``[probe]`` config section,
  :class:`p2psync.config.ProbeSettings`; defaults in brackets): a blob is at most ``max_blob_bytes``
  (256 MiB), at most ``max_blob_streams`` (4) blobs are served at once (more: 503 + ``Retry-After``), a
  measure request names at most ``max_targets`` (32) targets and ``max_rtt_samples`` (64) samples and asks
  for at most ``max_blob_bytes``, and a node runs one measurement at a time (a second one while it runs:
  409 + ``Retry-After``), so two measurements never share this node's links.
- A target that cannot be reached yields a result with ``error`` set; the other targets are still measured.
- The probe client sends no node-id header, so probing never makes a node list the prober as its child.

How the figures are taken: the RTT is the median (and the minimum) of ``rtt_samples`` pings on one
kept-alive connection, after one warm-up ping that opens it (so TCP and HTTP set-up are not counted).
Throughput is a timed download of ``bytes`` over that connection: ``8 * bytes / (t_last_byte -
t_request - rtt_min)``, i.e. without the request's own round trip. The bytes come from a random pool of
``POOL_BYTES`` served cyclically: incompressible for any compressor window below the pool size, and cheap
to send (generating random bytes per request would measure the CPU, not the link).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from p2psync.config import ProbeSettings
from p2psync.errors import CodecError, PeerUnreachable
from p2psync.transport.client import read_body
from p2psync.transport.tls import Tls, connector

if TYPE_CHECKING:
    from p2psync.host import Host

logger = logging.getLogger(__name__)

PROBE_FORMAT = 1
PREFIX = "/v1/probe"
_DEFAULTS = ProbeSettings()
# The defaults of the [probe] section, under the names earlier versions exported.
MAX_BLOB_BYTES = _DEFAULTS.max_blob_bytes
MAX_BLOB_STREAMS = _DEFAULTS.max_blob_streams
MAX_TARGETS = _DEFAULTS.max_targets
MAX_RTT_SAMPLES = _DEFAULTS.max_rtt_samples
DEFAULT_BYTES = _DEFAULTS.bytes
DEFAULT_RTT_SAMPLES = _DEFAULTS.rtt_samples
POOL_BYTES = 4 << 20
_PIECE = 256 << 10


class ProbeInputError(CodecError):
    """A probe request that does not follow the schema; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# --- wire messages ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeasureRequest:
    """Body of ``POST /v1/probe/measure``."""

    targets: tuple[str, ...]
    """Base URLs (``http(s)://host:port``) of the nodes to pull from."""
    bytes: int = DEFAULT_BYTES
    """Bytes downloaded from each target for the throughput figure (0: RTT only)."""
    rtt_samples: int = DEFAULT_RTT_SAMPLES
    format: int = PROBE_FORMAT

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "targets": list(self.targets), "bytes": self.bytes,
                "rtt_samples": self.rtt_samples}

    @classmethod
    def from_json(cls, data: Any, limits: ProbeSettings = _DEFAULTS) -> MeasureRequest:
        """Validate a decoded body against ``limits``; raises :class:`ProbeInputError` naming the first bad field."""
        if not isinstance(data, dict):
            raise ProbeInputError("<body>", "must be a JSON object")
        unknown = set(data) - {"format", "targets", "bytes", "rtt_samples"}
        if unknown:
            raise ProbeInputError(min(unknown), "unknown field")
        fmt = data.get("format", PROBE_FORMAT)
        if fmt != PROBE_FORMAT:
            raise ProbeInputError("format", f"unsupported probe format {fmt!r} (this build speaks {PROBE_FORMAT})")
        targets = data.get("targets")
        if not isinstance(targets, list) or not targets:
            raise ProbeInputError("targets", "must be a non-empty list of URLs")
        if len(targets) > limits.max_targets:
            raise ProbeInputError("targets", f"{len(targets)} targets exceed the limit of {limits.max_targets}")
        for i, t in enumerate(targets):
            if not isinstance(t, str) or not t.startswith(("http://", "https://")) or len(t) > 512 \
                    or any(c.isspace() for c in t):
                raise ProbeInputError(f"targets[{i}]", f"must be an http(s) base URL, got {t!r:.80}")
        n = _int(data, "bytes", min(limits.bytes, limits.max_blob_bytes), 0, limits.max_blob_bytes)
        k = _int(data, "rtt_samples", min(limits.rtt_samples, limits.max_rtt_samples), 1, limits.max_rtt_samples)
        return cls(tuple(t.rstrip("/") for t in targets), n, k)


@dataclass(frozen=True)
class TargetResult:
    """What the measuring node got from one target."""

    target: str
    node: str | None = None
    """The target's node id, region and role as its ping answered (None when unreachable)."""
    region: str | None = None
    role: str | None = None
    rtt_s: float | None = None
    """Median of the RTT samples."""
    rtt_min_s: float | None = None
    bandwidth_bps: float | None = None
    """Throughput of the timed download, bits/s (None when ``bytes`` was 0 or the download failed)."""
    bytes: int = 0
    seconds: float = 0.0
    """Wall time of the download, request to last byte."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class MeasureReply:
    """Answer of ``POST /v1/probe/measure``: one result per target, in request order."""

    node: str
    region: str
    role: str
    results: tuple[TargetResult, ...] = field(default_factory=tuple)
    format: int = PROBE_FORMAT

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "node": self.node, "region": self.region, "role": self.role,
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_json(cls, data: Any) -> MeasureReply:
        try:
            if data.get("format") != PROBE_FORMAT:
                raise CodecError(f"unsupported probe format {data.get('format')!r}")
            names = set(TargetResult.__dataclass_fields__)
            results = tuple(TargetResult(**{k: v for k, v in r.items() if k in names}) for r in data["results"])
            return cls(str(data["node"]), str(data["region"]), str(data["role"]), results)
        except (AttributeError, KeyError, TypeError) as exc:
            raise CodecError(f"malformed measure reply: {exc!r}") from None


def _int(data: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = data.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProbeInputError(key, f"must be an integer, got {v!r:.40}")
    if not lo <= v <= hi:
        raise ProbeInputError(key, f"must be between {lo} and {hi}, got {v}")
    return v


def _bad(message: str, status: int = 400, **headers: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status, headers=headers or None)


# --- client -----------------------------------------------------------------------------------------
class ProbeClient:
    """Calls probe endpoints; build with ``await ProbeClient.create(token)``, close with :meth:`close`.

    Failures to get a usable answer raise :class:`PeerUnreachable` naming the peer. Timeouts and the
    slowest download accepted come from ``settings`` (``connect_timeout``, ``stall_timeout``,
    ``min_rate_bps``).
    """

    def __init__(self, session: aiohttp.ClientSession, settings: ProbeSettings = _DEFAULTS) -> None:
        self._session = session
        self.settings = settings

    @classmethod
    async def create(cls, token: str, connections: int = 64, settings: ProbeSettings = _DEFAULTS,
                     tls: Tls | None = None) -> ProbeClient:
        """``tls``: present that certificate and accept only servers of the cluster CA (None: plain HTTP)."""
        # No NODE_HEADER: a prober must not show up in the target's list of children.
        conn = connector(tls, limit=connections, limit_per_host=2, enable_cleanup_closed=True)
        session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}, connector=conn,
                                        auto_decompress=False)
        return cls(session, settings)

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> ProbeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        s = self.settings
        return aiohttp.ClientTimeout(total=total, sock_connect=s.connect_timeout, sock_read=s.stall_timeout)

    async def call_json(self, url: str, path: str, timeout: float = 5.0, limit: int = 4 << 20) -> dict[str, Any]:
        """GET ``url + path`` as JSON (e.g. ``/v1/status``)."""
        try:
            async with self._session.get(url + path, timeout=self._timeout(timeout)) as resp:
                body = await read_body(resp.content, limit)
                if resp.status != 200:
                    raise PeerUnreachable(url, f"GET {path}: HTTP {resp.status} {body[:200]!r}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerUnreachable(url, f"GET {path}: {type(exc).__name__}: {exc}") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise PeerUnreachable(url, f"GET {path}: not JSON") from None
        if not isinstance(data, dict):
            raise PeerUnreachable(url, f"GET {path}: not a JSON object")
        return data

    async def call_ping(self, url: str) -> tuple[dict[str, Any], float]:
        """One ping: (the answer, seconds from request to answer)."""
        t0 = time.perf_counter()
        data = await self.call_json(url, f"{PREFIX}/ping",
                                    timeout=self.settings.connect_timeout + self.settings.stall_timeout)
        return data, time.perf_counter() - t0

    async def call_blob(self, url: str, nbytes: int) -> float:
        """Download a blob of ``nbytes``; returns seconds from request to last byte."""
        s = self.settings
        bound = s.connect_timeout + s.stall_timeout + 8 * nbytes / s.min_rate_bps
        t0 = time.perf_counter()
        got = 0
        try:
            async with self._session.get(f"{url}{PREFIX}/blob", params={"bytes": str(nbytes)},
                                         timeout=self._timeout(bound)) as resp:
                if resp.status != 200:
                    body = await resp.content.read(512)
                    raise PeerUnreachable(url, f"GET {PREFIX}/blob: HTTP {resp.status} {body[:200]!r}")
                async for piece in resp.content.iter_any():
                    got += len(piece)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerUnreachable(url, f"GET {PREFIX}/blob: {type(exc).__name__}: {exc}") from None
        if got != nbytes:
            raise PeerUnreachable(url, f"GET {PREFIX}/blob: {got} bytes received, {nbytes} announced")
        return time.perf_counter() - t0

    async def measure_target(self, url: str, nbytes: int, rtt_samples: int) -> TargetResult:
        """RTT and throughput of pulling from ``url`` (see the module doc); errors go into the result."""
        url = url.rstrip("/")
        try:
            info, _ = await self.call_ping(url)  # warm-up: opens the connection
            rtts = [(await self.call_ping(url))[1] for _ in range(rtt_samples)]
            rtt_min, rtt_med = min(rtts), statistics.median(rtts)
            node, region, role = (str(info[k]) if info.get(k) is not None else None
                                  for k in ("node", "region", "role"))
            if nbytes == 0:
                return TargetResult(url, node, region, role, rtt_med, rtt_min)
            seconds = await self.call_blob(url, nbytes)
        except PeerUnreachable as exc:
            return TargetResult(url, error=str(exc))
        transfer = max(seconds - rtt_min, seconds / 2, 1e-9)
        return TargetResult(url, node, region, role, rtt_med, rtt_min, 8 * nbytes / transfer, nbytes, seconds)

    async def call_measure(self, url: str, request: MeasureRequest, timeout: float | None = None) -> MeasureReply:
        """Ask the node at ``url`` to measure ``request.targets``; 409 (busy) raises :class:`PeerUnreachable`."""
        s = self.settings
        if timeout is None:
            # The measuring node's own timeouts bound each target; these are ours, assumed alike.
            per = s.connect_timeout * 2 + s.stall_timeout * (request.rtt_samples + 2) + 8 * request.bytes / s.min_rate_bps
            timeout = per * len(request.targets) + 10
        try:
            async with self._session.post(f"{url}{PREFIX}/measure", json=request.to_json(),
                                          timeout=aiohttp.ClientTimeout(total=timeout,
                                                                        sock_connect=s.connect_timeout)) as resp:
                body = await read_body(resp.content, 4 << 20)
                if resp.status != 200:
                    raise PeerUnreachable(url, f"POST {PREFIX}/measure: HTTP {resp.status} {body[:300]!r}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerUnreachable(url, f"POST {PREFIX}/measure: {type(exc).__name__}: {exc}") from None
        try:
            return MeasureReply.from_json(json.loads(body))
        except (ValueError, CodecError) as exc:
            raise PeerUnreachable(url, f"POST {PREFIX}/measure: {exc}") from None


# --- service ----------------------------------------------------------------------------------------
class ProbeService:
    """The probe endpoints of one node, limited by its ``[probe]`` settings. Contract: see the module doc."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.settings: ProbeSettings = host.config.probe
        self._pool = b""
        self._streams = 0
        self._measuring = asyncio.Lock()
        self._client: ProbeClient | None = None

    def routes(self) -> list[web.RouteDef]:
        return [web.get(f"{PREFIX}/ping", self.rpc_ping),
                web.get(f"{PREFIX}/blob", self.rpc_blob),
                web.post(f"{PREFIX}/measure", self.rpc_measure)]

    async def start(self) -> None:
        self._pool = os.urandom(POOL_BYTES)
        self._client = await ProbeClient.create(self.host.config.token(), connections=2 * self.settings.max_targets,
                                                settings=self.settings, tls=self.host.tls)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def rpc_ping(self, request: web.Request) -> web.Response:
        cfg = self.host.config
        return web.json_response({"format": PROBE_FORMAT, "node": cfg.id, "region": cfg.region, "role": cfg.role})

    async def rpc_blob(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("bytes")
        try:
            n = int(raw) if raw is not None and raw.isascii() and raw.isdigit() else -1
        except ValueError:
            n = -1
        if n < 0:
            return _bad(f"bytes: must be a non-negative integer, got {raw!r:.40}")
        limits = self.settings
        if n > limits.max_blob_bytes:
            return _bad(f"bytes: {n} exceeds the limit of {limits.max_blob_bytes}")
        if self._streams >= limits.max_blob_streams:
            return _bad(f"{limits.max_blob_streams} probe blobs are being served already", 503, **{"Retry-After": "1"})
        self._streams += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                               "Cache-Control": "no-store"})
            resp.content_length = n
            await resp.prepare(request)
            pool, off, left = memoryview(self._pool), 0, n
            idle = self.host.config.limits.idle_timeout
            try:
                while left:
                    k = min(_PIECE, left, len(pool) - off)
                    async with asyncio.timeout(idle):
                        await resp.write(pool[off:off + k])
                    off = (off + k) % len(pool)
                    left -= k
                await resp.write_eof()
            except (ConnectionResetError, TimeoutError):
                if request.transport is not None:
                    request.transport.close()
            self.host.metrics.inc("p2psync_probe_bytes_out_total", n - left)
            return resp
        finally:
            self._streams -= 1

    async def rpc_measure(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
            req = MeasureRequest.from_json(json.loads(body), self.settings)
        except ValueError:
            return _bad("<body>: not valid JSON")
        except ProbeInputError as exc:
            return _bad(str(exc))
        if self._measuring.locked():
            return _bad("a measurement is already running on this node", 409, **{"Retry-After": "1"})
        client = self._client
        if client is None:
            return _bad("probe service is stopping", 503)
        async with self._measuring:
            results = []
            for t in req.targets:
                r = await client.measure_target(t, req.bytes, req.rtt_samples)
                if r.error:
                    logger.warning("probe %s -> %s failed: %s", t, self.host.config.id, r.error)
                results.append(r)
        cfg = self.host.config
        return web.json_response(MeasureReply(cfg.id, cfg.region, cfg.role, tuple(results)).to_json())

