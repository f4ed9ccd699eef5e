"""Decoding chunks and applying them to a state, all-or-nothing.

:class:`Applier` takes chunks in any order (from any thread), decodes each as
it arrives, and writes nothing until :meth:`Applier.commit`, which checks that
every chunk is there, computes the resulting fingerprint from the changed
words alone, compares it with the target the manifest promises, and only then
writes. So a delta either lands whole and bit-exact, or not at all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from p2psync import dtypes
from p2psync.codec import kernels
from p2psync.codec.encode import CHUNK_MAGIC
from p2psync.codec.segment import (
    KIND_DELTA,
    KIND_RAW,
    ParsedSegment,
    SegmentStats,
    decode_ranks,
    decode_residuals,
    parse_segment,
    unpack_payload,
    unplanes,
    unzigzag,
)
from p2psync.codec.wire import Reader
from p2psync.errors import CodecError, FingerprintMismatch, P2PSyncError, WrongBase
from p2psync.state import ModelState, TensorSpec, check_table, fold_root


def split_chunk(chunk: bytes | memoryview) -> list[memoryview]:
    r = Reader(chunk, "chunk")
    if bytes(r.take(4)) != CHUNK_MAGIC:
        raise CodecError("chunk: bad magic (not a p2psync chunk)")
    count = r.u32()
    if count > len(chunk) // 4:
        raise CodecError("chunk: impossible segment count")
    segs = [r.take(r.u32()) for _ in range(count)]
    r.done()
    return segs


def chunk_stats(chunk: bytes | memoryview) -> SegmentStats:
    st = SegmentStats(header=8)
    for seg in split_chunk(chunk):
        p = parse_segment(seg)
        st.header += 4
        st.add(p.stats)
    return st


def _decode_delta(p: ParsedSegment, spec: TensorSpec, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = dtypes.from_code(spec.dtype)
    assert p.table is not None and p.unary is not None and p.rem is not None and p.res is not None
    if any(t[0] > d.exp_mask for t in p.table):
        raise CodecError("segment: context out of range for its dtype")
    ranks = decode_ranks(p.table, p.unary, p.rem, p.n, p.stop - p.start)
    width = d.exp_mask + 1
    next_rank = np.full(width, -1, dtype=np.int64)
    next_idx = np.zeros(width, dtype=np.int64)
    end_idx = np.zeros(width, dtype=np.int64)
    off = 0
    for c, cnt, _, _ in p.table:
        next_idx[c] = off
        end_idx[c] = off + cnt
        next_rank[c] = ranks[off]
        off += cnt
    pos = np.empty(p.n, dtype=np.int64)
    counts = np.empty(width, dtype=np.int64)
    found = kernels.scan_decode(old, p.start, p.stop, d.exp_shift, d.exp_mask, next_rank, ranks, next_idx,
                                end_idx, p.n, pos, counts)
    if found != p.n:
        raise CodecError(f"segment of {spec.name}: {p.n - found} changes fall outside the range")
    old_w = old[pos]
    ctx = (old_w >> d.word.type(d.exp_shift)) & d.word.type(d.exp_mask) if d.exp_mask else np.zeros(p.n, np.int64)
    zres = decode_residuals(p.res, ctx, {t[0]: t[3] for t in p.table}, d.word)
    return pos, old_w + unzigzag(zres)


class Applier:
    """All-or-nothing application of one artifact's chunks to ``state``.

    Contract: a chunk is decoded only after the base was checked; nothing is written to
    ``state`` before every chunk decoded and the resulting fingerprint equals ``target``.
    For a snapshot the state is only a destination with the right tensor table (its old
    contents do not matter) and the fingerprint is recomputed from every element.
    """

    def __init__(
        self,
        state: ModelState,
        *,
        kind: str,
        specs: list[TensorSpec],
        n_chunks: int,
        target_fingerprint: str,
        base_fingerprint: str | None = None,
        base_version: int | None = None,
    ) -> None:
        check_table(specs, state.specs)
        if kind == "delta":
            actual = state.fingerprint
            if actual != base_fingerprint:
                raise WrongBase(str(base_fingerprint), actual, base_version)
        elif kind != "snapshot":
            raise CodecError(f"unknown artifact kind {kind!r}")
        self.state = state
        self.kind = kind
        self.n_chunks = n_chunks
        self.target = target_fingerprint
        self._lock = threading.Lock()
        self._done: set[int] = set()
        # tensor index -> list of (start, stop, positions, new words) or (start, stop, words)
        self._parts: dict[int, list[tuple]] = {}
        self._committed = False

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.n_chunks) if i not in self._done]

    def add_chunk(self, index: int, chunk: bytes | memoryview) -> None:
        """Decode chunk ``index`` (already hash-verified by the caller). Thread-safe."""
        if not 0 <= index < self.n_chunks:
            raise CodecError(f"chunk index {index} out of range (artifact has {self.n_chunks})")
        with self._lock:
            if index in self._done:
                raise CodecError(f"chunk {index} given twice")
        decoded = []
        for seg in split_chunk(chunk):
            p = parse_segment(seg)
            if p.tensor >= len(self.state.specs):
                raise CodecError(f"segment names tensor #{p.tensor}, table has {len(self.state.specs)}")
            spec = self.state.specs[p.tensor]
            if p.stop > spec.numel:
                raise CodecError(f"segment of {spec.name} covers [{p.start}, {p.stop}), tensor has {spec.numel}")
            if p.kind == KIND_DELTA and self.kind == "delta":
                pos, vals = _decode_delta(p, spec, self.state.words(spec.name))
                decoded.append((p.tensor, (p.start, p.stop, pos, vals)))
            elif p.kind == KIND_RAW and self.kind == "snapshot":
                d = dtypes.from_code(spec.dtype)
                n = p.stop - p.start
                words = unplanes(unpack_payload(p.res_codec, p.res, n * d.width), n, d.word)
                decoded.append((p.tensor, (p.start, p.stop, words)))
            else:
                raise CodecError(f"segment kind {p.kind} does not belong in a {self.kind}")
        with self._lock:
            if index in self._done:
                raise CodecError(f"chunk {index} given twice")
            self._done.add(index)
            for t, part in decoded:
                self._parts.setdefault(t, []).append(part)

    def add_chunks(self, chunks: Iterable[tuple[int, bytes | memoryview]], threads: int = 2) -> None:
        items = list(chunks)
        if threads <= 1 or len(items) <= 1:
            for i, c in items:
                self.add_chunk(i, c)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="p2psync-decode") as pool:
            for f in [pool.submit(self.add_chunk, i, c) for i, c in items]:
                f.result()

    def _ordered(self, t: int) -> list[tuple]:
        parts = sorted(self._parts.get(t, []), key=lambda x: x[0])
        for a, b in zip(parts, parts[1:]):
            if b[0] < a[1]:
                raise CodecError(f"segments of {self.state.specs[t].name} overlap")
        return parts

    def commit(self) -> str:
        """Verify and write; returns the new fingerprint. On any error nothing is written."""
        if self._committed:
            raise P2PSyncError("artifact already applied")
        if self.missing:
            raise CodecError(f"{len(self.missing)} of {self.n_chunks} chunks missing (first: {self.missing[0]})")
        state = self.state
        if self.kind == "delta":
            changes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            for t in self._parts:
                parts = self._ordered(t)
                changes[t] = (np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts]))
            sums = state.updated_sums(changes)
            fp = fold_root(state.table_hash, sums)
            if fp != self.target:
                raise FingerprintMismatch(self.target, fp)
            state.apply_sparse(changes, sums)
        else:
            for i, spec in enumerate(state.specs):
                parts = self._ordered(i)
                if sum(p[1] - p[0] for p in parts) != spec.numel:
                    raise CodecError(f"snapshot does not cover all of {spec.name}")
            # A snapshot replaces everything: stage it, verify, then copy in.
            staged = ModelState.empty_like(state.specs)
            for i, spec in enumerate(state.specs):
                w = staged.words(spec.name)
                for s, e, words in self._parts.get(i, []):
                    w[s:e] = words
            fp = staged.audit()
            if fp != self.target:
                raise FingerprintMismatch(self.target, fp)
            for spec in state.specs:
                state.words(spec.name)[:] = staged.words(spec.name)
            state._sums = staged.tensor_sums()
        self._committed = True
        self._parts.clear()
        return fp


def decode_state(specs: list[TensorSpec], chunks: Iterable[tuple[int, bytes | memoryview]], n_chunks: int,
                 target_fingerprint: str, threads: int = 2) -> ModelState:
    """A new state from a snapshot's chunks."""
    state = ModelState.empty_like(specs)
    ap = Applier(state, kind="snapshot", specs=specs, n_chunks=n_chunks, target_fingerprint=target_fingerprint)
    ap.add_chunks(chunks, threads)
    ap.commit()
    return state


