"""Rank 0's half of a version: the ranks' parts in, one signed artifact on the trainer node out.

:class:`Assembly` is the publishing side of :class:`trainer.publisher.Publisher` (which sets the
attributes declared here and runs :meth:`Assembly._finish` on its finisher thread once a version's
extraction is done): every rank's compressed part is collected on rank 0 (its own and, sharded,
the others' through :class:`~trainer.shard_io.ShardIO`'s exchange), the segments are ordered and
packed into chunks, the manifest is built and signed, and the artifact is handed to the node on its
event loop. A failure on any rank fails the version on every rank (:class:`PublishError`), with
nothing published.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from p2psync.artifact import Manifest, build_manifest
from p2psync.codec.encode import EncodedArtifact, pack_chunks
from p2psync.codec.segment import SegmentStats, shift_segment
from p2psync.codec.slices import block_key, order_segments
from p2psync.errors import P2PSyncError
from p2psync.state import fold_root, table_hash, tensor_seed
from trainer.publish_record import PublishError, PublishRecord
from trainer.shard_io import Part, ShardIO, add_sums, piece_sums, sums_at

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """A version being published: its number, start time and the extraction's future."""

    version: int
    started: float
    extracted: Future
    """-> (list of (piece, pos, vals, encode futures), extract seconds)."""


