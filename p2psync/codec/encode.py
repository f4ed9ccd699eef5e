"""Encoding a state change (delta) or a whole state (snapshot) into chunks.

Work is split into jobs of at most ``segment_elements`` elements of one tensor (a delta's job
cuts its range further at the row blocks that pay, :func:`p2psync.codec.slices.pieces`, and a
delta's segments are packed in that module's order);
jobs run on ``threads`` threads, the calling one included (``workers.in_order``;
the numba kernels, numpy and zstd release the GIL); a snapshot's segments are
packed into chunks in job order as they come, a delta's once all jobs ran, in
slice order: the bytes out do not depend on the thread count. A job holds only buffers sized by its own changes, taken from
a few sets kept between calls: encoding allocates nothing proportional to the
model.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from p2psync import dtypes
from p2psync.codec import context, dense, kernels, segencode
from p2psync.codec.segment import MAX_BUCKETS, SegmentStats, encode_raw_segment
from p2psync.codec.slices import block_key, delta_ranges, dense_pieces, order_segments, sparse_pieces
from p2psync.codec.sparse import encode_changes
from p2psync.workers import in_order
from p2psync.errors import ConfigError
from p2psync.state import ModelState, TensorSpec, check_table, fold_root, tensor_seed

CHUNK_MAGIC = b"P2C2"
"""Chunk magic; its last byte is the codec format version (2: bucketed positions)."""
CHUNK_VERSION = 2
_CHUNK_HEAD = 8  # magic + u32 segment count
_SEG_PREFIX = 4  # u32 length before each segment
# Room kept in a chunk for a segment's header, bucket table and up to 255 residual tables.
_SEGMENT_OVERHEAD = 64 + 7 * MAX_BUCKETS + 255 * 72
MASK64 = 0xFFFFFFFFFFFFFFFF
MAX_SEGMENT_CHANGES = 1 << 17


POSITION_CODINGS = {"ranked": 4, "base-free": 1}
"""A delta's position codings by name (what a trainer chooses), and the magnitude buckets each gives
:attr:`CodecOptions.context_buckets`: ranked within buckets of the base words, or positions alone."""


def position_buckets(coding: str) -> int:
    """:attr:`CodecOptions.context_buckets` of the position coding named ``coding``
    (:class:`~p2psync.errors.ConfigError` ``position_coding`` for a name not in :data:`POSITION_CODINGS`)."""
    if coding not in POSITION_CODINGS:
        raise ConfigError("position_coding", f"must be one of {', '.join(POSITION_CODINGS)}, got {coding!r}")
    return POSITION_CODINGS[coding]


@dataclass(frozen=True)
class CodecOptions:
    chunk_size: int = 4 << 20
    """Upper bound of a chunk in bytes; every chunk but the last is filled close to it."""
    threads: int = 2
    """Worker threads for encoding and decoding."""
    segment_elements: int = 1 << 23
    """Largest element range one segment covers (bounds decode work per segment)."""
    zstd_level: int = 3
    """zstd level for residual planes and snapshot payloads (0 stores them raw)."""
    context_buckets: int = 4
    """Magnitude buckets of the position context (1..4). The receiver recomputes every base
    word's bucket, so positions cost only the gaps between changes of one bucket: ~5.4 bits per
    change at lr 1e-6 with 4 buckets. 1 is the fast mode: context-free positions (~7.7 bits,
    deltas ~1.3x bigger at RL learning rates) and no pass over the base words when decoding.
    Decoders read every setting; this only changes what the encoder writes."""

    def __post_init__(self) -> None:
        if not 64 << 10 <= self.chunk_size <= 256 << 20:
            raise ConfigError("chunk_size", f"must be between 64 KiB and 256 MiB, got {self.chunk_size}")
        if self.threads < 1:
            raise ConfigError("threads", "must be at least 1")
        if not 1024 <= self.segment_elements <= 1 << 30:
            raise ConfigError("segment_elements", "must be between 1024 and 2**30")
        if not 0 <= self.zstd_level <= 22:
            raise ConfigError("zstd_level", "must be between 0 and 22")
        if not 1 <= self.context_buckets <= MAX_BUCKETS:
            raise ConfigError("context_buckets", f"must be between 1 and {MAX_BUCKETS}, got {self.context_buckets}")

    def max_changes(self, width: int) -> int:
        # Worst case per change: the word itself plus up to ~5 bytes of Rice code, so a segment
        # always fits a chunk. The 2**17 cap keeps the per-thread scan buffers at ~2 MB.
        budget = (self.chunk_size - _CHUNK_HEAD - _SEGMENT_OVERHEAD) // (width + 6)
        return max(1, min(self.segment_elements, MAX_SEGMENT_CHANGES, budget))

    def raw_elements(self, width: int) -> int:
        return max(1, min(self.segment_elements, (self.chunk_size - _CHUNK_HEAD - 64) // width))


@dataclass
class EncodedArtifact:
    """Chunks plus what the manifest needs to say about them."""

    kind: str
    specs: list[TensorSpec]
    chunks: list[bytes]
    base_fingerprint: str | None
    target_fingerprint: str
    target_sums: list[tuple[int, int]]
    changed: list[int] = field(default_factory=list)
    stats: SegmentStats = field(default_factory=SegmentStats)


def pack_chunks(segments: Iterable[bytes | bytearray], chunk_size: int,
                block: Callable[[bytes | bytearray], object] | None = None) -> Iterator[bytes]:
    """Greedy in-order packing of segments into chunks of at most ``chunk_size`` bytes; with
    ``block``, a new chunk also starts where ``block(segment)`` changes
    (:func:`p2psync.codec.slices.block_key`)."""
    batch: list[bytes | bytearray] = []
    size = _CHUNK_HEAD
    last: object = None
    for seg in segments:
        need = _SEG_PREFIX + len(seg)
        if _CHUNK_HEAD + need > chunk_size:
            raise AssertionError("segment larger than a chunk")  # prevented by CodecOptions bounds
        here = block(seg) if block is not None else None
        if batch and (size + need > chunk_size or here != last):
            yield _chunk(batch)
            batch, size = [], _CHUNK_HEAD
        last = here
        batch.append(seg)
        size += need
    if batch:
        yield _chunk(batch)


def _chunk(segs: list[bytes | bytearray]) -> bytes:
    parts: list[bytes | bytearray] = [CHUNK_MAGIC, struct.pack("<I", len(segs))]
    for s in segs:
        parts.append(struct.pack("<I", len(s)))
        parts.append(s)
    return b"".join(parts)


# --- delta jobs --------------------------------------------------------------------------
@dataclass
class SegmentBatch:
    """The segments of one element range of one tensor, in range order."""

    tensor: int
    segments: list[bytes | bytearray]
    stats: SegmentStats
    hash_delta: tuple[int, int]
    """What the changes add to the tensor's fingerprint sums."""


