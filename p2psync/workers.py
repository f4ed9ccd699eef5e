"""Running a list of compiled, GIL-releasing work items on a few threads.

Decoding a delta (one item per segment) and writing it (one per segment's changes) each take
tens of milliseconds on two threads. With a :class:`~concurrent.futures.ThreadPoolExecutor`
per call, the second thread begins its first item 0.1-3.5 ms after the first one, in decode and
again in the commit (timelines of the benchmark delta), while the calling thread only submits
items (a future, a lock and a condition per item), waits and wakes up on every result.
:func:`run_ordered` starts ``threads - 1`` helpers, works on the calling thread as well, and
hands out items from one shared list.

The helpers are started with ``_thread.start_new_thread``, which does not wait for the new
thread to run, as ``threading.Thread.start`` does: the calling thread starts its first item at
once instead of sleeping until the helper ran and then waiting to be scheduled again. On the
benchmark delta both threads begin within 0.2 ms, in decode and in the commit.

Encoding has one more constraint: its segments are packed into chunks in job order, as they
come, and results waiting for an earlier job must stay bounded. :func:`in_order` yields the
results in index order from the same calling-thread-plus-helpers arrangement, with a look-ahead
bounded by the work started past the oldest result not yet handed out (measured in the caller's
units, e.g. elements), so that one long job at the head does not stop the other thread after a
few short jobs, as a look-ahead counted in jobs would (docs/CODEC.md, "Speed").
"""

from __future__ import annotations

import _thread
import concurrent.futures
import os
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TypeVar, cast

T = TypeVar("T")


def run_ordered(n: int, order: Sequence[int], work: Callable[[int], T], threads: int,
                cpus: Collection[int] | None = None) -> tuple[list[T | None], int, BaseException | None]:
    """Run ``work(i)`` for each ``i`` in ``order`` (a permutation of ``range(n)``) on the calling
    thread and ``threads - 1`` helper threads, each taking the next item.

    Returns ``(results, f, error)``: ``results[i]`` is what ``work(i)`` returned, ``f`` the
    smallest index whose item raised (``n`` if none did) and ``error`` what it raised. Once an
    item failed, items with a larger index that have not started are skipped (their result
    could not be used), and those with a smaller index still run, so ``f`` and ``error`` are
    those of running the items one after the other in index order and stopping at the first
    failure, whatever thread ran what.

    ``cpus``: the CPUs the helper threads may run on (Linux; elsewhere, or if refused, they
    inherit the caller's). A thread starts with its creator's CPU affinity: where the caller is
    bound to one core (a vLLM CPU worker binds its OpenMP threads, the calling one included),
    helpers without ``cpus`` would share that core with it. The caller's own affinity is left
    as it is.
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
            if cpus:
                pin(cpus)
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


def pin(cpus: Collection[int]) -> None:
    """Let the calling thread run on ``cpus`` (Linux; elsewhere, or if refused, nothing changes)."""
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread
    except (AttributeError, OSError, ValueError):
        pass


def pool(threads: int, cpus: Collection[int] | None, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of ``threads`` threads named ``name``, each pinned to ``cpus`` if given (:func:`pin`)."""
    init = (lambda: pin(cpus)) if cpus else None
    return concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix=name, initializer=init)


def in_order(work: Callable[[int], T], sizes: Sequence[int], threads: int, window: int) -> Iterator[T]:
    """Yield ``work(0)``, ..., ``work(n - 1)`` (``n = len(sizes)``) in index order, computing them on
    the calling thread and ``threads - 1`` helper threads, items started in index order.

    Item ``i`` starts only while the sizes of the items started and not yet yielded, ``i``
    included, add up to at most ``window`` (the oldest item not yet yielded always may), so at
    most that much finished work waits for an earlier item. Between items, the calling thread
    yields the finished results in order (the consumer then runs on it) before it starts another.

    If ``work(f)`` raises, the results before ``f`` are yielded and then its exception is raised;
    items after ``f`` that have not started are skipped: the error is the one of running the items
    one after the other, whatever thread ran what. Closing the generator early stops the helpers
    after their current item. Helpers have all finished when the generator returns or raises.
    """
    n = len(sizes)
    if threads <= 1 or n <= 1:
        for i in range(n):
            yield work(i)
        return
    cond = threading.Condition(threading.Lock())
    results: list[T | None] = [None] * n
    done = [False] * n
    errors: dict[int, BaseException] = {}
    # next item to start, oldest item not yet yielded, sizes started and not yet yielded, the
    # first failed index (n: none), and whether the consumer went away.
    st = {"next": 0, "head": 0, "held": 0, "failed": n, "stop": False}

    def take() -> int | None:
        """Under ``cond``: the item to start now, -1 if none is left, None if the window is full."""
        i = st["next"]
        if i >= n or i > st["failed"] or st["stop"]:
            return -1
        if i != st["head"] and st["held"] + sizes[i] > window:
            return None
        st["next"] = i + 1
        st["held"] += sizes[i]
        return i

    def run(i: int) -> None:
        try:
            r = work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the generator, in index order
            with cond:
                errors[i] = exc
                st["failed"] = min(st["failed"], i)
                done[i] = True
                cond.notify_all()
            return
        with cond:
            results[i] = r
            done[i] = True
            cond.notify_all()

    helpers = threads - 1
    finished = threading.Semaphore(0)

    def helper() -> None:
        try:
            while True:
                with cond:
                    i = take()
                    while i is None:
                        cond.wait()
                        i = take()
                if i < 0:
                    return
                run(i)
        finally:
            finished.release()

    for _ in range(helpers):
        _thread.start_new_thread(helper, ())
    start: int | None  # the item this thread runs next; None: yield the oldest result first
    try:
        while True:
            with cond:
                h = st["head"]
                if h >= n:
                    break
                if done[h]:
                    if h in errors:
                        raise errors[h]
                    r, results[h] = results[h], None
                    st["head"] = h + 1
                    st["held"] -= sizes[h]
                    cond.notify_all()
                    start = None
                else:
                    start = take()
                    if start is None or start < 0:  # the oldest item runs on a helper: wait for it
                        cond.wait()
                        continue
            if start is None:
                yield cast(T, r)  # done[h]: work(h) returned r
                del r
            else:
                run(start)
    finally:
        with cond:
            st["stop"] = True
            cond.notify_all()
        for _ in range(helpers):
            finished.acquire()
