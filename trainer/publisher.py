"""Publishing a training run's weights after every optimizer step.

Attach to any torch training loop in a few lines::

    pub = await Publisher.create(model, node)      # signs and publishes version 0 (a snapshot)
    for batch in data:
        loss(model, batch).backward(); opt.step(); opt.zero_grad()
        await pub.publish()                        # returns once the step's changes are extracted
    await pub.close()                              # waits until the last version is published

(``Publisher(model, node, loop=...)`` with ``start_sync``/``publish_sync`` from a plain
thread; :class:`trainer.background.BackgroundNode` runs a node beside such a loop.)

What one :meth:`Publisher.publish_sync` does, and where it runs:

1. *Extract* (caller's thread, or a helper thread with ``optimizer=``): per bucket of
   at most ``bucket_bytes`` (rollout dtype) cast the weights to the rollout dtype on
   their device, bring the bucket to the host, and compare its raw bits with the
   previous published version kept on the CPU. Only positions and new words of
   changed elements are kept. Extra accelerator memory: one bucket.
2. *Encode* (``threads`` codec threads): as soon as a tensor's changes are known its
   segments are encoded while the next bucket is extracted.
3. *Finish* (one finisher thread, versions in order): collect the segments, update
   the CPU copy (only changed words), pack chunks, sign the manifest and hand the
   artifact to ``node.publish`` on the node's event loop. The training loop is
   already running the next step; it waits only if ``max_pending`` versions are
   still unpublished, or (step 1 of the next version) until this version's encode
   has finished, since the next delta is taken against it.

Why chunks do not leave before the last tensor is encoded: a follower accepts a
chunk only after checking it against the *signed* manifest, which holds every
chunk's hash and the target fingerprint (a fold over every tensor); both exist
only once all segments are encoded. Streaming earlier needs a format change (e.g.
a manifest signed per bucket, or a hash chain whose head is signed last); the
node's ``publish(manifest, chunks)`` contract has the same boundary.

Sharded trainers (FSDP2 / TP / pipeline / expert splits): every rank runs a Publisher over what it holds with no
gather of weights; rank 0 signs and publishes one manifest for the full model (see
:mod:`trainer.shard_io`).

Full weights (``full_weights=True``): the baseline users run today, for comparison. Every
version is published as a full snapshot of the weights (raw bf16 words, no compression: what a
full-weight broadcast ships), which restarts the chain at the node; followers catch up by taking
it (:func:`p2psync.store.plan_catchup`: a snapshot is an edge from any version). Extraction then
reads every bucket into a fresh copy of the weights (host memory: one more copy of the published
weights per pending version) and encodes raw segments instead of comparing.

The trainer node's own copy takes each delta from the changes extracted here, checked against
the signed target fingerprint (work proportional to the changed elements), instead of decoding
the chunks it was just given (``verify_own=True`` restores that self-test of the encoder; every
receiver decodes and checks every artifact either way).

Contracts: versions are published in order, each a delta against the one before (a snapshot
with ``full_weights``);
a failure in the background is raised by the next ``publish``/``flush``/``close``
(:class:`PublishError`) and nothing after it is published; the CPU copy always
equals the last version handed to the node.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from p2psync import dtypes
from p2psync.codec import precompile
from p2psync.codec.encode import CodecOptions, pack_chunks, position_buckets
from p2psync.codec.segment import SegmentStats
from p2psync.errors import CodecError, ConfigError, P2PSyncError
from p2psync.state import TensorSpec, fold_root, table_hash, tensor_seed
from trainer.assembly import Assembly, Pending
from trainer.pieces import Piece, published_table
from trainer.publish_record import PublishError, PublishRecord
from trainer.shard_io import Part, add_sums, iter_raw_segments, piece_sums

logger = logging.getLogger(__name__)


def _codes(torch_dtypes: Iterable[torch.dtype]) -> tuple[str, ...]:
    """The codec's codes of ``torch_dtypes`` (an unsupported one is refused later, by ``start_sync``)."""
    codes = set()
    for d in torch_dtypes:
        try:
            codes.add(dtypes.from_torch(d).code)
        except CodecError:
            pass
    return tuple(sorted(codes))


def _raising(exc: BaseException) -> Callable[[], Any]:
    """An extraction that fails with ``exc`` (:meth:`Publisher.publish_sync`'s ``failure``)."""
    def extract() -> Any:
        raise exc
    return extract


