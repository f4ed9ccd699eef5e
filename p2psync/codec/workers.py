"""Running a list of compiled, GIL-releasing work items on a few threads.

Decoding a delta (one item per segment) and writing it (one per segment's changes) each take
tens of milliseconds on two threads. With a :class:`~concurrent.futures.ThreadPoolExecutor`
per call, the second thread began its first item 0.1-3.5 ms after the first one, in decode and
again in the commit (timelines of the benchmark delta: BENCHMARKS.md, "Decode+apply on two
threads"), while the calling thread only submitted items (a future, a lock and a condition per
item), waited and woke up on every result. :func:`run_ordered` starts ``threads - 1`` helpers,
works on the calling thread as well, and hands out items from one shared list.

The helpers are started with ``_thread.start_new_thread``, which does not wait for the new
thread to run, as ``threading.Thread.start`` does: the calling thread starts its first item at
once instead of sleeping until the helper ran and then waiting to be scheduled again. Measured
on the benchmark delta, both threads then began within 0.2 ms, in decode and in the commit.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def run_ordered(n: int, order: Sequence[int], work: Callable[[int], T], threads: int
                ) -> tuple[list[T | None], int, BaseException | None]:
    """Run ``work(i)`` for each ``i`` in ``order`` (a permutation of ``range(n)``) on the calling
    thread and ``threads - 1`` helper threads, each taking the next item.

    Returns ``(results, f, error)``: ``results[i]`` is what ``work(i)`` returned, ``f`` the
    smallest index whose item raised (``n`` if none did) and ``error`` what it raised. Once an
    item failed, items with a larger index that have not started are skipped (their result
    could not be used), and those with a smaller index still run, so ``f`` and ``error`` are
    those of running the items one after the other in index order and stopping at the first
    failure, whatever thread ran what.
    """
    results: list[T | None] = [None] * n
    errors: dict[int, BaseException] = {}
    failed = [n]
    lock = threading.Lock()
    items = iter(order)

    def worker() -> None:
        while True:
            with lock:
                i = next(items, None)
                if i is not None and i > failed[0]:
                    continue
            if i is None:
                return
            try:
                results[i] = work(i)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                with lock:
                    errors[i] = exc
                    failed[0] = min(failed[0], i)

    helpers = max(0, threads - 1)
    finished = threading.Semaphore(0)

    def helper() -> None:
        try:
            worker()
        finally:
            finished.release()

    for _ in range(helpers):
        _thread.start_new_thread(helper, ())
    try:
        worker()
    finally:
        for _ in range(helpers):
            finished.acquire()
    return results, failed[0], errors.get(failed[0])