def _add_segment(out: SegmentBatch, encoded: tuple[bytes, SegmentStats, tuple[int, int]]) -> None:
    seg, st, (da, db) = encoded
    out.segments.append(seg)
    out.stats.add(st)
    a, b = out.hash_delta
    out.hash_delta = ((a + da) & MASK64, (b + db) & MASK64)


# A job's thresholds and a segment's bytes, each from one compiled call. The step-by-step
# references are ``context.job_thresholds(_sparse)``, ``sparse.encode_changes`` and
# :func:`_scan_job_reference`: the same bytes (tests swap these names for the references and
# compare whole artifacts).
_encode_segment = segencode.encode
_thresholds = segencode.job_thresholds
_thresholds_sparse = segencode.job_thresholds_sparse


_spare: list[tuple[np.ndarray, ...]] = []
_spare_lock = threading.Lock()
_MAX_SPARE = 4


def _take_buffers(size: int, word: np.dtype, width: int) -> tuple[np.ndarray, ...]:
    """A job's scan buffers (positions, old and new words, buckets, ranks: ``size`` slots) and its
    segments' scratch (``segencode.new_scratch``), taken from the spare sets when one fits.

    Encoding memory does not grow with the model: a set is sized by a segment's changes, and
    each thread holds one while it runs a job. The sets are kept across jobs and calls
    (:func:`_give_back`, at most ``_MAX_SPARE``), not per thread: the helper threads start anew
    with every call, and fresh buffers cost ~1,100 page faults per encode of the benchmark model
    on two threads, several ms of CPU on the benchmark VM (docs/CODEC.md, "Speed")."""
    with _spare_lock:
        for k in range(len(_spare) - 1, -1, -1):
            b = _spare[k]
            if b[0].shape[0] >= size and b[1].dtype == word and b[8].shape[0] >= size * width:
                return _spare.pop(k)
    return (np.empty(size, dtype=np.int64), np.empty(size, dtype=word), np.empty(size, dtype=word),
            np.empty(size, dtype=np.uint8), np.empty(size, dtype=np.int64)) + segencode.new_scratch(size, width)


def _give_back(bufs: tuple[np.ndarray, ...]) -> None:
    with _spare_lock:
        _spare.append(bufs)
        del _spare[:-_MAX_SPARE]


