"""Decoding chunks and applying them to a state, all-or-nothing: the one apply-and-verify path.

:class:`Applier` takes chunks in any order (from any thread), decodes each as
it arrives, and writes nothing until :meth:`Applier.commit`, which checks that
every chunk is there, computes the resulting fingerprint from the changed
words alone, compares it with the target the manifest promises, and only then
writes. So a delta either lands whole and bit-exact, or not at all.

A delta whose changes were already decoded (by the node in the same process)
or extracted (by the publisher) takes the same path without chunks:
:meth:`Applier.adopting` checks the changes against the tensor table, the base
and, at :meth:`Applier.commit`, the target fingerprint, exactly as decoded ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import cast

import numpy as np

from p2psync import dtypes
from p2psync.codec import context, kernels, segdecode, slabs
from p2psync.codec.encode import CHUNK_MAGIC, CHUNK_VERSION
from p2psync.codec.segment import (
    DELTA_KINDS,
    KIND_RAW,
    ParsedSegment,
    SegmentStats,
    parse_head,
    parse_segment,
    span_of,
    unpack_payload,
)
from p2psync.codec.wire import Reader
from p2psync.workers import run_ordered
from p2psync.errors import (
    CodecError,
    FingerprintMismatch,
    FormatVersionError,
    P2PSyncError,
    WrongBase,
)
from p2psync.state import ModelState, TensorSpec, check_table, fold_root, tensor_seed

MASK64 = 0xFFFFFFFFFFFFFFFF


def split_chunk(chunk: bytes | memoryview) -> list[memoryview]:
    r = Reader(chunk, "chunk")
    magic = bytes(r.take(4))
    if magic != CHUNK_MAGIC:
        if magic[:3] == CHUNK_MAGIC[:3] and magic[3:] == b"1":
            raise FormatVersionError(1, CHUNK_VERSION)
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
        assert p.stats is not None  # parse_segment always measures
        st.add(p.stats)
    return st


def _decode_delta(p: ParsedSegment, spec: TensorSpec, old: np.ndarray, out: slabs.Arena | None = None
                  ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(positions, new words, fingerprint sum change) of one delta segment against ``old``
    (``p`` from :func:`~p2psync.codec.segment.parse_head` or ``parse_segment``); the positions
    and words are cut from ``out`` when given."""
    assert p.raw is not None
    return segdecode.decode(p.raw, p.body_at, p.start, p.stop, dtypes.from_code(spec.dtype), old,
                            tensor_seed(spec.name), out)


def _unplanes_into(buf: bytes | memoryview, dest: np.ndarray) -> None:
    """Write the words whose byte planes are ``buf`` into the contiguous 1-D array ``dest``.

    Same result as :func:`~p2psync.codec.segment.unplanes` followed by a copy, without the
    intermediate array and ~5x faster: one strided copy per plane instead of a transpose.
    """
    w = dest.dtype.itemsize
    n = dest.shape[0]
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.shape[0] != n * w:
        raise CodecError(f"segment: payload has {raw.shape[0]} bytes, expected {n * w}")
    out = dest.view(np.uint8)
    if w == 1:
        out[:] = raw
        return
    for k in range(w):
        out[k::w] = raw[k * n:(k + 1) * n]


