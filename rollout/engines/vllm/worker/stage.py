"""Staging an update while vLLM serves: fetch (and decode) ahead, then a short commit.

``update_weights({"update_info": {"version": v, "stage": true}})`` returns at
once. In a thread of its own, beside vLLM's generation, the backend fetches the
first artifact of its way to ``v`` from its parent, every chunk checked against
the signed manifest, and with one rank also decodes each chunk as it arrives
against the live words (they only read them: nothing but an update writes
weights). The parent need not hold the artifact yet: one that is still
receiving it (a cut-through node lists it) serves each chunk as it arrives, so a
stage sent when the trainer announces a version follows the artifact down the
tree and its decode hides under the transfer. A later ``update_weights`` whose way starts with that artifact commits
what was staged: with one rank it checks the target fingerprint and writes, as
after any decode; with tensor or expert parallelism each rank decodes its staged
chunks then (the ranks' decode runs collectives, which belong on the worker's
own thread, in step with vLLM's), with no fetch. Where the staged artifact alone
leads to the version asked for, the commit asks the parent nothing. A client
that pauses generation around updates (``POST /pause``, ``/resume``) so pauses
for the commit, not the transfer.

What a stage is not:

- **Not a promise.** The commit uses what was staged only if every rank staged
  that artifact without a failure, from the version it still holds; otherwise it
  fetches as if nothing was staged (a stage's failure is logged, and met again,
  or not, by that fetch). Refusals keep their meaning: a bad chunk, a forged
  manifest or a wrong base leaves the weights untouched, at the commit.
- **One artifact.** The next ones of a longer way apply to weights that do not
  exist yet; the commit fetches them. A snapshot is not staged (a whole copy of
  the weights held twice).
- **One at a time.** A new stage, an init (a new parent or key) and a shutdown
  wait for the stage in progress; an init or a shutdown drops what it staged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2psync.transport.leaf import OnChunk, Parent, fetch_manifest
from rollout.engines.vllm.worker.fetch import fetch_decoding, plan_to
from rollout.engines.vllm.apply.slices import chunks_needed
from rollout.engines.vllm.apply.stream import Streamed, streams

Fetching = Callable[..., Any]
"""``fetching(call, retry=False)``: ``await call(client)`` through the backend's kept client."""


@dataclass
class Staged:
    """What one stage got (see module doc)."""

    target: int
    """The version asked for."""
    base: int | None
    """The version the weights held when the stage began."""
    plan: list[str] = field(default_factory=list)
    """The artifacts of the way from ``base`` to ``target`` the parent listed; the first is staged."""
    manifest: Any = None
    chunks: list[Any] | None = None
    """The chunks this rank needs (the others None), each checked against the signed manifest."""
    stream: Streamed | None = None
    """With one rank: the chunks decoded as they arrived."""
    error: BaseException | None = None
    seconds: float = 0.0

    def usable(self, aid: str, version: int | None) -> bool:
        """Whether this stage holds artifact ``aid`` for weights at ``version``."""
        return self.error is None and self.chunks is not None and self.plan[:1] == [aid] and self.base == version


def stage(fetching: Fetching, parent: Parent, live: Any, base: int | None, target: int,
          overlap: bool = True) -> Staged:
    """Fetch (with one rank: and decode) the first artifact of the way from ``base`` to ``target``
    from ``parent`` (``live``: the bound weights). Never raises: a failure is kept in
    :attr:`Staged.error`."""
    t = time.perf_counter()
    out = Staged(target, base)
    try:
        out.plan = [a.id for a in fetching(lambda c: plan_to(parent, base, target, c, in_flight=True), retry=True)]
        if not out.plan:
            return out
        aid = out.plan[0]
        manifest = out.manifest = fetching(lambda c: fetch_manifest(parent, aid, c), retry=True)
        if manifest.kind != "delta" or live is None or live.specs != list(manifest.tensors):
            return out  # a snapshot, or a table the weights are not bound to (bound at the commit)
        # one rank decodes as chunks arrive (Streamed checks the base fingerprint first); several ranks
        # decode at the commit, where their collectives run
        stream = Streamed(live, manifest) if overlap and live.group.size == 1 and streams(live, manifest) else None
        out.chunks = fetch_decoding(fetching, parent, aid, manifest, chunks_needed(live, manifest), stream)
        out.stream = stream
    except BaseException as exc:  # noqa: BLE001 - kept for the commit, which decides
        out.error = exc
    finally:
        out.seconds = time.perf_counter() - t
    return out


def replay(chunks: list[Any]) -> Callable[[OnChunk], Any]:
    """A source for :func:`~rollout.engines.vllm.apply.stream.decoding` that hands it staged chunks."""
    async def source(on_chunk: OnChunk) -> tuple[None, list[Any]]:
        for i, c in enumerate(chunks):
            if c is not None:
                await on_chunk(i, c)
        return None, chunks
    return source


class Stager:
    """At most one stage at a time, run in a daemon thread (see module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._target: int | None = None
        self._result: Staged | None = None

    def start(self, target: int, work: Callable[[], Staged]) -> None:
        """Run ``work`` for ``target`` after the stage in progress; nothing if ``target`` is being staged
        or was staged without a failure."""
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            kept = self._result is not None and self._result.error is None
            if self._target == target and (running or kept):
                return  # staging it, or staged: a failed stage is tried again
        self.take()

        def run() -> None:
            got = work()
            with self._lock:
                self._result = got

        thread = threading.Thread(target=run, name="p2psync-stage", daemon=True)
        with self._lock:
            self._thread, self._target, self._result = thread, target, None
        thread.start()

    def take(self) -> Staged | None:
        """Wait for the stage in progress; what the last stage got (then forgotten), or None."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            got, self._thread, self._target, self._result = self._result, None, None, None
        return got

    def state(self) -> dict[str, Any] | None:
        """``{"version", "done"}`` of the stage in progress or kept, or None."""
        with self._lock:
            if self._thread is None:
                return None
            return {"version": self._target, "done": not self._thread.is_alive()}