def release_buffers() -> None:
    """Free the scan buffers kept between encodes (~4.6 MB per thread that encoded at once for
    4 MiB chunks); the next encode allocates them again."""
    with _spare_lock:
        _spare.clear()


def _densest(encoded: tuple[bytes, SegmentStats, tuple[int, int]], tensor: int, at: int, stop: int, old: np.ndarray,
             new: np.ndarray, width: int, opts: CodecOptions) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """The sparse segment ``encoded`` of ``[at, stop)``, or the dense one where that is smaller
    (:func:`p2psync.codec.dense.smaller`)."""
    return dense.smaller(encoded, tensor, at, stop, old, lambda: new[at:stop], width, opts.zstd_level)


def _all_changed(old: np.ndarray, new: np.ndarray, at: int, end: int, cap: int) -> int | None:
    """Where the scan's next segment from ``at`` ends when every word of it changed (it then holds
    ``min(cap, end - at)`` changes: :func:`~p2psync.codec.dense.dense_first`), else ``None``
    (the scan decides). One compare of the segment's words."""
    stop = min(end, at + cap)
    if stop < end and old[stop] == new[stop]:
        return None  # the scan's segment would run on past unchanged words
    if np.count_nonzero(old[at:stop] == new[at:stop]):
        return None
    return stop


def _dense_range(tensor: int, at: int, stop: int, old: np.ndarray, new: np.ndarray, seed: np.uint64,
                 opts: CodecOptions) -> tuple[bytes, SegmentStats, tuple[int, int]]:
    """The dense segment of ``[at, stop)``, every word of which changed."""
    return dense.encode_range(tensor, at, old[at:stop], new[at:stop], np.arange(at, stop, dtype=np.int64),
                              old[at:stop], new[at:stop], seed, opts.zstd_level)


def _scan_job(tensor: int, spec: TensorSpec, old: np.ndarray, new: np.ndarray, s: int, e: int, opts: CodecOptions):
    d = dtypes.from_code(spec.dtype)
    cap = opts.max_changes(d.width)
    seed = tensor_seed(spec.name)
    out = SegmentBatch(tensor, [], SegmentStats(), (0, 0))
    bufs = _take_buffers(cap + 64, d.word, d.width)
    try:
        for a, b in dense_pieces(spec, old, new, s, e):
            # Thresholds first (from a sample), so that one pass finds the changes and ranks them;
            # then one compiled call per segment finds, ranks and codes its changes (``segencode``).
            thr = _thresholds(d, old, new, a, b, opts.context_buckets)
            at = a
            while at < b:
                stop = _all_changed(old, new, at, b, cap)
                if stop is not None:  # the segment the scan would make, dense_first: no sparse encode
                    _add_segment(out, _dense_range(tensor, at, stop, old, new, seed, opts))
                    at = stop
                    continue
                stop, encoded = segencode.scan(tensor, d, old, new, at, b, cap, thr, opts.zstd_level, seed, bufs)
                if encoded is not None:
                    _add_segment(out, _densest(encoded, tensor, at, stop, old, new, d.width, opts))
                at = stop
    finally:
        _give_back(bufs)
    return out


def _scan_job_reference(tensor: int, spec: TensorSpec, old: np.ndarray, new: np.ndarray, s: int, e: int,
                        opts: CodecOptions):
    """:func:`_scan_job` step by step (``context``, ``kernels``, ``sparse.encode_changes``): the
    statement of what the compiled path computes; tests hold the two to the same bytes."""
    d = dtypes.from_code(spec.dtype)
    cap = opts.max_changes(d.width)
    bufs = _take_buffers(cap + 64, d.word, d.width)
    pos_b, old_b, new_b, bkt_b, rank_b = bufs[:5]
    seed = tensor_seed(spec.name)
    out = SegmentBatch(tensor, [], SegmentStats(), (0, 0))
    try:
        for a, e_ in dense_pieces(spec, old, new, s, e):
            thr = context.job_thresholds(d, old, new, a, e_, opts.context_buckets)
            consts = context.consts_for(d, thr)
            at = a
            while at < e_:
                stop_ = _all_changed(old, new, at, e_, cap)
                if stop_ is not None:
                    _add_segment(out, _dense_range(tensor, at, stop_, old, new, seed, opts))
                    at = stop_
                    continue
                if thr.shape[0]:
                    stop, n = kernels.find_ranked_changes(old, new, at, e_, cap, consts, pos_b, old_b, new_b, bkt_b,
                                                          rank_b)
                    ranked = (bkt_b[:n], rank_b[:n])
                else:
                    stop, n = kernels.find_changes(old, new, at, e_, cap, pos_b, old_b, new_b)
                    ranked = None
                if n:
                    _add_segment(out, _densest(encode_changes(tensor, at, stop, old, pos_b[:n], old_b[:n], new_b[:n],
                                                              d, thr, opts.zstd_level, seed, ranked),
                                               tensor, at, stop, old, new, d.width, opts))
                at = stop
    finally:
        _give_back(bufs)
    return out


