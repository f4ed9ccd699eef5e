"""Decoding a delta's chunks as they arrive: a rank's fetch and decode overlapped.

A rank does not wait for its last chunk to start decoding: the fetch hands
each chunk to the decode the moment its hash matched the signed manifest
(:func:`rollout.engines.vllm.worker.fetch.decoding`), and worker
threads decode its segments against the live words (reading only) while later
chunks are still on the wire, through the node's own
:class:`~p2psync.transport.fetch.Pipeline` (bounded: at most a few chunks
queued or decoding, so a slow decode slows the fetch rather than piling up
work). What a chunk decodes to is kept aside; :meth:`Streamed.finish` checks
that every chunk the rank needs arrived and gives the changes and the sums
they lead to, and :meth:`~rollout.engines.vllm.apply.weights.LiveWeights.apply_delta`
checks the target fingerprint and commits (with undo) exactly as after a
sequential decode. A chunk is decoded only after its hash was checked; any
failure (a hash mismatch, a truncated or cut answer, a segment that does not
decode) waits for the decodes in flight and is raised with nothing written.

With tensor or expert parallelism the ranks first agree, from the signed index
alone and before any chunk is fetched, on the segments whose ranges some rank
holds in part (:meth:`Streamed.agree`, a collective): those are rebuilt with the
group and decoded in :meth:`Streamed.finish`, after the fetch, in one order on
every rank (:func:`rollout.engines.vllm.apply.slices.decode`'s collectives); every
other segment a rank needs is decoded as its chunk arrives. Each step that can
fail on one rank is voted before the next collective, so the ranks stay in step
and refuse together.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from p2psync.codec.decode import split_chunk
from p2psync.errors import CodecError, WrongBase
from rollout.engines.vllm.apply.slices import LiveWeights, assembled, chunk_heads, decode_gathered, outputs, plan
from rollout.engines.vllm.apply.ranks import RankRefused

if TYPE_CHECKING:
    from p2psync.artifact import Manifest


def streams(live: LiveWeights, manifest: Manifest) -> bool:
    """Whether ``manifest`` can be decoded chunk by chunk: a delta with a signed segment index (each
    chunk checked against it alone, and the ranks' shared ranges known before the fetch)."""
    return manifest.kind == "delta" and bool(manifest.segments)


class Streamed:
    """A delta decoded chunk by chunk against ``live`` (see module doc). Checks the table, the kind
    and the base fingerprint at once, before any chunk is fetched."""

    def __init__(self, live: LiveWeights, manifest: Manifest) -> None:
        live.check_manifest(manifest)
        if not streams(live, manifest):
            raise CodecError("only a delta with a segment index is decoded as it arrives")
        if live.fingerprint != manifest.base_fingerprint:
            raise WrongBase(str(manifest.base_fingerprint), live.fingerprint, manifest.base_version)
        self.live, self.manifest = live, manifest
        self.index = manifest.segments
        self.refs = plan(live, self.index)
        self.first = np.cumsum([0] + [len(e) // 3 for e in self.index]).tolist()
        self._lock = threading.Lock()
        self._results: dict[int, list[Any]] = {}
        self.gathered: set[int] = set()
        """Segments (by place in the index) rebuilt with the group and decoded in :meth:`finish`."""
        self._gheads: dict[int, Any] = {}
        self.order: list[tuple[str, int]] = []
        """``("begin" | "end", chunk)`` of each chunk's decode, in the order they happened."""
        self.busy_s = 0.0
        """Thread-seconds spent decoding chunks."""
        self.out = outputs()

    def agree(self) -> None:
        """With several ranks, agree on the segments rebuilt together (a collective: every rank calls
        it, once every rank built its :class:`Streamed`)."""
        group = self.live.group
        if group.size == 1:
            return
        if not group.all_true(group.first(len(self.refs)) == len(self.refs)):
            raise RankRefused("the tensor-parallel ranks were given different deltas")
        flags = group.sum_u64([1 if r.partial else 0 for r in self.refs])
        self.gathered = {k for k, f in enumerate(flags) if f}

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
        heads = chunk_heads(self.live, self.index, self.refs, self.first, i, split_chunk(chunk))
        out = [self.live.decode_segment(heads[k], out=self.out) for k in sorted(heads) if k not in self.gathered]
        with self._lock:
            self._gheads.update((k, p) for k, p in heads.items() if k in self.gathered)
            self._results[i] = out
            self.order.append(("end", i))
            self.busy_s += time.perf_counter() - t

    def finish(self) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], list[tuple[int, int]]]:
        """``(changes, sums)`` as :meth:`LiveWeights.decode` gives them, once every chunk this
        rank needs was added (:class:`CodecError` naming the first missing chunk otherwise)."""
        live, group = self.live, self.live.group
        missing = next((r.chunk for r in self.refs if r.need and r.chunk not in self._results), None)
        failed = None if missing is None else CodecError(
            f"chunk {missing} holds segments this rank needs and was not given")
        if not group.all_true(failed is None):  # voted before the collectives below
            raise failed or RankRefused("another tensor-parallel rank was not given every chunk")
        results = [o for i in sorted(self._results) for o in self._results[i]]
        counted = [(o[0], o[4]) for o in results if live.counts(o[0])]
        g_out, received, err = decode_gathered(live, self.refs, self._gheads, sorted(self.gathered), self.out)
        if not group.all_true(err is None):
            raise err or RankRefused("another tensor-parallel rank could not decode the delta")
        results += [o for o, _ in g_out]
        counted += [(o[0], ab) for o, ab in g_out if ab is not None]
        return assembled(live, results, counted, received)
