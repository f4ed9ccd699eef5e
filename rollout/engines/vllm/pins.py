"""Which adapter versions a staleness window keeps: the newest ``window``, plus every pinned one.

A version with requests in flight is *pinned*: it stays loaded (and named, on ``vllm serve``)
whatever the window says, until its last request finishes; then it leaves if the window has moved
past it. Pinned versions take no place in the window: with window 2 and versions 3..5 loaded while a
request still runs on 3, versions 4 and 5 are the window and 3 stays beside them until that request
ends. Without the pin, vLLM would look for the version again mid-request (its own LRU evicts
adapters) and find nothing: the request, and on ``vllm serve`` the engine, would fail.

Pure bookkeeping, shared by the offline :class:`~rollout.engines.vllm.lora.AdapterSlots` and the
API server's :mod:`~rollout.engines.vllm.served_adapters`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


def kept(versions: Iterable[int], window: int, pinned: Iterable[int] = ()) -> list[int]:
    """The versions of ``versions`` a window of ``window`` keeps: the newest ``window`` of them and
    every one in ``pinned``, oldest first."""
    have = sorted(set(versions))
    keep = set(have[-window:]) | (set(pinned) & set(have))
    return [v for v in have if v in keep]


class Pins:
    """Requests in flight per ``(adapter, version)`` (thread-safe).

    Contract: :meth:`finish` answers True exactly once per version, for the request that leaves it
    with none in flight; finishing a request that never started is a ``ValueError`` and changes
    nothing."""

    def __init__(self) -> None:
        self._n: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def start(self, adapter: str, version: int) -> None:
        with self._lock:
            self._n[adapter, version] = self._n.get((adapter, version), 0) + 1

    def finish(self, adapter: str, version: int) -> bool:
        """One request on ``version`` of ``adapter`` ended; True when it was the last in flight."""
        with self._lock:
            n = self._n.get((adapter, version), 0)
            if n < 1:
                raise ValueError(f"no request in flight on {adapter} version {version}")
            if n == 1:
                del self._n[adapter, version]
                return True
            self._n[adapter, version] = n - 1
            return False

    def count(self, adapter: str, version: int) -> int:
        with self._lock:
            return self._n.get((adapter, version), 0)

    def pinned(self, adapter: str) -> set[int]:
        """Versions of ``adapter`` with requests in flight."""
        with self._lock:
            return {v for (a, v) in self._n if a == adapter}