def encode_sparse_range(tensor: int, spec: TensorSpec, old: np.ndarray, pos: np.ndarray, vals: np.ndarray, s: int,
                        e: int, opts: CodecOptions, offset: int = 0, hashes: bool = True) -> SegmentBatch:
    """The delta segments of elements ``[s, e)`` of tensor #``tensor`` from changes found
    elsewhere (e.g. on a GPU): ``pos`` sorted changed positions of the whole tensor, ``vals``
    their new words, ``old`` the base words. Same bytes as :func:`encode_delta` gives for that
    range; ranges from :func:`p2psync.codec.slices.delta_ranges` with ``opts.segment_elements``.
    ``offset``: where ``old`` starts in the tensor, for a shard of it (positions and ranges are
    then the shard's; the row-block cuts and their sample are the tensor's). ``hashes=False``: the
    caller sums the fingerprint change itself (the publisher does, from the changes it extracted),
    so ``hash_delta`` is left ``(0, 0)`` and dense ranges skip that pass. Thread-safe."""
    d = dtypes.from_code(spec.dtype)
    cap = opts.max_changes(d.width)
    seed = tensor_seed(spec.name)
    out = SegmentBatch(tensor, [], SegmentStats(), (0, 0))
    lo, hi = np.searchsorted(pos, [s, e])
    if lo == hi:
        return out
    for ps, pe in sparse_pieces(spec, pos[lo:hi], s, e, offset):
        plo, phi = np.searchsorted(pos, [ps, pe])
        if plo == phi:
            continue
        thr = _thresholds_sparse(d, old, pos[plo:phi], ps, pe, opts.context_buckets)
        at = ps
        for a in range(plo, phi, cap):
            b = min(phi, a + cap)
            stop = int(pos[b]) if b < phi else pe
            p = pos[a:b]

            def new_words(at: int = at, stop: int = stop, p: np.ndarray = p, v: np.ndarray = vals[a:b]) -> np.ndarray:
                w = old[at:stop].copy()
                w[p - at] = v
                return w

            if dense.dense_first(b - a, stop - at):  # the sparse coding cannot pay here: not tried
                _add_segment(out, dense.encode_range(tensor, at, old[at:stop], new_words(), p,
                                                     old[p] if hashes else None, vals[a:b], seed, opts.zstd_level))
            else:
                _add_segment(out, dense.smaller(_encode_segment(tensor, at, stop, old, p, old[p], vals[a:b], d, thr,
                                                                opts.zstd_level, seed),
                                                tensor, at, stop, old, new_words, d.width, opts.zstd_level))
            at = stop
    if not hashes:
        out.hash_delta = (0, 0)
    return out


