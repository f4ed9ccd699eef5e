"""What one rank of a publisher reads and exchanges: its pieces of the weights, and its share of a version.

Reading: a piece (:class:`trainer.pieces.Piece`) is read bucket by bucket (at most
``bucket_bytes`` in the rollout dtype on the accelerator at a time) and compared with the
CPU copy of the previous version; only changed positions and words are kept, and their
encode jobs start as soon as a piece is done.

Sharded models (FSDP2 / DTensor, see :mod:`trainer.pieces`): every rank runs a
Publisher over its own shard with no gather of weights. Each rank encodes its
shard's changes as segments of the *full* tensor (its local segment start/stop
shifted by the shard's flat offset; decoding is relative to the segment start,
so the bytes are otherwise those of a local encode) and computes the fingerprint
contribution of its elements at their global positions (the fingerprint is a sum
over elements, so contributions add). Rank 0 gathers the chunks (the compressed
delta) and 16 bytes per tensor (a :class:`Part` per rank, streamed chunk by chunk,
:mod:`trainer.exchange`), signs one manifest for the full model, and publishes it
on its node: receivers see an ordinary artifact. The one exception is version 0:
the root must hold the full snapshot, so rank 0 receives each rank's snapshot
chunks once, each rank encoding its next chunk as rank 0 takes the last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from p2psync import dtypes, wordops
from p2psync.codec.encode import CodecOptions, element_ranges, encode_sparse_range, pack_chunks
from p2psync.codec.segment import SegmentStats, encode_raw_segment, shift_segment
from p2psync.codec.slices import block_key, delta_ranges, order_segments
from p2psync.errors import ConfigError
from p2psync.state import TensorSpec
from trainer.exchange import Part, gather_parts, hear, send_part, tell
from trainer.pieces import Piece, RankShare, agree_table, rebind, share_of
from trainer.strided import encode_strided, pack_changes

MASK64 = 0xFFFFFFFFFFFFFFFF
_HASH_BLOCK = 1 << 22


def add_sums(a: tuple[int, int], b: tuple[int, int], sign: int = 1) -> tuple[int, int]:
    """``a + b`` (``a - b`` with ``sign=-1``) of two fingerprint sum pairs, modulo 2**64."""
    return (a[0] + sign * b[0]) & MASK64, (a[1] + sign * b[1]) & MASK64


def sums_at(positions: np.ndarray, words: np.ndarray, seed: np.uint64) -> tuple[int, int]:
    """Fingerprint sums of ``words`` at the global element ``positions``."""
    a, b = wordops.hash_sparse(positions, words, seed)
    return int(a), int(b)


def piece_sums(words: np.ndarray, offset: int, seed: np.uint64, piece: Piece | None = None) -> tuple[int, int]:
    """Fingerprint sums of a piece's words at their global positions (``piece``: where a strided
    piece's words lie)."""
    if piece is not None and piece.runs is not None:
        total = (0, 0)
        for s in range(0, words.shape[0], _HASH_BLOCK):
            e = min(words.shape[0], s + _HASH_BLOCK)
            pos = piece.global_positions(np.arange(s, e, dtype=np.int64))
            total = add_sums(total, sums_at(pos, words[s:e], seed))
        return total
    if offset == 0:
        a, b = wordops.hash_range(words, 0, words.shape[0], seed)
        return int(a), int(b)
    total = (0, 0)
    for s in range(0, words.shape[0], _HASH_BLOCK):
        e = min(words.shape[0], s + _HASH_BLOCK)
        total = add_sums(total, sums_at(np.arange(offset + s, offset + e, dtype=np.int64), words[s:e], seed))
    return total


def iter_raw_segments(piece: Piece, words: np.ndarray, level: int, step: int
                      ) -> Iterator[tuple[bytes | bytearray, SegmentStats]]:
    """Raw (snapshot) segments of a piece's ``words`` at their global ranges, each at most ``step``
    elements (one run after the other for a strided piece: a raw segment is one flat range), encoded
    one at a time as they are taken."""
    runs = piece.runs if piece.runs is not None else (np.array([piece.offset]), np.array([piece.numel]))
    at = 0
    for g, n in zip(runs[0].tolist(), runs[1].tolist()):
        for s, e in element_ranges(n, step):
            seg, st = encode_raw_segment(piece.index, s, words[at + s:at + e], level)
            yield shift_segment(seg, g), st
        at += n


