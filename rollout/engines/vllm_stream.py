"""Decoding a delta's chunks as they arrive: one rank's fetch and decode overlapped.

A rank alone does not wait for its last chunk to start decoding: the fetch hands
each chunk to the decode the moment its hash matched the signed manifest
(:func:`rollout.engines.vllm_fetch.fetch_artifact`'s ``on_chunk``), and worker
threads decode its segments against the live words (reading only) while later
chunks are still on the wire, through the node's own
:class:`~p2psync.transport.fetch.Pipeline` (bounded: at most a few chunks
queued or decoding, so a slow decode slows the fetch rather than piling up
work). What a chunk decodes to is kept aside; :meth:`Streamed.finish` checks
that every chunk the rank needs arrived and gives the changes and the sums
they lead to, and :meth:`~rollout.engines.vllm_weights.LiveWeights.apply_delta`
checks the target fingerprint and commits (with undo) exactly as after a
sequential decode. A chunk is decoded only after its hash was checked; any
failure (a hash mismatch, a truncated or cut answer, a segment that does not
decode) waits for the decodes in flight and is raised with nothing written.

Only a rank alone (tensor parallel size 1) decodes this way: with several ranks,
a range some rank holds in part is rebuilt by a collective in one order on
every rank, after every rank checked its chunks; those ranks keep the
sequential path (:func:`rollout.engines.vllm_slices.decode`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from p2psync.codec.decode import split_chunk
from p2psync.errors import CodecError, WrongBase
from p2psync.transport.fetch import Pipeline
from p2psync.workers import pin
from rollout.engines.vllm_slices import LiveWeights, _assembled, _chunk_heads, plan

if TYPE_CHECKING:
    from p2psync.artifact import Manifest

T = TypeVar("T")
OnChunk = Callable[[int, memoryview], Awaitable[None]]


def streams(live: LiveWeights, manifest: Manifest) -> bool:
    """Whether ``manifest`` can be decoded chunk by chunk on this rank: a delta with a signed
    segment index (each chunk checked against it alone), applied by a rank alone."""
    return manifest.kind == "delta" and bool(manifest.segments) and live.group.size == 1


class Streamed:
    """A delta decoded chunk by chunk against ``live`` (see module doc). Checks the table, the kind
    and the base fingerprint at once, before any chunk is fetched."""

    def __init__(self, live: LiveWeights, manifest: Manifest) -> None:
        live._check(manifest)
        if not streams(live, manifest):
            raise CodecError("only a delta with a segment index, on one rank, is decoded as it arrives")
        if live.fingerprint != manifest.base_fingerprint:
            raise WrongBase(str(manifest.base_fingerprint), live.fingerprint, manifest.base_version)
        self.live, self.manifest = live, manifest
        self.index = manifest.segments
        self.refs = plan(live, self.index)
        self.first = np.cumsum([0] + [len(e) // 3 for e in self.index]).tolist()
        self._lock = threading.Lock()
        self._results: dict[int, list[Any]] = {}
        self.order: list[tuple[str, int]] = []
        """``("begin" | "end", chunk)`` of each chunk's decode, in the order they happened."""
        self.busy_s = 0.0
        """Thread-seconds spent decoding chunks."""

    def add(self, i: int, chunk: bytes | memoryview) -> None:
        """Decode chunk ``i`` (its hash already checked against the manifest); thread-safe."""
        if not 0 <= i < len(self.index):
            raise CodecError(f"chunk index {i} out of range (artifact has {len(self.index)})")
        t = time.perf_counter()
        with self._lock:
            if i in self._results:
                raise CodecError(f"chunk {i} given twice")
            self._results[i] = []
            self.order.append(("begin", i))
        heads = _chunk_heads(self.live, self.index, self.refs, self.first, i, split_chunk(chunk))
        out = [self.live._decode_segment(heads[k]) for k in sorted(heads)]
        with self._lock:
            self._results[i] = out
            self.order.append(("end", i))
            self.busy_s += time.perf_counter() - t

    def finish(self) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], list[tuple[int, int]]]:
        """``(changes, sums)`` as :meth:`LiveWeights.decode` gives them, once every chunk this
        rank needs was added (:class:`CodecError` naming the first missing chunk otherwise)."""
        missing = next((r.chunk for r in self.refs if r.need and r.chunk not in self._results), None)
        if missing is not None:
            raise CodecError(f"chunk {missing} holds segments this rank needs and was not given")
        results = [o for i in sorted(self._results) for o in self._results[i]]
        counted = [(o[0], o[4]) for o in results if self.live._counted(o[0])]
        return _assembled(self.live, results, counted)


async def decoding(stream: Streamed, source: Callable[[OnChunk], Awaitable[T]], threads: int,
                   cpus: set[int] | None = None) -> T:
    """``await source(on_chunk)`` (a fetch that calls ``on_chunk(i, data)`` with each chunk once
    its hash matched), each chunk decoded into ``stream`` on ``threads`` worker threads as it
    arrives. Returns once every decode ended; raises the fetch's failure, else the first decode's
    (with every decode in flight ended first)."""
    init: Any = (lambda: pin(cpus)) if cpus else None
    with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="p2psync-decode",
                                               initializer=init) as pool:
        pipe = Pipeline(stream.add, max(1, threads) + 2, pool)
        try:
            got = await source(pipe.submit)
        except BaseException:
            try:
                await pipe.drain()
            except BaseException:  # noqa: BLE001 - the fetch's failure is the one raised
                pass
            raise
        await pipe.drain()
    return got