def element_ranges(n: int, step: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ranges of ``step`` elements (the last one shorter): the ranges a tensor
    is encoded in (``opts.segment_elements`` for a delta, ``opts.raw_elements(width)`` raw)."""
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _run(jobs: list[tuple], opts: CodecOptions, ahead: int = 4) -> Iterator[SegmentBatch]:
    """The jobs' results in job order; ``jobs``: ``(function, arguments, elements)``.

    With several threads the calling thread runs jobs too (``workers.in_order``: no pool per call,
    helpers that start at once). The look-ahead is bounded by elements, not jobs: at most
    ``4 * threads + 1`` of the largest job's elements started past the oldest result not yet
    packed, the bound a look-ahead of ``4 * threads`` jobs past the oldest gave, without leaving a
    thread idle behind one long job at the head (the model's embedding comes first). ``ahead``
    replaces the 4 (jobs of even cost, such as a raw snapshot's copies, need less)."""
    if opts.threads == 1:
        for fn, args, _ in jobs:
            yield fn(*args)
        return
    sizes = [size for _, _, size in jobs]
    window = (ahead * opts.threads + 1) * max(sizes, default=0)
    yield from in_order(lambda k: jobs[k][0](*jobs[k][1]), sizes, opts.threads, window)


def _collect(kind: str, base: ModelState, results: Iterator[SegmentBatch], opts: CodecOptions,
             sink: Callable[[int, bytes], None] | None = None) -> EncodedArtifact:
    sums = base.tensor_sums(opts.threads)
    base_fp = fold_root(base.table_hash, sums)
    changed = [0] * len(base.specs)
    stats = SegmentStats()

    def segments() -> Iterator[bytes | bytearray]:
        for r in results:
            a, b = sums[r.tensor]
            sums[r.tensor] = ((a + r.hash_delta[0]) & MASK64, (b + r.hash_delta[1]) & MASK64)
            changed[r.tensor] += r.stats.changed
            stats.add(r.stats)
            yield from r.segments

    chunks: list[bytes] = []
    try:
        block = None
        ordered: Iterable[bytes | bytearray] = segments()
        if kind == "delta":
            # Where a job cut its range is known once it ran: the packing order
            # (p2psync.codec.slices.order_key) is taken over all segments, which a delta holds in
            # memory anyway (its chunks do).
            block = lambda seg: block_key(base.specs, seg)  # noqa: E731
            ordered = order_segments(list(ordered), base.specs)
        for i, chunk in enumerate(pack_chunks(ordered, opts.chunk_size, block)):
            if sink is None:
                chunks.append(chunk)
            else:
                sink(i, chunk)
    finally:
        if isinstance(results, Generator):
            results.close()  # a sink that raised: the helper threads stop now, not at garbage collection
    return EncodedArtifact(kind, list(base.specs), chunks, base_fp, fold_root(base.table_hash, sums), sums,
                           changed, stats)


def encode_delta(base: ModelState, new: ModelState, opts: CodecOptions | None = None) -> EncodedArtifact:
    """Chunks that turn ``base`` into ``new`` bit-exactly. Both must share one tensor table."""
    opts = opts or CodecOptions()
    check_table(new.specs, base.specs)
    jobs = []
    for i, spec in enumerate(base.specs):
        old_w, new_w = base.words(spec.name), new.words(spec.name)
        for s, e in delta_ranges(spec, opts.segment_elements):
            jobs.append((_scan_job, (i, spec, old_w, new_w, s, e, opts), e - s))
    return _collect("delta", base, _run(jobs, opts), opts)


def encode_delta_sparse(
    base: ModelState, changes: dict[str, tuple[np.ndarray, np.ndarray]], opts: CodecOptions | None = None
) -> EncodedArtifact:
    """Like :func:`encode_delta` from already extracted changes: ``name -> (sorted positions, new words)``.

    Produces byte-identical chunks to :func:`encode_delta` for the same change.
    """
    opts = opts or CodecOptions()
    unknown = [n for n in changes if n not in base.index]
    if unknown:
        check_table(base.specs + [TensorSpec(n, "U8", ()) for n in unknown], base.specs)
    jobs = []
    for i, spec in enumerate(base.specs):
        if spec.name not in changes:
            continue
        pos, vals = changes[spec.name]
        pos = np.asarray(pos, dtype=np.int64)
        vals = np.asarray(vals).view(dtypes.from_code(spec.dtype).word)
        if pos.shape[0] == 0:
            continue
        for s, e in delta_ranges(spec, opts.segment_elements):
            jobs.append((encode_sparse_range, (i, spec, base.words(spec.name), pos, vals, s, e, opts), e - s))
    return _collect("delta", base, _run(jobs, opts), opts)


def encode_snapshot(state: ModelState, opts: CodecOptions | None = None,
                    sink: Callable[[int, bytes], None] | None = None) -> EncodedArtifact:
    """Chunks holding every word of ``state``.

    ``sink``: called with each chunk's index and bytes as soon as it is packed, in order; the
    result then holds no chunks (``chunks`` is empty), so a snapshot of any size is encoded in
    a few chunks' worth of memory (see :func:`p2psync.artifact.snapshot_manifest`). An error
    the sink raises stops the encode.
    """
    opts = opts or CodecOptions()

    def job(i: int, spec: TensorSpec, s: int, e: int) -> SegmentBatch:
        seg, st = encode_raw_segment(i, s, state.words(spec.name)[s:e], opts.zstd_level)
        return SegmentBatch(i, [seg], st, (0, 0))

    jobs = []
    for i, spec in enumerate(state.specs):
        step = opts.raw_elements(dtypes.from_code(spec.dtype).width)
        for s, e in element_ranges(spec.numel, step):
            jobs.append((job, (i, spec, s, e), e - s))
    # Streamed to a sink: at most threads + 1 segments in flight (each a copy of up to a chunk).
    art = _collect("snapshot", state, _run(jobs, opts, 1 if sink is not None else 4), opts, sink)
    art.base_fingerprint = None
    return art