class Applier:
    """All-or-nothing application of one artifact's chunks to ``state``.

    Contract: a chunk is decoded only after the base was checked; nothing is written to
    ``state`` before every chunk decoded and the resulting fingerprint equals ``target``.
    For a snapshot the state is only a destination with the right tensor table (its old
    contents do not matter) and the fingerprint is recomputed from every element: each
    chunk's words are decoded into a staging copy and hashed as the chunk arrives (in the
    caller's thread, so decoding overlaps the download), and :meth:`commit` checks that
    the segments cover every element exactly once before it folds those sums.

    ``scratch=True`` declares that ``state`` is a fresh buffer nobody else reads until
    :meth:`commit` returned (e.g. from :meth:`ModelState.empty_like`): a snapshot then
    decodes straight into it instead of into a staging copy, saving a model-sized buffer
    and a copy. If anything fails, such a state holds garbage and must be dropped.
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
        scratch: bool = False,
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
        self.base = base_fingerprint
        self.base_version = base_version
        self._adopted: tuple[dict[int, tuple[np.ndarray, np.ndarray]], list[tuple[int, int]] | None] | None = None
        self.adopted = False
        """Whether this applier took already decoded changes (:meth:`adopt`) instead of chunks."""
        self._lock = threading.Lock()
        self._done: set[int] = set()
        # tensor index -> list of (start, stop, positions, new words, sum change a, b) or, for a
        # snapshot, (start, stop, hash lane a, hash lane b) of words already written to the staging state
        self._parts: dict[int, list[tuple]] = {}
        self._committed = False
        self._staged: ModelState | None = None
        self.threads = 2
        """Threads that :meth:`commit` writes a delta with (:meth:`add_chunks` sets its own)."""
        self.keep_changes = False
        """Set before :meth:`commit` to keep a delta's decoded changes in :attr:`changes` afterwards."""
        self.changes: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
        """After a kept delta commit: tensor index -> (positions, new words), as written. Positions
        are distinct, grouped by segment in range order, and inside a segment by magnitude bucket
        (not sorted)."""
        if kind == "snapshot":
            self._staged = state if scratch else ModelState.empty_like(state.specs)
        # Decoded positions and words come from slabs kept between decodes (no fresh pages per
        # decode); a slab is reused only once nothing made from it is alive (``codec.slabs``).
        self._arena = slabs.Arena()

    @classmethod
    def for_manifest(cls, state: ModelState, manifest, *, scratch: bool = False) -> Applier:
        """An applier for a :class:`~p2psync.artifact.Manifest` (checks tensor table and base first)."""
        return cls(state, kind=manifest.kind, specs=list(manifest.tensors), n_chunks=len(manifest.chunks),
                   target_fingerprint=manifest.target_fingerprint, base_fingerprint=manifest.base_fingerprint,
                   base_version=manifest.base_version, scratch=scratch)

    @classmethod
    def onto(cls, state: ModelState | None, manifest) -> Applier:
        """An applier of ``manifest`` onto ``state`` (None: no weights yet).

        A snapshot with another tensor table, or any artifact when there is no state, goes into
        a fresh state (``scratch``) that the caller adopts from :attr:`state` after :meth:`commit`.
        """
        fresh = state is None or (manifest.kind == "snapshot" and list(manifest.tensors) != state.specs)
        if fresh:
            state = ModelState.empty_like(list(manifest.tensors))
        assert state is not None
        return cls.for_manifest(state, manifest, scratch=fresh)

    @classmethod
    def adopting(cls, state: ModelState | None, manifest, changes: Mapping[int, tuple[np.ndarray, np.ndarray]],
                 sums: list[tuple[int, int]] | None = None) -> Applier:
        """An applier of the delta ``manifest`` onto ``state`` from its changes, already decoded or
        extracted, instead of its chunks (see :meth:`adopt`). Checks the tensor table and the base
        now; :meth:`commit` checks the target fingerprint before it writes anything."""
        if state is None:
            raise WrongBase(str(manifest.base_fingerprint), "no weights", manifest.base_version)
        if manifest.kind != "delta":
            raise CodecError(f"decoded changes belong to a delta, not a {manifest.kind}")
        ap = cls.for_manifest(state, manifest)
        ap.adopt(changes, sums)
        return ap

    def adopt(self, changes: Mapping[int, tuple[np.ndarray, np.ndarray]],
              sums: list[tuple[int, int]] | None = None) -> None:
        """Take a delta's changes (tensor index -> (positions, new words)) in place of its chunks.

        ``sums``: the per-tensor fingerprint sums after the changes when they are known (the node
        that decoded them keeps them: :meth:`p2psync.node.Node.decoded`); they hold for any state
        whose fingerprint is the delta's base. Without them they are computed from the base words
        at the changed positions. Either way :meth:`commit` folds them and compares with the
        target before writing. Every tensor index, position and word width is checked here
        (:class:`~p2psync.errors.CodecError`, nothing written)."""
        if self.kind != "delta":
            raise CodecError(f"decoded changes belong to a delta, not a {self.kind}")
        if self._done or self._adopted is not None:
            raise CodecError("changes given twice, or beside chunks")
        specs = self.state.specs
        parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for t, (pos, new) in changes.items():
            if not (isinstance(t, int) and 0 <= t < len(specs)):
                raise CodecError(f"changes name tensor #{t}, table has {len(specs)}")
            spec = specs[t]
            words = self.state.words(spec.name)
            pos = np.ascontiguousarray(pos, dtype=np.int64)
            new = np.ascontiguousarray(new)
            if new.dtype.itemsize != words.dtype.itemsize or pos.ndim != 1 or pos.shape != new.shape:
                raise CodecError(f"changes of {spec.name}: positions and words do not match the tensor")
            if pos.shape[0] and (int(pos.min()) < 0 or int(pos.max()) >= words.shape[0]):
                raise CodecError(f"changes of {spec.name}: a position falls outside the tensor")
            parts[t] = (pos, new.view(words.dtype))
        if sums is not None and len(sums) != len(specs):
            raise CodecError(f"{len(sums)} fingerprint sums given, table has {len(specs)} tensors")
        self._adopted = (parts, None if sums is None else list(sums))
        self.adopted = True

    @property
    def missing(self) -> list[int]:
        if self._adopted is not None:
            return []
        return [i for i in range(self.n_chunks) if i not in self._done]

    def _check_index(self, index: int) -> None:
        if self._adopted is not None:
            raise CodecError("chunks given beside adopted changes")
        if not 0 <= index < self.n_chunks:
            raise CodecError(f"chunk index {index} out of range (artifact has {self.n_chunks})")
        with self._lock:
            if index in self._done:
                raise CodecError(f"chunk {index} given twice")

    def _decode_segment(self, seg: memoryview) -> tuple[int, tuple]:
        p = parse_head(seg)
        if p.tensor >= len(self.state.specs):
            raise CodecError(f"segment names tensor #{p.tensor}, table has {len(self.state.specs)}")
        spec = self.state.specs[p.tensor]
        if p.stop > spec.numel:
            raise CodecError(f"segment of {spec.name} covers [{p.start}, {p.stop}), tensor has {spec.numel}")
        d = dtypes.from_code(spec.dtype)
        if p.kind in DELTA_KINDS and self.kind == "delta":
            pos, vals, (a, b) = _decode_delta(p, spec, self.state.words(spec.name), self._arena)
            return p.tensor, (p.start, p.stop, pos, vals, a, b)
        if p.kind == KIND_RAW and self.kind == "snapshot":
            assert self._staged is not None and p.res is not None
            n = p.stop - p.start
            words = self._staged.words(spec.name)
            _unplanes_into(unpack_payload(p.res_codec, p.res, n * d.width), words[p.start:p.stop])
            a, b = kernels.hash_range(words, p.start, p.stop, tensor_seed(spec.name))
            return p.tensor, (p.start, p.stop, int(a), int(b))
        raise CodecError(f"segment kind {p.kind} does not belong in a {self.kind}")

    def _register(self, index: int, decoded: list[tuple[int, tuple]]) -> None:
        with self._lock:
            if index in self._done:
                raise CodecError(f"chunk {index} given twice")
            self._done.add(index)
            for t, part in decoded:
                self._parts.setdefault(t, []).append(part)

    def add_chunk(self, index: int, chunk: bytes | memoryview) -> None:
        """Decode chunk ``index`` (already hash-verified by the caller). Thread-safe."""
        self._check_index(index)
        self._register(index, [self._decode_segment(seg) for seg in split_chunk(chunk)])

    def add_chunks(self, chunks: Iterable[tuple[int, bytes | memoryview]], threads: int = 2) -> None:
        """Decode many chunks on ``threads`` threads, segment by segment (so that one big chunk
        also uses every thread).

        The calling thread and ``threads - 1`` helpers (:func:`~p2psync.workers.run_ordered`)
        take the segments longest first (by element range, which the decode time follows: it
        reads every base word of the range), so that a big segment in the last chunk (e.g. an
        untied output embedding) does not run alone at the end. Results and errors do not depend
        on that order: chunks are registered, and the first failing segment reported, in the
        order given."""
        items = list(chunks)
        self.threads = max(1, threads)
        if threads <= 1 or not items:
            for i, c in items:
                self.add_chunk(i, c)
            return
        split = []
        seen: set[int] = set()
        for i, c in items:
            self._check_index(i)
            if i in seen:
                raise CodecError(f"chunk {i} given twice")
            seen.add(i)
            split.append((i, split_chunk(c)))
        segs = [seg for _, ss in split for seg in ss]  # in chunk order
        order = sorted(range(len(segs)), key=lambda x: -span_of(segs[x]))
        results, failed, error = run_ordered(len(segs), order, lambda x: self._decode_segment(segs[x]),
                                             min(threads, len(segs)))
        at = 0
        for i, ss in split:  # registered in the order given, up to the first failing segment
            if failed < at + len(ss):
                assert error is not None
                raise error
            self._register(i, cast(list[tuple[int, tuple]], results[at:at + len(ss)]))
            at += len(ss)

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
        if self.kind == "delta" and state.fingerprint != self.base:
            # Nothing else may write the state meanwhile; if something did, this is not the base.
            raise WrongBase(str(self.base), state.fingerprint, self.base_version)
        if self._adopted is not None:
            adopted, given = self._adopted
            after = given if given is not None else state.updated_sums(adopted)
            fp = fold_root(state.table_hash, after)
            if fp != self.target:
                raise FingerprintMismatch(self.target, fp)
            state.apply_parts([(t, p, v) for t, (p, v) in adopted.items()], after, self.threads)
            if self.keep_changes:
                self.changes = adopted
            self._adopted = None
        elif self.kind == "delta":
            # The sum changes were computed from the base words while decoding, and nothing can
            # write to the state in between (it is the applier's until commit).
            ordered = {t: self._ordered(t) for t in self._parts}
            sums = state.tensor_sums()
            for t, parts in ordered.items():
                a, b = sums[t]
                sums[t] = ((a + sum(p[4] for p in parts)) & MASK64, (b + sum(p[5] for p in parts)) & MASK64)
            fp = fold_root(state.table_hash, sums)
            if fp != self.target:
                raise FingerprintMismatch(self.target, fp)
            # Written segment by segment (no concatenation), on the decode threads. The decoder's
            # positions lie in each segment's range, which was checked against the tensor.
            state.apply_parts([(t, p[2], p[3]) for t, parts in ordered.items() for p in parts], sums, self.threads,
                              in_range=True)
            if self.keep_changes:
                # Arrays of their own: decoded ones are cut from slabs that later decodes reuse once
                # nothing refers to them, and a kept view would hold its whole slab.
                self.changes = {t: (parts[0][2].copy(), parts[0][3].copy()) if len(parts) == 1 else
                                (np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts]))
                                for t, parts in ordered.items()}
        else:
            # Every element written exactly once (no gap, no overlap), so the per-segment sums
            # add up to what a full audit of the staged words computes.
            staged = self._staged
            assert staged is not None
            sums = []
            for i, spec in enumerate(state.specs):
                parts = self._ordered(i)
                if sum(p[1] - p[0] for p in parts) != spec.numel:
                    raise CodecError(f"snapshot does not cover all of {spec.name}")
                sums.append((sum(p[2] for p in parts) & MASK64, sum(p[3] for p in parts) & MASK64))
            fp = fold_root(state.table_hash, sums)
            if fp != self.target:
                raise FingerprintMismatch(self.target, fp)
            if staged is not state:
                for spec in state.specs:
                    state.words(spec.name)[:] = staged.words(spec.name)
            state._sums = sums
            self._staged = None
        self._committed = True
        self._parts.clear()
        self._arena.close()
        return fp


