"""Fetching one artifact's chunks from the current parent, several streams at once, with failover.

Contract: a chunk reaches ``on_chunk`` (and the board, so children may get it)
only after :meth:`VersionStore.put_chunk` verified it against the signed
manifest and stored it. A peer whose chunk fails verification is reported
(log line, ``p2psync_bad_chunks_total{peer}``) and avoided; a peer that errors
or stalls rests and the next candidate takes over; chunks already held stay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from p2psync.artifact import Manifest
from p2psync.errors import ChunkHashMismatch, PeerRefused, PeerUnreachable
from p2psync.store import VersionStore
from p2psync.transport.board import Board
from p2psync.transport.client import ChunkBuffer, NotHeld, PeerClient
from p2psync.transport.metrics import Metrics
from p2psync.transport.parents import ParentSet
from p2psync.transport.refusals import RefusalLog

logger = logging.getLogger(__name__)


class Upstream:
    """The parents a node pulls from and what happens when one misbehaves."""

    def __init__(self, client: PeerClient, parents: ParentSet, metrics: Metrics,
                 on_change: Callable[[], None], log: logging.LoggerAdapter | logging.Logger = logger) -> None:
        self.client = client
        self.parents = parents
        self.metrics = metrics
        self.on_change = on_change
        self.log = log
        self.refusals = RefusalLog()

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def pick(self) -> str:
        """The parent to ask now, after waiting out a period when every candidate rests."""
        wait = self.parents.wait_time(self.now())
        if wait > 0:
            await asyncio.sleep(wait)
        before = self.parents.switches
        url = self.parents.current(self.now())
        if self.parents.switches != before:
            self.metrics.inc("p2psync_parent_switches_total")
            self.log.info("parent is now %s", url)
        return url

    def failed(self, url: str, exc: Exception) -> None:
        self.metrics.inc("p2psync_parent_failures_total", parent=url)
        if isinstance(exc, PeerRefused):
            # Retrying at once does not help: rest the parent as long as a failure ever does, and
            # say why once (then once per RefusalLog.every), not at every retry.
            self.parents.refused(url, self.now())
            self.metrics.inc("p2psync_parent_refusals_total", parent=url, cause=type(exc).__name__)
            unlogged = self.refusals.due(exc, self.now())
            if unlogged is not None:
                more = f" ({unlogged} more since the last report)" if unlogged else ""
                self.log.error("%s%s", exc, more)
        else:
            self.parents.failed(url, self.now())
            self.log.warning("parent %s failed: %s", url, exc)
        self.on_change()

    def corrupt(self, url: str, what: str) -> None:
        self.metrics.inc("p2psync_bad_chunks_total", peer=url)
        self.parents.corrupt(url, self.now())
        self.log.error("peer %s served %s; dropped it and avoiding that peer", url, what)
        self.on_change()

    def ok(self, url: str) -> None:
        self.parents.ok(url)

    @property
    def attempts(self) -> int:
        """Failed tries in a row after which a request gives up (the caller re-plans)."""
        return 3 * len(self.parents.candidates) + 2

    async def manifest(self, aid: str, verify: Callable[[Manifest], None]) -> Manifest:
        """Manifest ``aid`` from the first parent that serves one passing ``verify``."""
        last: Exception | None = None
        for _ in range(self.attempts):
            url = await self.pick()
            try:
                m = await self.client.call_manifest(url, aid)
            except PeerUnreachable as exc:
                self.failed(url, exc)
                last = exc
                continue
            try:
                verify(m)
                if m.artifact_id != aid:
                    raise ValueError(f"asked for {aid}, got {m.artifact_id}")
            except Exception as exc:  # noqa: BLE001 - any failure here means the peer lied
                self.corrupt(url, f"a manifest that does not verify ({exc})")
                last = exc
                continue
            self.ok(url)
            return m
        raise PeerUnreachable("all parents", f"manifest {aid}: {last}")


class Pipeline:
    """Runs ``fn(index, data)`` on verified chunks in worker threads, so that the stream that
    fetched a chunk goes on to the next one meanwhile (decoding overlaps the download).

    At most ``depth`` calls are queued or running; :meth:`submit` waits for a free slot (so
    memory stays bounded and a slow consumer slows the download down). The first call that
    fails is raised by the next :meth:`submit` or by :meth:`drain`.
    """

    def __init__(self, fn: Callable[[int, bytes | memoryview], object], depth: int, executor: Any = None) -> None:
        self._fn = fn
        self._executor = executor
        self._slots = asyncio.Semaphore(max(1, depth))
        self._pending: set[asyncio.Future] = set()
        self._error: BaseException | None = None

    async def submit(self, index: int, data: bytes | memoryview) -> None:
        self._raise()
        await self._slots.acquire()
        fut = asyncio.get_running_loop().run_in_executor(self._executor, self._fn, index, data)
        self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future) -> None:
        self._pending.discard(fut)
        self._slots.release()
        if not fut.cancelled() and fut.exception() is not None and self._error is None:
            self._error = fut.exception()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    async def drain(self) -> None:
        """Wait for every call submitted; raise the first failure."""
        while self._pending:
            await asyncio.wait(set(self._pending))
        self._raise()


async def fetch_chunks(up: Upstream, store: VersionStore, board: Board, manifest: Manifest, streams: int,
                       on_chunk: Callable[[int, memoryview], Awaitable[None]]) -> None:
    """Fetch every chunk of ``manifest`` not yet in ``store``; ``streams`` at a time."""
    aid = manifest.artifact_id
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(manifest.chunks)):
        if not store.has_chunk(aid, i):
            todo.put_nowait(i)
    partial: dict[int, ChunkBuffer] = {}

    async def one(i: int) -> None:
        size = manifest.chunks[i].size
        misses = 0
        lacking: set[str] = set()
        while True:
            url = await up.pick()
            buf = partial.get(i)
            if buf is None:
                buf = partial[i] = ChunkBuffer(size)
            try:
                await up.client.call_chunk(url, aid, i, buf)
            except PeerUnreachable as exc:
                misses += 1
                up.failed(url, exc)
                if isinstance(exc, NotHeld):
                    lacking.add(url)
                if misses >= up.attempts or lacking >= set(up.parents.candidates):
                    # Nobody has it (e.g. retention dropped it upstream): the caller re-plans.
                    raise PeerUnreachable("all parents", f"chunk {i} of {aid}: {exc.reason}") from None
                continue
            # Nothing else holds the buffer now; a read-only view of it is stored, served and decoded.
            data = partial.pop(i).take()
            try:
                await asyncio.to_thread(store.put_chunk, aid, i, data)
            except ChunkHashMismatch as exc:
                misses += 1
                up.corrupt(url, f"corrupt chunk {i} of {aid} ({exc.actual} != {exc.expected})")
                if misses >= up.attempts:
                    raise
                continue
            up.ok(url)
            up.metrics.inc("p2psync_bytes_in_total", size)
            up.metrics.inc("p2psync_chunks_in_total")
            board.arrived(aid, i)
            await on_chunk(i, data)
            return

    async def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            await one(i)

    try:
        async with asyncio.TaskGroup() as tg:
            for k in range(min(streams, max(1, todo.qsize()))):
                tg.create_task(worker(), name=f"fetch:{aid}:{k}")
    except BaseExceptionGroup as group:
        # One stream gave up (the others were cancelled): surface its error, not the group.
        raise group.exceptions[0] from None
