"""Client side of the HTTP API: ``call_<verb>`` against a peer URL.

Every failure to get a usable answer (refused, reset, timed out, non-2xx status,
unparseable body) is raised as :class:`~p2psync.errors.PeerUnreachable` naming
the peer, so that the fetcher has one thing to catch when it moves to the next
parent. Nothing here verifies signatures or hashes: the caller does, before it
stores or serves anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

from p2psync.artifact import Manifest
from p2psync.errors import CodecError, PeerUnreachable
from p2psync.transport.messages import API, NODE_HEADER, Catalogue

_READ_PIECE = 256 << 10
_MAX_CATALOGUE = 16 << 20


class NotHeld(PeerUnreachable):
    """The peer answered 404: it does not hold (any more) what was asked for."""


def _status_error(url: str, what: str, status: int) -> PeerUnreachable:
    return (NotHeld if status == 404 else PeerUnreachable)(url, f"{what}: HTTP {status}")


class PeerClient:
    """One connection pool for all parents; build with ``await PeerClient.create(...)``."""

    def __init__(self, session: aiohttp.ClientSession, stall_timeout: float, sse_timeout: float) -> None:
        self._session = session
        self.stall_timeout = stall_timeout
        self.sse_timeout = sse_timeout

    @classmethod
    async def create(cls, token: str, node_id: str, *, stall_timeout: float, sse_keepalive: float,
                     parallel_streams: int) -> PeerClient:
        headers = {"Authorization": f"Bearer {token}", NODE_HEADER: node_id}
        connector = aiohttp.TCPConnector(limit_per_host=parallel_streams + 4, enable_cleanup_closed=True)
        session = aiohttp.ClientSession(headers=headers, connector=connector, auto_decompress=False)
        return cls(session, stall_timeout, max(stall_timeout, 3 * sse_keepalive))

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, read: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, sock_connect=self.stall_timeout,
                                     sock_read=read or self.stall_timeout)

    async def _get(self, url: str, path: str, limit: int) -> bytes:
        try:
            async with self._session.get(url + path, timeout=self._timeout()) as resp:
                if resp.status != 200:
                    raise _status_error(url, f"GET {path}", resp.status)
                if resp.content_length is not None and resp.content_length > limit:
                    raise PeerUnreachable(url, f"GET {path}: {resp.content_length} bytes exceeds {limit}")
                return await resp.content.read(limit + 1)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerUnreachable(url, f"GET {path}: {type(exc).__name__}: {exc}") from None

    async def call_head(self, url: str) -> Catalogue:
        body = await self._get(url, f"{API}/head", _MAX_CATALOGUE)
        try:
            return Catalogue.loads(body)
        except CodecError as exc:
            raise PeerUnreachable(url, str(exc)) from None

    async def call_manifest(self, url: str, aid: str) -> Manifest:
        """The manifest of ``aid`` as the peer serves it (structure checked, signature not)."""
        body = await self._get(url, f"{API}/artifacts/{aid}/manifest", 80 << 20)
        try:
            return Manifest.from_bytes(body)
        except CodecError as exc:
            raise PeerUnreachable(url, f"manifest of {aid}: {exc}") from None

    async def call_version_manifest(self, url: str, version: int, kind: str) -> Manifest:
        """The ``kind`` manifest reaching ``version`` (structure checked, signature not)."""
        body = await self._get(url, f"{API}/versions/{version}/manifest?kind={kind}", 80 << 20)
        try:
            return Manifest.from_bytes(body)
        except CodecError as exc:
            raise PeerUnreachable(url, f"{kind} manifest of version {version}: {exc}") from None

    async def call_chunk(self, url: str, aid: str, index: int, size: int, buf: bytearray) -> None:
        """Append the rest of chunk ``index`` to ``buf`` (resuming with ``Range`` after ``len(buf)``).

        On failure ``buf`` keeps what arrived, so the next attempt (from any peer) resumes there.
        """
        headers = {"Range": f"bytes={len(buf)}-"} if buf else {}
        path = f"{API}/artifacts/{aid}/chunks/{index}"
        try:
            async with self._session.get(url + path, headers=headers, timeout=self._timeout()) as resp:
                if resp.status not in (200, 206) or (buf and resp.status != 206):
                    raise _status_error(url, f"chunk {index} of {aid}", resp.status)
                while len(buf) < size:
                    piece = await resp.content.read(min(_READ_PIECE, size - len(buf)))
                    if not piece:
                        break
                    buf += piece
                if len(buf) != size or not resp.content.at_eof() and await resp.content.read(1):
                    raise PeerUnreachable(url, f"chunk {index} of {aid}: {len(buf)} bytes, expected {size}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerUnreachable(url, f"chunk {index} of {aid}: {type(exc).__name__}: {exc}") from None

    async def call_events(self, url: str) -> AsyncIterator[Catalogue]:
        """Catalogues pushed by the peer: one at once, then one per change (server-sent events)."""
        try:
            async with self._session.get(url + f"{API}/events", timeout=self._timeout(self.sse_timeout)) as resp:
                if resp.status != 200:
                    raise PeerUnreachable(url, f"events: HTTP {resp.status}")
                event, data = "", []
                while True:
                    line = await resp.content.readline()
                    if not line:
                        raise PeerUnreachable(url, "event stream closed")
                    text = line.decode("utf-8", "replace").rstrip("\r\n")
                    if text.startswith(":"):
                        continue
                    if text:
                        name, _, value = text.partition(":")
                        if name == "event":
                            event = value.strip()
                        elif name == "data":
                            data.append(value.removeprefix(" "))
                        continue
                    if event == "head" and data:
                        try:
                            yield Catalogue.loads("\n".join(data))
                        except CodecError as exc:
                            raise PeerUnreachable(url, f"event: {exc}") from None
                    event, data = "", []
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise PeerUnreachable(url, f"events: {type(exc).__name__}: {exc}") from None


async def cancel_quietly(task: asyncio.Task | None) -> None:
    """Cancel a task we own and wait for it, without swallowing our own cancellation."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if asyncio.current_task() is not None and asyncio.current_task().cancelling():
            raise