def decode_state(specs: list[TensorSpec], chunks: Iterable[tuple[int, bytes | memoryview]], n_chunks: int,
                 target_fingerprint: str, threads: int = 2) -> ModelState:
    """A new state from a snapshot's chunks."""
    state = ModelState.empty_like(specs)
    ap = Applier(state, kind="snapshot", specs=specs, n_chunks=n_chunks, target_fingerprint=target_fingerprint,
                 scratch=True)
    ap.add_chunks(chunks, threads)
    ap.commit()
    return state




def warm_up(codes: Iterable[str] = ("BF16", "F16", "F32")) -> None:
    """Import torch and load the compiled kernels of the apply path, and of both encode paths, for
    ``codes`` (dtype codes).

    The first decode in a process otherwise pays for ``import torch`` and for numba loading
    its cached kernels (seconds, both): a node calls this in the background when it starts,
    so that the first artifact it receives applies at full speed. Exercises encode, decode,
    apply and fingerprinting on a few thousand elements; touches no shared state.
    """
    import torch

    from p2psync.codec.encode import (
        CodecOptions,
        encode_delta,
        encode_delta_sparse,
        encode_snapshot,
    )

    opts = CodecOptions(chunk_size=64 << 10, threads=1, segment_elements=4096, zstd_level=1)
    for code in codes:
        d = dtypes.from_code(code)
        g = torch.Generator().manual_seed(0)
        # Two dimensions and MIN_SLICED elements: the encoders estimate where to cut it into row blocks.
        old = ModelState([("w", torch.randn(128, 128, generator=g).to(d.torch_dtype()))])
        new = old.clone()
        # Small magnitudes change more often, as under an optimizer step: the delta uses bucketed
        # positions (the kernels a real delta needs), and a few changes escape the rANS symbols.
        w = new.words("w")
        key = w & d.word.type(context.key_mask(d))
        idx = np.arange(w.shape[0])
        w[(key < np.median(key)) & (idx % 2 == 0)] += d.word.type(1)
        w[idx % 61 == 0] += d.word.type(40)
        new.invalidate()
        snap = encode_snapshot(old, opts)
        got = decode_state(old.specs, enumerate(snap.chunks), len(snap.chunks), snap.target_fingerprint, 1)
        delta = encode_delta(old, new, opts)
        pos = np.flatnonzero(old.words("w") != w)
        encode_delta_sparse(old, {"w": (pos, w[pos])}, opts)  # the publisher's path (changes found elsewhere)
        ap = Applier(got, kind="delta", specs=got.specs, n_chunks=len(delta.chunks),
                     target_fingerprint=delta.target_fingerprint, base_fingerprint=delta.base_fingerprint)
        ap.add_chunks(enumerate(delta.chunks), 1)
        ap.commit()
        # The trainer node's path: the publisher's extracted changes adopted instead of decoded.
        back = Applier(got, kind="delta", specs=got.specs, n_chunks=len(delta.chunks),
                       target_fingerprint=snap.target_fingerprint, base_fingerprint=delta.target_fingerprint)
        back.adopt({0: (pos, old.words("w")[pos])})
        back.commit()
