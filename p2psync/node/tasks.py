"""The tasks a node owns: each named, a crash stops the node, all cancelled on close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from p2psync.transport.client import cancel_quietly

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
"""Starts a task the node owns: ``spawn(coro, name)``."""


class Tasks:
    """Owner of a node's long-running tasks. Contract: a task that raises sets :attr:`failure`
    and :attr:`stop`; :meth:`cancel_all` cancels every task and waits for each to end."""

    def __init__(self, owner: str, log: Any) -> None:
        self._owner = owner
        self._log = log
        self._tasks: list[asyncio.Task] = []
        self.stop = asyncio.Event()
        """Set when a task crashed or the node began to close."""
        self.failure: BaseException | None = None

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"{self._owner}:{name}")
        task.add_done_callback(self._done)
        self._tasks.append(task)

    def _done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        self._log.error("task %s crashed: %r; stopping", task.get_name(), self.failure, exc_info=self.failure)
        self.stop.set()

    async def cancel_all(self) -> None:
        for t in self._tasks:
            await cancel_quietly(t)
