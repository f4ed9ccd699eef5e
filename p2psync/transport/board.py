"""Artifacts in flight, so that a relay can serve chunk i the moment it is verified (cut-through)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class _Flight:
    n_chunks: int
    events: dict[int, asyncio.Event] = field(default_factory=dict)


class Board:
    """Which artifacts are being fetched, and a way to wait for one of their chunks.

    Contract: :meth:`arrived` is called only after the chunk was verified and stored, so
    a waiter woken by it can read the chunk from the store.
    """

    def __init__(self) -> None:
        self._flights: dict[str, _Flight] = {}
        self._streams: dict[str, int] = {}  # child node id -> its open event or push streams
        self._pushing: dict[str, int] = {}
        self._pushed = asyncio.Event()

    @property
    def children(self) -> int:
        """Nodes following this one now (an open event or push stream; a child that re-opens its
        stream counts once while the server has yet to notice that the old one closed)."""
        return len(self._streams)

    @contextmanager
    def following(self, child: str) -> Iterator[None]:
        """Count ``child`` (a node id) as following this node while its stream is open."""
        self._streams[child] = self._streams.get(child, 0) + 1
        try:
            yield
        finally:
            left = self._streams.pop(child) - 1
            if left:
                self._streams[child] = left

    @contextmanager
    def pushing(self, aid: str) -> Iterator[None]:
        """Count a push of ``aid`` down a child's stream while it runs."""
        self._pushing[aid] = self._pushing.get(aid, 0) + 1
        try:
            yield
        finally:
            left = self._pushing.pop(aid) - 1
            if left:
                self._pushing[aid] = left
            ev, self._pushed = self._pushed, asyncio.Event()
            ev.set()

    async def forwarded(self, aid: str, timeout: float) -> bool:
        """Wait until no push of ``aid`` to a child is still writing; False after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._pushing.get(aid):
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await self._pushed.wait()
            except TimeoutError:
                return False
        return True

    def begin(self, aid: str, n_chunks: int) -> None:
        self._flights.setdefault(aid, _Flight(n_chunks))

    def active(self, aid: str) -> bool:
        return aid in self._flights

    @property
    def ids(self) -> list[str]:
        return list(self._flights)

    def arrived(self, aid: str, index: int) -> None:
        f = self._flights.get(aid)
        if f is not None:
            f.events.setdefault(index, asyncio.Event()).set()

    def end(self, aid: str) -> None:
        """The fetch finished or was abandoned: wake every waiter (they re-check the store)."""
        f = self._flights.pop(aid, None)
        if f is not None:
            for ev in f.events.values():
                ev.set()
            for i in range(f.n_chunks):
                f.events.setdefault(i, asyncio.Event()).set()

    async def wait(self, aid: str, index: int, timeout: float) -> bool:
        """Wait until chunk ``index`` of ``aid`` arrived or its flight ended; False on timeout."""
        f = self._flights.get(aid)
        if f is None:
            return True
        ev = f.events.setdefault(index, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                await ev.wait()
        except TimeoutError:
            return False
        return True
