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
from typing import TYPE_CHECKING

import aiohttp
import numpy as np

from p2psync.artifact import Manifest
from p2psync.errors import CodecError, PeerUnreachable, WrongSize
from p2psync.transport.messages import API, NODE_HEADER, Catalogue
from p2psync.transport.refusals import from_exception, from_response
from p2psync.transport.tls import Tls, connector

if TYPE_CHECKING:
    from p2psync.codec.slabs import Arena

_MAX_CATALOGUE = 16 << 20


class NotHeld(PeerUnreachable):
    """The peer answered 404: it does not hold (any more) what was asked for."""


class NotYet(PeerUnreachable):
    """The peer answered 503: what was asked for is on its way to it (a cut-through node waited
    ``chunk_wait_timeout`` for the chunk) or failed a re-check there; ask again shortly."""


class ChunkBuffer:
    """One chunk on its way in: a buffer of the chunk's exact size and how much of it arrived.

    Received pieces are copied once, straight into place (no growing buffer, no join); after a
    failure :attr:`got` says where the next attempt, from any peer, resumes (``Range``).
    """

    __slots__ = ("buf", "got")

    def __init__(self, size: int, arena: Arena | None = None) -> None:
        # Uninitialised (every byte is written before it is read): zero-filling a fresh buffer
        # per chunk costs as much as the copy into it. ``arena``: cut from it instead of allocated
        # (a rollout engine's update: :func:`rollout.engines.vllm.worker.fetch.fetch_artifact`).
        raw = np.empty(size, dtype=np.uint8) if arena is None else arena.array(size, np.uint8)
        self.buf = memoryview(raw).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
        self.got = 0

    @property
    def size(self) -> int:
        return len(self.buf)

    def take(self) -> memoryview:
        """The complete chunk as a read-only view (nothing else may hold the buffer afterwards)."""
        assert self.got == len(self.buf)
        return self.buf.toreadonly()


def _status_error(url: str, what: str, status: int) -> PeerUnreachable:
    kind = NotHeld if status == 404 else NotYet if status == 503 else PeerUnreachable
    return kind(url, f"{what}: HTTP {status}")


async def read_body(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body, read to its end or to ``limit + 1`` bytes (the caller refuses more than
    ``limit``): ``content.read(n)`` gives what has arrived so far (one TLS record, say), not
    the whole body."""
    body = bytearray()
    while len(body) <= limit:
        part = await content.read(limit + 1 - len(body))
        if not part:
            break
        body += part
    return bytes(body)


class PeerClient:
    """One connection pool for all parents; build with ``await PeerClient.create(...)``."""

    def __init__(self, session: aiohttp.ClientSession, stall_timeout: float, sse_timeout: float) -> None:
        self._session = session
        self.stall_timeout = stall_timeout
        self.sse_timeout = sse_timeout

    @classmethod
    async def create(cls, token: str, node_id: str, *, stall_timeout: float, sse_keepalive: float,
                     parallel_streams: int, tls: Tls | None = None) -> PeerClient:
        """``tls``: present that certificate and accept only servers of the cluster CA (None: plain HTTP)."""
        headers = {"Authorization": f"Bearer {token}", NODE_HEADER: node_id}
        conn = connector(tls, limit_per_host=parallel_streams + 4, enable_cleanup_closed=True)
        session = aiohttp.ClientSession(headers=headers, connector=conn, auto_decompress=False)
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
                    raise await from_response(url, f"GET {path}", resp) or _status_error(url, f"GET {path}", resp.status)
                if resp.content_length is not None and resp.content_length > limit:
                    raise PeerUnreachable(url, f"GET {path}: {resp.content_length} bytes exceeds {limit}")
                return await read_body(resp.content, limit)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise from_exception(url, f"GET {path}", exc) from None

    async def connect(self, url: str, n: int) -> None:
        """Have at least ``n`` connections to ``url`` open in the pool (``n`` requests for its catalogue at
        once), so that ``n`` fetches in parallel start without connecting. Failures are left to them."""
        await asyncio.gather(*(self.call_head(url) for _ in range(n)), return_exceptions=True)

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

    async def call_chunk(self, url: str, aid: str, index: int, into: ChunkBuffer) -> None:
        """Receive the rest of chunk ``index`` into ``into`` (resuming with ``Range`` after ``into.got``).

        On failure ``into`` keeps what arrived, so the next attempt (from any peer) resumes there.
        A peer that announces or sends more bytes than the chunk has is cut off before they are read.
        """
        size = into.size
        start = into.got
        headers = {"Range": f"bytes={start}-"} if start else {}
        path = f"{API}/artifacts/{aid}/chunks/{index}"
        what = f"chunk {index} of {aid}"
        try:
            async with self._session.get(url + path, headers=headers, timeout=self._timeout()) as resp:
                if resp.status not in (200, 206) or (start and resp.status != 206):
                    raise await from_response(url, what, resp) or _status_error(url, what, resp.status)
                if resp.content_length is not None and resp.content_length != size - start:
                    raise WrongSize(url, what, resp.content_length, size - start, announced=True)
                view = into.buf
                content = resp.content
                while into.got < size:
                    # One piece as the parser produced it (readchunk does not join pieces).
                    piece, _ = await content.readchunk()
                    if not piece:
                        break
                    end = into.got + len(piece)
                    if end > size:
                        raise PeerUnreachable(url, f"{what}: more than the {size} bytes expected")
                    view[into.got:end] = piece
                    into.got = end
                if into.got != size or not content.at_eof() and (await content.readchunk())[0]:
                    raise WrongSize(url, what, into.got, size)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise from_exception(url, what, exc) from None

    async def call_events(self, url: str) -> AsyncIterator[Catalogue]:
        """Catalogues pushed by the peer: one at once, then one per change (server-sent events)."""
        try:
            async with self._session.get(url + f"{API}/events", timeout=self._timeout(self.sse_timeout)) as resp:
                if resp.status != 200:
                    raise await from_response(url, "events", resp) or PeerUnreachable(url, f"events: HTTP {resp.status}")
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
            raise from_exception(url, "events", exc) from None


async def cancel_quietly(task: asyncio.Task | None) -> None:
    """Cancel a task we own and wait for it, without swallowing our own cancellation."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