class Assembly(ShardIO):
    """Collect, sign and hand off each version (see module doc); the rank-0 side of the Publisher."""

    model_id: str
    full_weights: bool
    verify_own: bool
    on_record: Callable[[PublishRecord], None] | None
    records: list[PublishRecord]
    published: int | None
    fingerprints: dict[int, str]
    _full_sums: list[tuple[int, int]]
    _base_ready: threading.Event
    _pending_slots: threading.BoundedSemaphore
    _error: PublishError | None

    def _finish(self, p: Pending) -> None:
        """Collect this rank's share of version ``p``, exchange, and on rank 0 sign and publish (a delta,
        or with ``full_weights`` a full snapshot).

        Sharded: every rank takes part in the exchange of every version it handed off, failed or not
        (a failed rank sends an error part), and rank 0 broadcasts the outcome, so that every rank
        stops at the same version and no rank waits for a part that never comes; a version any rank
        failed is not published (the node keeps the previous one)."""
        own: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

        def collect() -> tuple[Part, float, float]:
            return self._collect_full(p) if self.full_weights else self._collect_delta(p, own)

        def publish(parts: list[Part], extract_s: float, t_enc: float) -> None:
            if self.full_weights:
                self._publish_full(p, parts, extract_s, t_enc)
            else:
                self._publish_delta(p, parts, own, extract_s, t_enc)

        try:
            if self._error is not None:
                return
            part: Part | None = None
            try:
                try:
                    part, extract_s, t_enc = collect()
                finally:
                    self._base_ready.set()  # the next extraction may start (against the updated copy)
            except BaseException as exc:  # noqa: BLE001 - sent to rank 0, raised to the training loop
                if self._world == 1:
                    raise
                self._error = PublishError(p.version, exc)
                logger.error("publishing version %d failed on rank %d: %r", p.version, self._rank, exc)
                part = Part([], {}, {}, SegmentStats(), error=f"rank {self._rank}: {exc!r}")
                extract_s = t_enc = 0.0
            parts = self._gather(part)
            outcome: str | None = None
            cause: BaseException | None = None
            if self._rank == 0:
                assert parts is not None
                failed = [q.error for q in parts if q.error is not None]
                if failed:
                    outcome = "; ".join(failed)
                else:
                    try:
                        publish(parts, extract_s, t_enc)
                    except BaseException as exc:  # noqa: BLE001 - every rank learns it through the outcome
                        if self._world == 1:
                            raise
                        outcome, cause = f"rank 0: {exc!r}", exc
            outcome = self._outcome(outcome)
            if outcome is not None:
                raise PublishError(p.version, cause or P2PSyncError(outcome))
        except BaseException as exc:  # noqa: BLE001 - kept and raised to the training loop
            if self._error is None:
                self._error = exc if isinstance(exc, PublishError) else PublishError(p.version, exc)
            logger.error("publishing version %d failed: %r", p.version, exc)
            self._base_ready.set()
        finally:
            self._pending_slots.release()

    def _collect_delta(self, p: Pending, own: dict[int, list[tuple[np.ndarray, np.ndarray]]]
                       ) -> tuple[Part, float, float]:
        """This rank's part of delta ``p`` (its segments packed, its strided changes, its sum changes);
        updates the CPU copy."""
        changes, extract_s = p.extracted.result()
        t_enc = time.perf_counter()
        segments: list[bytes | bytearray] = []
        streams: dict[int, list[bytes]] = {}
        deltas: dict[int, tuple[int, int]] = {}
        changed: dict[int, int] = {}
        stats = SegmentStats()
        for k, piece, pos, vals, jobs in changes:
            if piece.runs is not None:
                streams.setdefault(piece.index, []).append(jobs[0].result())
            else:
                for job in jobs:
                    r = job.result()
                    segments.extend(shift_segment(s, piece.offset) for s in r.segments)
                    stats.add(r.stats)
            words = self._words[k]
            seed = tensor_seed(piece.spec.name)
            gpos = piece.global_positions(pos)
            d = add_sums(sums_at(gpos, vals, seed), sums_at(gpos, words[pos], seed), -1)
            deltas[piece.index] = add_sums(deltas.get(piece.index, (0, 0)), d)
            changed[piece.index] = changed.get(piece.index, 0) + int(pos.shape[0])
            words[pos] = vals  # the CPU copy is now this version
            if self._world == 1 and not self.verify_own:
                own.setdefault(piece.index, []).append((gpos, vals))
        chunks = list(pack_chunks(order_segments(segments, self._specs), self.opts.chunk_size,
                                  lambda seg: block_key(self._specs, seg)))
        return Part(chunks, deltas, changed, stats, streams), extract_s, t_enc

    def _publish_delta(self, p: Pending, parts: list[Part], own: dict[int, list[tuple[np.ndarray, np.ndarray]]],
                       extract_s: float, t_enc: float) -> None:
        """Rank 0: the artifact of delta ``p`` from every rank's part, signed and handed to the node."""
        base = list(self._full_sums)
        target = list(base)
        for q in parts:
            for i, d in q.sums.items():
                target[i] = add_sums(target[i], d)
        th = table_hash(self._specs)
        extra = self._encode_strided(parts)
        art = self._artifact("delta", parts + extra, fold_root(th, base), fold_root(th, target), target)
        mine = None
        if self._world == 1 and not self.verify_own:
            mine = {i: xs[0] if len(xs) == 1 else (np.concatenate([x[0] for x in xs]),
                                                   np.concatenate([x[1] for x in xs]))
                    for i, xs in own.items()}
        self._hand_off(p.version, p.version - 1, art, p.started, extract_s, t_enc, mine)
        self._full_sums = target

    def _collect_full(self, p: Pending) -> tuple[Part, float, float]:
        pieces, extract_s = p.extracted.result()
        t_enc = time.perf_counter()
        segments: list[bytes | bytearray] = []
        sums: dict[int, tuple[int, int]] = {}
        stats = SegmentStats()
        for k, piece, new, jobs in pieces:
            for job in jobs:
                got = job.result()
                for seg, st in got if piece.runs is not None else [got]:
                    segments.append(seg if piece.runs is not None else shift_segment(seg, piece.offset))
                    stats.add(st)
            seed = tensor_seed(piece.spec.name)
            sums[piece.index] = add_sums(sums.get(piece.index, (0, 0)), piece_sums(new, piece.offset, seed, piece))
            self._words[k][:] = new  # the CPU copy is now this version
        return Part(list(pack_chunks(segments, self.opts.chunk_size)), sums, {}, stats), extract_s, t_enc

    def _publish_full(self, p: Pending, parts: list[Part], extract_s: float, t_enc: float) -> None:
        full = [(0, 0)] * len(self._specs)
        for q in parts:
            for i, s in q.sums.items():
                full[i] = add_sums(full[i], s)
        fp = fold_root(table_hash(self._specs), full)
        self._hand_off(p.version, None, self._artifact("snapshot", parts, None, fp, full), p.started,
                       extract_s, t_enc)
        self._full_sums = full

    def _artifact(self, kind: str, parts: list[Part], base_fp: str | None, target_fp: str,
                  target_sums: list[tuple[int, int]]) -> EncodedArtifact:
        stats = SegmentStats()
        changed = [0] * len(self._specs)
        chunks: list[bytes] = []
        for q in parts:
            chunks.extend(q.chunks)
            stats.add(q.stats)
            for i, n in q.changed.items():
                changed[i] += n
        stats.changed = sum(changed)
        return EncodedArtifact(kind, list(self._specs), chunks, base_fp, target_fp, list(target_sums), changed, stats)

    def _hand_off(self, version: int, base_version: int | None, art: EncodedArtifact, started: float,
                  extract_s: float, t_enc: float, changes: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
                  ) -> None:
        """Rank 0: sign, give to the node (on its loop), wait, record. ``changes``: the delta's
        changes for the node's own copy (:meth:`~p2psync.node.Node.publish`)."""
        m: Manifest = build_manifest(art, model_id=self.model_id, target_version=version,
                                     base_version=base_version, chunk_size=self.opts.chunk_size,
                                     private_key=self._private_key)
        t_pub = time.perf_counter()
        loop = self._loop
        assert loop is not None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise P2PSyncError("publisher called on the node's event loop thread; use the async methods")
        pub = self.node.publish(m, art.chunks) if changes is None else self.node.publish(m, art.chunks, changes)
        asyncio.run_coroutine_threadsafe(pub, loop).result()
        t_done = time.perf_counter()
        rec = PublishRecord(version, m.kind, m.target_fingerprint, sum(art.changed) if art.kind == "delta"
                            else sum(s.numel for s in self._specs), sum(s.numel for s in self._specs),
                            m.payload_bytes, m.model_bytes, len(m.chunks), extract_s, t_pub - t_enc,
                            t_done - t_pub, t_done - started, exchanged_bytes=self.exchanged)
        self.records.append(rec)
        self.fingerprints[version] = m.target_fingerprint
        self.published = version
        logger.info("published version %d (%s) fingerprint %s: %d bytes, %.4f%% changed", version, m.kind,
                    m.target_fingerprint, m.payload_bytes, 100 * rec.changed_fraction)
        if self.on_record is not None:
            self.on_record(rec)