def raw_segments(piece: Piece, words: np.ndarray, level: int, step: int) -> list[tuple[bytes | bytearray, SegmentStats]]:
    """:func:`iter_raw_segments`, all of them."""
    return list(iter_raw_segments(piece, words, level, step))


class ShardIO:
    """This rank's reads of its pieces and the publisher's collectives (see module doc).

    The rank side of :class:`trainer.publisher.Publisher`, which sets the attributes declared here.
    """

    node: Any
    bucket_bytes: int
    opts: CodecOptions
    _snapshot_level: int
    _group: Any
    solo: bool
    _rank: int
    _world: int
    _loop: asyncio.AbstractEventLoop | None
    _private_key: Any
    _specs: list[TensorSpec]
    _pieces: list[Piece]
    _words: list[np.ndarray]
    _pool: ThreadPoolExecutor
    exchanged: int = 0
    """Bytes of the last version's parts that crossed between ranks (sent by this rank; received, on rank 0)."""
    _lost: set[int]
    """Ranks lost during the last exchange (rank 0)."""
    _local_error: BaseException | None
    """What producing this rank's own chunks raised in the last exchange."""

    # --- setup ------------------------------------------------------------------------------
    def _setup_distributed(self) -> None:
        import torch.distributed as dist

        if self.solo:
            self._group = None
        elif self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        if self._group is not None:
            self._rank = dist.get_rank(self._group)
            self._world = dist.get_world_size(self._group)
        if self._rank == 0:
            if self.node is None:
                raise ConfigError("node", "rank 0 publishes and needs the trainer node")
            if self._private_key is None:
                self._private_key = getattr(self.node, "private_key", None)
            if self._private_key is None:
                raise ConfigError("private_key", "no signing key: give private_key= or a node with trainer_private_key")
            if self._loop is None:
                raise ConfigError("loop", "the node's event loop is needed (use Publisher.create inside it)")

    # --- extraction ---------------------------------------------------------------------------
    def _bucket_elements(self, piece: Piece) -> int:
        return max(1, self.bucket_bytes // dtypes.from_torch(piece.dtype).width)

    def _read(self, piece: Piece, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the piece in the rollout dtype, on the CPU (one bucket on the device)."""
        src = piece.local()[a:b]
        if src.device.type == "cpu":
            return src.to(piece.dtype)
        return src.to(piece.dtype).to("cpu")

    def _extract(self) -> tuple[list[tuple[int, Piece, np.ndarray, np.ndarray, list[Future[Any]]]], float]:
        """Changed positions and words per piece; a piece's encode jobs start as soon as it is done."""
        t0 = time.perf_counter()
        out = []
        with torch.no_grad():
            for k, piece in enumerate(self._pieces):
                old = self._words[k]
                step = self._bucket_elements(piece)
                pos_parts, val_parts = [], []
                for a in range(0, piece.numel, step):
                    b = min(piece.numel, a + step)
                    new = dtypes.words_of(self._read(piece, a, b).contiguous())
                    idx = np.flatnonzero(new != old[a:b])
                    if idx.shape[0]:
                        pos_parts.append(idx + a)
                        val_parts.append(new[idx])
                if not pos_parts:
                    continue
                pos = np.concatenate(pos_parts).astype(np.int64, copy=False)
                vals = np.concatenate(val_parts)
                if piece.runs is not None:  # rank 0 encodes it (trainer.strided)
                    gpos = piece.global_positions(pos)
                    stream: list[Future[Any]] = [self._pool.submit(pack_changes, piece.spec, gpos, old[pos], vals,
                                                                  max(1, self.opts.zstd_level))]
                    out.append((k, piece, pos, vals, stream))
                    continue
                # cut at the tensor's row blocks where they pay (p2psync.codec.slices), in piece positions
                off = piece.offset
                jobs = [self._pool.submit(encode_sparse_range, piece.index, piece.spec, old, pos, vals, s - off,
                                          e - off, self.opts, off, False)  # sums: _collect_delta's
                        for s, e in delta_ranges(piece.spec, self.opts.segment_elements, off, off + piece.numel)]
                out.append((k, piece, pos, vals, jobs))
        return out, time.perf_counter() - t0

    def _extract_full(self) -> tuple[list[tuple[int, Piece, np.ndarray, list[Future[Any]]]], float]:
        """Every piece's words, read bucket by bucket into a fresh copy; raw encode jobs start per piece."""
        t0 = time.perf_counter()
        out = []
        with torch.no_grad():
            for k, piece in enumerate(self._pieces):
                new = np.empty_like(self._words[k])
                step = self._bucket_elements(piece)
                for a in range(0, piece.numel, step):
                    b = min(piece.numel, a + step)
                    new[a:b] = dtypes.words_of(self._read(piece, a, b).contiguous())
                width = dtypes.from_code(piece.spec.dtype).width
                if piece.runs is not None:
                    runs: list[Future[Any]] = [self._pool.submit(raw_segments, piece, new, self._snapshot_level,
                                                                 self.opts.raw_elements(width))]
                    out.append((k, piece, new, runs))
                    continue
                jobs = [self._pool.submit(encode_raw_segment, piece.index, s, new[s:e], self._snapshot_level)
                        for s, e in element_ranges(piece.numel, self.opts.raw_elements(width))]
                out.append((k, piece, new, jobs))
        return out, time.perf_counter() - t0

    def _encode_strided(self, parts: list[Part]) -> list[Part]:
        """Rank 0: the strided tensors' segments from every rank's changes (:mod:`trainer.strided`)."""
        blobs: dict[int, list[bytes]] = {}
        for q in parts:
            for i, bs in q.streams.items():
                blobs.setdefault(i, []).extend(bs)
        if not blobs:
            return []
        jobs = [self._pool.submit(encode_strided, i, self._specs[i], blobs[i], self.opts) for i in sorted(blobs)]
        segments: list[bytes | bytearray] = []
        stats = SegmentStats()
        for job in jobs:
            segs, st = job.result()
            segments.extend(segs)
            stats.add(st)
        chunks = list(pack_chunks(order_segments(segments, self._specs), self.opts.chunk_size,
                                  lambda seg: block_key(self._specs, seg)))
        return [Part(chunks, {}, {}, stats)]

    # --- collectives (sharded only) ----------------------------------------------------------
    def _agree_table(self, specs: list[TensorSpec], pieces: list[Piece], error: BaseException | None,
                     given: list[TensorSpec] | None) -> tuple[list[TensorSpec], list[Piece]]:
        """The published table and this rank's pieces in it, agreed by every rank (a collective when
        sharded: every rank raises the same ``ValueError`` if a rank refused its share or the shares do
        not cover the table exactly once; :func:`trainer.pieces.agree_table`)."""
        mine = share_of(specs, pieces, error)
        shares: list[RankShare] = [mine]
        if self._world > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * self._world
            dist.all_gather_object(gathered, mine, group=self._group)
            shares = gathered
        if error is not None and self._world == 1:
            raise error
        table, strided = agree_table(shares, given)
        return table, rebind(pieces, table, strided)

    def _gather(self, part: Part, more: Iterable[bytes] = ()) -> list[Part] | None:
        """Rank 0: every rank's part in rank order, each rank's chunks streamed to it chunk by chunk
        (:mod:`trainer.exchange`: ``part.chunks`` then ``more``, consumed as sent; ``part``'s other
        fields are read after the last chunk, so iterating ``more`` may fill them). Other ranks: sends
        theirs, returns ``None``. Bytes between ranks: :attr:`exchanged`. A rank lost during the
        exchange, or whose ``more`` raised, is a part with its ``error`` set (rank 0 tells the others,
        :meth:`_outcome`); this rank's own such error is :attr:`_local_error`."""
        self._lost, self._local_error = set(), None
        if self._world == 1:
            return [replace(part, chunks=[*part.chunks, *more])]
        if self._rank != 0:
            self.exchanged, self._local_error = send_part(part, more, self._rank, self._group)
            return None
        got = gather_parts(part, more, self._world, self._group)
        self.exchanged, self._lost, self._local_error = got.received, got.lost, got.error
        return got.parts

    def _outcome(self, value: Any) -> Any:
        """Rank 0's ``value`` (the version's outcome) on every rank, rank 0 telling each rank still there
        after :meth:`_gather` (point to point: a lost rank is skipped, not waited for)."""
        if self._world == 1:
            return value
        if self._rank == 0:
            tell(value, self._world, self._group, self._lost)
            return value
        return hear(self._group)
