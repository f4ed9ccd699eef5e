"""Getting a node process ready to apply at full speed, without delaying its start or its exit.

The first decode in a process pays for ``import torch`` and for numba loading its
cached kernels: 2-3 s on the project VM, measured in the gap between a node's last
chunk and its commit (docs/BENCHMARKS.md, "Data plane"). :func:`warm_up_process`
does that work once, in the background, as soon as a node starts, then
collects and freezes the garbage collector's view of everything imported so far
(:func:`gc.freeze`): the hundreds of thousands of long-lived objects of torch
and numba are then no longer rescanned by every full collection while the node
runs, nor by the interpreter's final collection on exit, which otherwise takes
1-3 s after ``SIGTERM``.

The freeze is for relay and rollout nodes only (``freeze_gc``). A trainer node lives
in the training process (:class:`~trainer.background.BackgroundNode`, or a trainer
job beside ``p2psync node``): that process is the user's, its objects churn every
step, and a frozen heap is never collected at exit, so extension modules that
check their objects at teardown report them as leaked (triton, which torch
imports with its optimizers, prints ``nanobind: leaked ...`` lines).

It runs in a daemon thread, not the event loop's executor: asyncio waits for
executor threads when the loop closes, so a node stopped while it is still
warming up would exit only after the warm-up finished.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

_frozen = False
_freeze_lock = threading.Lock()


def _warm_and_freeze(freeze_gc: bool) -> None:
    global _frozen
    from p2psync.codec import precompile

    precompile.warm()
    if not freeze_gc:
        return
    with _freeze_lock:
        if not _frozen:
            # Once per process: objects alive now (imports, caches) are never garbage.
            gc.collect()
            gc.freeze()
            _frozen = True


async def in_daemon_thread(fn: Callable[[], Any], name: str) -> Any:
    """Run ``fn`` in a daemon thread and await its result (or exception).

    Unlike :func:`asyncio.to_thread`, the process may exit while ``fn`` still runs; only
    for work whose result nothing depends on for correctness.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            result, ok = fn(), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, ok = exc, False
        try:
            loop.call_soon_threadsafe(deliver, ok, result)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody waits any more

    threading.Thread(target=run, name=name, daemon=True).start()
    return await fut


async def warm_up_process(freeze_gc: bool = True) -> float:
    """Warm the codec and, if ``freeze_gc``, freeze the GC (see module doc); seconds taken.
    Raises what the warm-up raised."""
    t0 = time.monotonic()
    await in_daemon_thread(lambda: _warm_and_freeze(freeze_gc), "p2psync-warm-up")
    return time.monotonic() - t0