def _release_freed_memory() -> None:
    """Give the pages of freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    Version 0 allocates and frees the snapshot's chunks, about a megabyte each: glibc serves them from
    its heap once its mmap threshold has risen, and keeps what they freed resident except at the
    heap's top, so without this the process would stay larger by up to the snapshot it encoded."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class Publisher(Assembly):
    """Publishes a model's weights after each optimizer step as signed deltas (see module docstring).

    ``node``: the trainer :class:`~p2psync.node.Node` (rank 0 only when sharded; ``None`` elsewhere).
    ``loop``: the node's event loop (taken from the running loop by :meth:`create`).
    ``optimizer``: if given, extraction runs beside the next forward/backward and the optimizer's
    next ``step()`` waits for it (weights change only in ``step``).
    ``group``: process group for the publisher's own collectives when sharded (default: a new
    gloo group over all ranks, so they never interleave with the training's collectives).
    ``solo``: publish the whole model from this process alone, as rank 0 of no group (see :attr:`solo`).
    ``position_coding``: how a delta codes where its changes are (:data:`~p2psync.codec.encode.POSITION_CODINGS`; every
    receiver decodes both): ``"ranked"`` (the default) ranks each change among the base words of its
    magnitude bucket, the smallest deltas, for links where bytes cost the most; ``"base-free"`` codes
    positions alone (~30 % more bytes), which receivers decode without a pass over their base words:
    faster where a receiver waits on its decode rather than its fetch (docs/BENCHMARKS.md, "Position
    coding").
    ``held``: sharded trainers: the names this rank publishes (checkpoint names, or in-memory names for
    all their checkpoint tensors; vLLM's ``WeightSource.held_names()``), ``None`` for all it holds
    (DTensors: the elements their placements give this rank). Every tensor of the table must be
    published by exactly one rank; :meth:`start_sync` refuses anything else on every rank, naming
    the tensor. ``table``: the whole model's table in order, when a rank's ``model`` lacks tensors
    (default: the ranks' tables if they agree, else their union in rank order). docs/TRAINER.md,
    "Sharded trainers".
    """

    def __init__(self, model: torch.nn.Module, node: Any = None, *, dtype: torch.dtype = torch.bfloat16,
                 dtype_overrides: Mapping[str, torch.dtype] | None = None, model_id: str = "model",
                 bucket_bytes: int = 64 << 20, chunk_size: int = 1 << 20, threads: int = 2, zstd_level: int = 3,
                 max_pending: int = 2, optimizer: torch.optim.Optimizer | None = None, group: Any = None,
                 private_key: Any = None, loop: asyncio.AbstractEventLoop | None = None,
                 on_record: Callable[[PublishRecord], None] | None = None, full_weights: bool = False,
                 verify_own: bool = False, position_coding: str = "ranked", solo: bool = False,
                 held: Collection[str] | None = None, table: Sequence[TensorSpec] | None = None) -> None:
        if bucket_bytes < 4096:
            raise ConfigError("bucket_bytes", f"must be at least 4 KiB, got {bucket_bytes}")
        if max_pending < 1:
            raise ConfigError("max_pending", "must be at least 1")
        self.model = model
        self.node = node
        self.dtype = dtype
        self.dtype_overrides = dict(dtype_overrides or {})
        self.model_id = model_id
        self.bucket_bytes = bucket_bytes
        self.opts = CodecOptions(chunk_size=chunk_size, threads=threads, zstd_level=zstd_level,
                                 context_buckets=position_buckets(position_coding))
        self.optimizer = optimizer
        self.on_record = on_record
        self.full_weights = full_weights
        """Publish every version as a raw full snapshot instead of a delta (the full-weight baseline)."""
        self.verify_own = verify_own
        """True: the trainer node decodes every published delta from its chunks before taking it
        (a self-test of the encoder, a full decode per step on the trainer's CPU). False: it takes
        the changes extracted here, checked against the signed target fingerprint; receivers decode
        and check every artifact either way. Sharded publishers always let the node decode."""
        self._snapshot_level = 0 if full_weights else zstd_level
        self.held = None if held is None else frozenset(held)
        """Names this rank publishes (checkpoint or in-memory names); ``None``: all it has."""
        self.table = None if table is None else list(table)
        """The published table, when the ranks' models do not each describe the whole model."""
        self.records: list[PublishRecord] = []
        self.version: int | None = None
        """Newest version handed off (published or being published)."""
        self.published: int | None = None
        """Newest version the node accepted (rank 0)."""
        self.fingerprints: dict[int, str] = {}
        self._group = group
        self.solo = solo
        """This process publishes the whole model by itself (its tensors are full copies, not shards): no
        collectives, even in a ``torch.distributed`` world of several ranks (the vLLM trainer engine's rank 0)."""
        self._rank, self._world = 0, 1
        self._lost: set[int] = set()
        self._local_error: BaseException | None = None
        self._loop = loop
        self._private_key = private_key
        self._specs: list[TensorSpec] = []
        self._pieces: list[Piece] = []
        self._base: list[torch.Tensor] = []
        self._words: list[np.ndarray] = []
        self._full_sums: list[tuple[int, int]] = []
        self._base_ready = threading.Event()
        self._pending_slots = threading.BoundedSemaphore(max_pending)
        self._pool = ThreadPoolExecutor(self.opts.threads, thread_name_prefix="publisher-encode")
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="publisher-finish")
        self._extractor = ThreadPoolExecutor(1, thread_name_prefix="publisher-extract") if optimizer else None
        self._last: Future | None = None
        self._extracting: Future | None = None
        self._error: PublishError | None = None
        self._hook: Any = None
        self._closed = False
        # Load the codec's compiled kernels now, beside the model's setup and version 0, so that the
        # first delta does not wait for them (p2psync.codec.precompile).
        precompile.start(_codes((dtype, *self.dtype_overrides.values())))

    # --- async facade ---------------------------------------------------------------------
    @classmethod
    async def create(cls, model: torch.nn.Module, node: Any = None, **kwargs: Any) -> Publisher:
        """Build on the node's loop and publish version 0 (a snapshot) before returning."""
        pub = cls(model, node, loop=asyncio.get_running_loop(), **kwargs)
        try:
            await asyncio.to_thread(pub.start_sync)
        except BaseException:
            await asyncio.to_thread(pub._shutdown)
            raise
        return pub

    async def publish(self) -> int:
        """Publish the model's current weights as the next version; see :meth:`publish_sync`."""
        return await asyncio.to_thread(self.publish_sync)

    async def flush(self) -> None:
        await asyncio.to_thread(self.flush_sync)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    # --- setup ------------------------------------------------------------------------------
    def start_sync(self) -> int:
        """Copy the weights to the CPU and publish them as a snapshot; returns its version.

        If the node already holds exactly these weights (a restart), that version is adopted.
        Collective when sharded: every rank calls it.
        """
        self._setup_distributed()
        t0 = time.perf_counter()
        specs: list[TensorSpec] = []
        pieces: list[Piece] = []
        error: BaseException | None = None
        try:
            specs, pieces = published_table(self.model, self.dtype, self.dtype_overrides, self.held)
        except (ValueError, P2PSyncError) as exc:  # every rank raises it, after the exchange below
            error = exc
        self._specs, self._pieces = self._agree_table(specs, pieces, error, self.table)
        sums: dict[int, tuple[int, int]] = {}
        stats = SegmentStats()
        read_error: BaseException | None = None
        try:
            with torch.no_grad():
                for piece in self._pieces:
                    base = torch.empty(piece.numel, dtype=piece.dtype)
                    step = self._bucket_elements(piece)
                    for a in range(0, piece.numel, step):
                        b = min(piece.numel, a + step)
                        base[a:b].copy_(self._read(piece, a, b))
                    words = dtypes.words_of(base)
                    self._base.append(base)
                    self._words.append(words)
                    seed = tensor_seed(piece.spec.name)
                    sums[piece.index] = add_sums(sums.get(piece.index, (0, 0)),
                                                 piece_sums(words, piece.offset, seed, piece))
        except Exception as exc:  # sharded: every rank learns it through the exchange below
            if self._world == 1:
                raise
            read_error = exc

        def segments() -> Iterator[bytes | bytearray]:
            if read_error is not None:
                raise read_error
            for piece, words in zip(self._pieces, self._words):
                width = dtypes.from_code(piece.spec.dtype).width
                for seg, st in iter_raw_segments(piece, words, self._snapshot_level, self.opts.raw_elements(width)):
                    stats.add(st)
                    yield seg

        # The snapshot's chunks are encoded as they are sent (sharded: one at a time as rank 0 takes
        # them, trainer.exchange), so a rank holds its CPU copy and a chunk, not its share packed too.
        part = Part([], sums, {}, stats)
        t_enc = time.perf_counter()
        parts = self._gather(part, pack_chunks(segments(), self.opts.chunk_size))
        version: int | None = None
        outcome: str | None = None
        cause: BaseException | None = self._local_error
        if self._rank == 0:
            assert parts is not None
            failed = [q.error for q in parts if q.error is not None]
            if failed:
                outcome = "; ".join(failed)
            else:
                try:
                    version = self._publish_first(parts, t0, t_enc)
                except Exception as exc:  # noqa: BLE001 - every rank learns it through the outcome
                    if self._world == 1:
                        raise
                    outcome, cause = f"rank 0: {exc!r}", exc
        version, outcome = self._outcome((version, outcome))
        if outcome is not None:
            if cause is not None:
                raise cause
            raise P2PSyncError(f"publishing the first version failed: {outcome}")
        self.version = version
        # One full collection now, in the setup: the model's build, the imports and version 0 left
        # hundreds of thousands of new objects, and the collector's next full pass over them
        # (0.3-0.6 s on the project VM) would otherwise fall inside one of the first publishes.
        gc.collect()
        _release_freed_memory()
        self._base_ready.set()
        if self.optimizer is not None:
            self._hook = self.optimizer.register_step_pre_hook(lambda *_: self._wait_extracted())
        return version

    def _publish_first(self, parts: list[Part], t0: float, t_enc: float) -> int:
        """Rank 0: sign and publish the snapshot of every rank's part (or adopt the node's version if
        it holds exactly these weights); the version."""
        full = [(0, 0)] * len(self._specs)
        for p in parts:
            for i, part_sums in p.sums.items():
                full[i] = add_sums(full[i], part_sums)
        self._full_sums = full
        fp = fold_root(table_hash(self._specs), full)
        node = self.node
        if node.version is not None and node.fingerprint == fp:
            logger.info("node already holds these weights as version %d; adopted", node.version)
            self.fingerprints[node.version] = fp
            self.published = node.version
            return int(node.version)
        version = 0 if node.version is None else node.version + 1
        art = self._artifact("snapshot", parts, None, fp, full)
        self._hand_off(version, None, art, t0, t_enc - t0, t_enc)
        return version

    # --- per step -----------------------------------------------------------------------------
    def publish_sync(self, *, failure: BaseException | None = None) -> int:
        """Start publishing the current weights as the next version; returns that version.

        Returns once the changes are extracted (with ``optimizer=``: at once; the optimizer's next
        step waits for extraction); encoding and publishing continue in the background.
        Raises :class:`PublishError` if an earlier version failed. Collective when sharded.

        ``failure``: this rank cannot read its share of the version (e.g. the copy it reads from
        failed to fill). Sharded, it still takes part in the version's exchange, as a rank whose
        extraction raised ``failure``: every rank raises :class:`PublishError` and the node keeps
        the previous version. Alone, ``failure`` is raised.
        """
        self._check()
        if self.version is None:
            raise P2PSyncError("publisher not started (use Publisher.create or start_sync first)")
        self._pending_slots.acquire()
        try:
            self._check()
            self._base_ready.wait()
            self._check()
            self._base_ready.clear()
            version = self.version + 1
            started = time.perf_counter()
            try:
                extract: Callable[[], Any] = self._extract_full if self.full_weights else self._extract
                if failure is not None:
                    extract = _raising(failure)
                if self._extractor is not None:
                    extracted = self._extractor.submit(extract)
                    self._extracting = extracted
                else:
                    extracted = Future()
                    try:
                        extracted.set_result(extract())
                    except Exception as exc:
                        if self._world == 1:
                            raise
                        # Sharded: the other ranks publish this version too; the finisher tells rank 0
                        # this rank failed it, so nothing is published and no rank waits for it.
                        extracted.set_exception(exc)
            except BaseException:
                self._base_ready.set()  # nothing was handed off: the copy is unchanged
                raise
            self.version = version
            self._last = self._finisher.submit(self._finish, Pending(version, started, extracted))
        except BaseException:
            self._pending_slots.release()
            raise
        if extracted.done() and extracted.exception() is not None:
            raise PublishError(version, extracted.exception())  # type: ignore[arg-type]
        return version

    def _wait_extracted(self) -> None:
        f = self._extracting
        if f is not None:
            f.exception()  # wait; an error surfaces through the finisher

    def flush_sync(self) -> None:
        """Wait until every version handed off is published; raise the first failure."""
        last = self._last
        if last is not None:
            last.exception()
        self._check()

    def close_sync(self) -> None:
        """Flush, then stop the helper threads (idempotent)."""
        if self._closed:
            return
        try:
            self.flush_sync()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for pool in (self._extractor, self._finisher, self._pool):
            if pool is not None:
                pool.shutdown(wait=True)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise P2PSyncError("publisher is closed")

    # --- finishing (one thread, versions in order) ---------------------------------------------
