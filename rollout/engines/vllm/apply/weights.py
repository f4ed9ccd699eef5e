"""A vLLM model's live parameters seen as the trainer's checkpoint tensors, and artifacts applied to them.

:class:`LiveWeights` binds every tensor of the trainer's table to where this
rank holds it (a :class:`~rollout.engines.vllm.placement.boxes.Placement` learnt from
vLLM's own loaders, :mod:`rollout.engines.vllm.placement.probe`), as integer views of the
raw bits: same memory, on the parameter's own device. A tensor held whole and
contiguous is bound to its slice (the fast path: decoded against in place);
any other is bound to its whole parameter: one held whole as a strided block
(an expert inside a repacked ``w13_weight``, a transposed weight) is read by a
compiled gather of a segment's range (a vector transpose of vLLM's CPU MoE
16-row blocks) and written by a compiled pass that maps each position
(:mod:`rollout.engines.vllm.apply.kernels`); others (sharded, permuted per head)
through the placement's positions. Then:

- **Fingerprint.** The per-tensor sums of element hashes of
  :mod:`p2psync.state` over those views (:meth:`LiveWeights.audit` recomputes
  them from every live word; a device tensor is hashed in bounded host copies).
- **Delta apply, verify then commit.** :meth:`LiveWeights.apply_delta` checks
  the table and the base fingerprint, decodes every chunk against the live
  words (a segment's base range is read in place on CPU where the tensor is
  stored as the checkpoint is, copied into a per-thread scratch range out of a
  strided block, copied to the host elsewhere: one segment at a time, never a
  whole tensor) and checks that the
  changes lead to the manifest's target before anything is written. It then
  (:mod:`rollout.engines.vllm.apply.commit`) keeps an undo log (the old words at the changed positions), scatters only the
  changed words as integers (bit-exact for every pattern: NaN payloads, -0.0,
  subnormals, inf) and folds the fingerprint from the words as read from the
  live memory (host memory: one compiled pass per segment that keeps, writes
  and hashes; a device: ``index_copy_`` on integer views, then the written words
  copied back to the host and hashed). Any failure, that mismatch
  included, writes the old words back before the typed error is raised: the
  model is on its previous weights and keeps serving.
- **Snapshot load.** :meth:`LiveWeights.load_snapshot` decodes a snapshot into a
  host staging state (verified against its target), copies it into the live
  views and audits them.
- **Tensor and expert parallelism.** Given a rank group
  (:mod:`rollout.engines.vllm.apply.ranks`), each rank decodes only its slice of a delta
  (:mod:`rollout.engines.vllm.apply.slices`): the segments inside what it holds, alone,
  and the ranges it holds in part (a row-parallel weight's rows), rebuilt with the
  group first; a tensor some ranks hold whole and others not at all (an expert)
  is decoded by its holders only. Each rank writes the changes it holds, counts
  those it owns, the fingerprint sums are the group's, and every step is voted
  so that the ranks apply or refuse together.

A tensor vLLM keeps in another dtype than the checkpoint's (its placement's ``cast``,
:mod:`rollout.engines.vllm.placement.casts`) is bound through its positions; decode, fingerprint
and audit see only the checkpoint's words. Widened (a ``float32`` router of a ``bfloat16``
checkpoint): reads give the checkpoint's words back from the live ones (checked exact), writes
widen the new words as vLLM's load does. Rounded (a ``float32`` checkpoint served in
``bfloat16``): the checkpoint's words are kept in host memory beside the live ones, read at
binding from the checkpoint vLLM loaded (``checkpoint``), and every read checks that they round
to the live words (:mod:`rollout.engines.vllm.apply.kept`). Sharded over tensor-parallel ranks,
each rank keeps its own slice of those words; the ranges the ranks rebuild together are exchanged as
checkpoint words (:func:`rollout.engines.vllm.apply.slices.rebuilt`).

Parameters the model does not compute with (size-0 weights of layers whose
matmul was repacked, e.g. by oneDNN on CPU, or layers whose matmul closes over a
packed copy) are refused with :class:`UnwritableParameter` when binding: writing
into them would change nothing the model computes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from p2psync import dtypes, wordops
from p2psync.codec import segdecode, slabs
from p2psync.codec.segment import DELTA_KINDS, parse_head
from p2psync.workers import run_ordered
from p2psync.errors import CodecError, FingerprintMismatch, P2PSyncError, TensorTableMismatch, WrongBase
from p2psync.state import TensorSpec, fold_root, table_hash, tensor_seed
from rollout.engines.vllm.apply import kept as kept_words, kernels
from rollout.engines.vllm.apply.commit import Committer, np_signed, sum_add, to_host
from rollout.engines.vllm.placement.rules import LayoutError
from rollout.engines.vllm.placement.boxes import Placement
from rollout.engines.vllm.placement.casts import Cast, cast_for
from rollout.engines.vllm.placement.probe import placements
from rollout.engines.vllm.apply.ranks import RankGroup, RankRefused, Solo, together

if TYPE_CHECKING:
    import torch

    from p2psync.artifact import Manifest
    from rollout.engines.vllm.apply.stream import Streamed

logger = logging.getLogger(__name__)

_HOST_RANGE = 1 << 22
"""Elements copied to the host at a time when hashing a device tensor."""
_SIGNED = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class UnwritableParameter(P2PSyncError):
    """A vLLM parameter that the model does not compute with (repacked or size 0): writes would be lost."""


def packed_reason(layer: Any, param: Any) -> str | None:
    """Why writes to ``param`` of ``layer`` would not reach the model's matmul (None: they would)."""
    if param.numel() == 0:
        return "it has size 0 (its layer repacked the weight, e.g. into a oneDNN handle)"
    fn = getattr(layer, "cpu_linear", None)
    # vLLM's CPU dispatch installs a closure over a packed copy (oneDNN handle, sgl or zentorch
    # weights); its plain fallback is a closure-free lambda over torch's linear.
    if fn is not None and getattr(fn, "__closure__", None):
        return "its layer computes with a packed copy of it (CPU GEMM dispatch)"
    return None


class LiveWeights(Committer):
    """The trainer's tensor table bound to a vLLM model's live parameters (see module doc)."""

    def __init__(self, model: Any, specs: Sequence[TensorSpec], threads: int = 2,
                 group: RankGroup | None = None, places: dict[str, Placement] | None = None,
                 checkpoint: kept_words.Reader | None = None) -> None:
        """``checkpoint``: reads the checkpoint vLLM loaded, for the tensors it rounds at load (their
        words are kept: :mod:`rollout.engines.vllm.apply.kept`); needed only where there are such."""
        import torch

        self.group: RankGroup = group or Solo()
        """The tensor-parallel / expert-parallel ranks sharing the model (:mod:`rollout.engines.vllm.apply.ranks`)."""
        self.specs = list(specs)
        self.table_hash = table_hash(self.specs)
        self.threads = max(1, threads)
        self.cpus: set[int] | None = None
        """CPUs the helper threads run on (None: the caller's; see :mod:`rollout.engines.vllm.worker.cpus`)."""
        params = dict(model.named_parameters())
        if places is None:
            places = placements(model, self.specs, params, self.group)
        self.places: list[Placement | None] = [places.get(s.name) for s in self.specs]
        """Where this rank holds each tensor (None: nowhere, e.g. another rank's experts)."""
        self.offset: list[int | None] = []
        """Each tensor's offset in its parameter when held whole and contiguous (the fast path)."""
        self.flat: list[torch.Tensor] = []
        self.casts: list[Cast | None] = []
        """Each tensor's dtype conversion where vLLM keeps it in another dtype (a ``float32`` router
        of a ``bfloat16`` checkpoint): the live words are the converted checkpoint words; reads give
        the checkpoint's words back and writes convert (:mod:`rollout.engines.vllm.placement.casts`)."""
        for spec, place in zip(self.specs, self.places):
            if place is None:  # an empty binding of the checkpoint's word size (ranges rebuilt add none)
                self.casts.append(None)
                self.offset.append(None)
                self.flat.append(torch.empty(0, dtype=getattr(torch, _SIGNED[dtypes.from_code(spec.dtype).width])))
                continue
            p = params[place.param]
            cast = cast_for(spec.name, dtypes.from_code(spec.dtype).torch_dtype(), p.dtype)
            if (None if cast is None else cast.target) != place.cast:
                raise TensorTableMismatch(retyped=[spec.name])
            self.casts.append(cast)
            layer = model.get_submodule(place.param.rsplit(".", 1)[0]) if "." in place.param else model
            why = packed_reason(layer, p)
            if why is not None:
                raise UnwritableParameter(
                    f"{spec.name} -> vLLM parameter {place.param}: {why}; on CPU build the engine with the "
                    "p2psync plugin loaded (it keeps plain weights) or on a GPU")
            if not p.data.is_contiguous():
                raise LayoutError(f"{spec.name}: parameter {place.param} is not contiguous")
            words = p.data.reshape(-1).view(getattr(torch, _SIGNED[p.element_size()]))
            off = place.simple() if cast is None else None  # a converted tensor: through its positions
            self.offset.append(off)
            self.flat.append(words[off:off + spec.numel] if off is not None else words)
        self._roles()
        self.word_types = [dtypes.from_code(s.dtype).word for s in self.specs]
        """Each tensor's unsigned word type (the integer view the codec decodes and hashes)."""
        self.live_types = [w if c is None else c.live for w, c in zip(self.word_types, self.casts)]
        """Each tensor's unsigned live word type (its parameter's; the checkpoint's unless converted)."""
        self.device = next((f.device for f, pl in zip(self.flat, self.places) if pl is not None),
                           torch.device("cpu"))
        self.timing: dict[str, float] = {}
        """Seconds spent decoding (and checking) and committing the last delta, its changes and the
        segments this rank decoded."""
        self.decoded = 0
        """Segments this rank decoded in the last delta (its slice)."""
        self.slice_plan: tuple[Any, list[Any]] | None = None
        """The last artifact's segment index and this rank's segments of it
        (:func:`rollout.engines.vllm.apply.slices.plan` keeps it: the fetch and the decode ask for the same)."""
        self.peer_places: list[dict[int, Placement | None]] | None = None
        """Every rank's placements of the sharded tensors, by tensor (rank order; fetched with the group
        at the first update that swaps changes: :mod:`rollout.engines.vllm.apply.slices`)."""
        self.host_memory = self.device.type == "cpu"
        """The live words are in host memory: decode against them in place and write them with
        compiled loops. Else (a device) decode against a host copy of one segment's range at a time
        and write with torch's index ops."""
        self.kept: list[kept_words.Kept | None] = kept_words.load(self, checkpoint)
        """The checkpoint words of each tensor vLLM rounds at load, this rank's box of it (None for the
        others; :mod:`rollout.engines.vllm.apply.kept`)."""
        self._maps: list[tuple[int, np.ndarray, np.ndarray] | None] = []
        """Tensors held whole as one strided block (an expert in a repacked ``w13_weight``, a transposed
        weight) in host memory: ``(base, checkpoint strides, parameter strides)``. A range is copied out
        by a compiled gather, changes are written by one compiled pass that maps, keeps, writes and
        hashes (:mod:`rollout.engines.vllm.apply.kernels`)."""
        for i, pl in enumerate(self.places):
            bm = (pl.block_map() if self.host_memory and pl is not None and self.offset[i] is None
                  and self.casts[i] is None else None)
            if bm is not None and pl is not None and pl.strided(self._mem(i)) is None:
                bm = None  # the block does not lie inside its parameter: placed position by position
            self._maps.append(None if bm is None else
                              (bm[0], np.array(bm[2], dtype=np.int64), np.array(bm[3], dtype=np.int64)))
        self._scratch = threading.local()
        self.seeds = [tensor_seed(s.name) for s in self.specs]
        """Each tensor's fingerprint seed (from its name)."""
        self.sums: list[tuple[int, int]] = self._compute_sums()

    def _roles(self) -> None:
        """Which tensors are sharded over the ranks (their ranges a rank holds in part are rebuilt
        together before decoding), and a check that the ranks' counted elements add up to every
        tensor (each change is counted by the rank that owns its position)."""
        marks = "".join("0" if pl is None else "1" if pl.whole else "2" for pl in self.places)
        targets = ",".join(c.target if c is not None else "" for c in self.casts)
        counted = [pl.held if pl is not None and pl.counted else 0 for pl in self.places]
        every = [t.split("|", 1) for t in self.group.texts(f"{marks}|{targets}")]
        if self.group.size > 1:
            counted = self.group.sum_u64(counted)
        self.sharded = [any(m[k] == "2" for m, _ in every) for k in range(len(self.specs))]
        held_as = [[t for t in ts.split(",")] for _, ts in every]
        self.rebuild_casts: list[Cast | None] = []
        """The dtype conversion of each sharded tensor, as every rank knows it (also one holding none
        of it): its ranges are rebuilt with the group as checkpoint words
        (:func:`rollout.engines.vllm.apply.slices.rebuilt`)."""
        for k, spec in enumerate(self.specs):
            target = next((h[k] for h in held_as if h[k]), "") if self.sharded[k] else ""
            self.rebuild_casts.append(cast_for(spec.name, dtypes.from_code(spec.dtype).torch_dtype(), target)
                                      if target else None)
        wrong = [(s.name, c, s.numel) for s, c in zip(self.specs, counted) if c != s.numel]
        if wrong:
            name, c, n = wrong[0]
            hint = (": the parameter holds a tensor-parallel slice of it, but no rank group was given to "
                    "rebuild the rest") if self.group.size == 1 and 0 < c < n else ""
            raise LayoutError(f"{name}: {c} of its {n} elements have a place in the vLLM model (counted once "
                              f"over the ranks; {len(wrong)} tensor(s) so){hint}")

    # --- reading ------------------------------------------------------------------------
    def _mem(self, i: int) -> np.ndarray:
        """The words of tensor ``i``'s binding (its slice, or its whole parameter) as unsigned host
        live words: a view in host memory (only called there)."""
        return self.flat[i].numpy().view(self.live_types[i])

    def checkpoint_words(self, i: int, live: np.ndarray, ck: Any) -> np.ndarray:
        """Live words of tensor ``i`` (host) at checkpoint positions ``ck`` (an index array or a
        slice) as the checkpoint's words: the same words, those a conversion widened (checked
        exact), or the words kept for a rounded tensor (checked to round to ``live``)."""
        cast = self.casts[i]
        if cast is None:
            return live.view(self.word_types[i])
        if self.kept[i] is not None:
            return kept_words.words(self, i, ck, live)
        return cast.to_checkpoint(live, self.specs[i].name)

    def live_at(self, i: int, dst: np.ndarray) -> np.ndarray:
        """Unsigned host copies of the live words at positions ``dst`` of tensor ``i``'s binding."""
        if self.host_memory:
            return self._mem(i)[dst]
        import torch

        got = self.flat[i].index_select(0, torch.from_numpy(dst).to(self.device))
        return to_host(got).view(self.live_types[i])

    def live_words(self, i: int, words: np.ndarray) -> np.ndarray:
        """Checkpoint words of tensor ``i`` as the words its parameter holds for them (signed)."""
        cast = self.casts[i]
        w = np.ascontiguousarray(words) if cast is None else cast.to_live(words)
        return w.view(np_signed(w))

    def _gather(self, i: int, dst: np.ndarray, ck: Any) -> np.ndarray:
        """Unsigned host copies of the checkpoint words at positions ``dst`` of tensor ``i``'s binding
        (checkpoint positions ``ck``)."""
        return self.checkpoint_words(i, self.live_at(i, dst), ck)

    def host_words(self, i: int, start: int, stop: int) -> np.ndarray:
        """Checkpoint words ``[start, stop)`` of tensor ``i``, all held here, as unsigned host words
        (a view on CPU when stored contiguously, also where they are a slice's rows, a copy otherwise)."""
        if self.offset[i] is None:
            mp = self._maps[i] if self.host_memory else None
            if mp is not None:
                return kernels.gather_mapped(self._mem(i), start, stop, *mp,
                                                  np.empty(stop - start, dtype=self.word_types[i]))
            place = self.places[i]
            assert place is not None
            run = place.run()
            if run is not None and run[0] <= start and stop <= run[0] + run[2]:  # rows of a slice
                got = to_host(self.flat[i][run[1] + start - run[0]:run[1] + stop - run[0]])
                return self.checkpoint_words(i, got, slice(start, stop))
            ck = np.arange(start, stop, dtype=np.int64)
            which, dst = place.local(ck)
            if which.shape[0] != stop - start:
                raise LayoutError(f"{self.specs[i].name}: words [{start}, {stop}) are not all held by this rank")
            return self._gather(i, dst, ck)
        return to_host(self.flat[i][start:stop]).view(self.word_types[i])

    def _compute_sums(self) -> list[tuple[int, int]]:
        """Per-tensor sums of the element hashes of the words this rank owns, summed over the ranks."""
        def one(i: int) -> tuple[int, int]:
            place, s = self.places[i], (0, 0)
            if place is None or not place.counted:
                return s
            if self.offset[i] is not None:
                n = self.specs[i].numel
                step = n if self.host_memory else _HOST_RANGE
                for lo in range(0, n, max(1, step)):
                    s = sum_add(s, *_hash_at(self.host_words(i, lo, min(n, lo + step)), lo, self.seeds[i]))
                return s
            for ck, dst in place.chunks(_HOST_RANGE):
                a, b = wordops.hash_sparse(ck, self._gather(i, dst, ck), self.seeds[i])
                s = sum_add(s, int(a), int(b))
            return s

        held = [pl.held if pl is not None else 0 for pl in self.places]
        order = sorted(range(len(self.specs)), key=lambda i: -held[i])
        out, _, err = run_ordered(len(self.specs), order, one, self.threads, self.cpus)
        if err is not None:
            raise err
        return self.group_sums([o if o is not None else (0, 0) for o in out])

    def group_sums(self, sums: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if self.group.size == 1:
            return sums
        flat = self.group.sum_u64([v for ab in sums for v in ab])
        return [(flat[2 * k], flat[2 * k + 1]) for k in range(len(sums))]

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the live words as last computed or verified."""
        return fold_root(self.table_hash, self.sums)

    def audit(self) -> str:
        """The fingerprint recomputed from every live word (the cached sums are replaced)."""
        self.sums = self._compute_sums()
        return self.fingerprint

    def read(self, name: str, live: bool = False) -> np.ndarray:
        """A host copy of the words of checkpoint tensor ``name`` that this rank holds (unsigned, in
        checkpoint order): the checkpoint's words, or with ``live`` the parameter's words as vLLM
        computes with them (another dtype where it converts the tensor at load)."""
        i = [s.name for s in self.specs].index(name)
        place = self.places[i]
        if place is None:
            return np.empty(0, dtype=self.live_types[i] if live else self.word_types[i])
        if self.offset[i] is not None:
            return self.host_words(i, 0, self.specs[i].numel).copy()
        parts = [(ck, self.live_at(i, dst) if live else self._gather(i, dst, ck))
                 for ck, dst in place.chunks(_HOST_RANGE)]
        ck = np.concatenate([p[0] for p in parts])
        return np.concatenate([p[1] for p in parts])[np.argsort(ck, kind="stable")]

    # --- applying -----------------------------------------------------------------------
    def check_manifest(self, manifest: Manifest) -> None:
        """Raise :class:`~p2psync.errors.TensorTableMismatch` unless ``manifest``'s table is this model's."""
        from p2psync.state import check_table

        check_table(list(manifest.tensors), self.specs)

    def decode(self, manifest: Manifest, chunks: Sequence[bytes | memoryview | None]
               ) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], list[tuple[int, int]]]:
        """Decode a delta against the live words, reading only: this rank's slice of it
        (:func:`rollout.engines.vllm.apply.slices.decode`; ``chunks``: None for a chunk it does not need).

        Returns ``(changes, sums)``: tensor index -> [(positions, new words)] (one part per
        segment, in range order; positions distinct), and the per-tensor
        fingerprint sums the changes lead to (computed from the old and new words at the changed
        positions, each counted by the rank that owns it)."""
        from rollout.engines.vllm.apply import slices

        try:
            return slices.decode(self, manifest, chunks)
        finally:
            self._scratch = threading.local()  # the threads' scratch ranges are not kept between updates

    def segment_head(self, seg: memoryview) -> Any:
        """The parsed head of a delta segment, checked against the table."""
        p = parse_head(seg)
        if p.kind not in DELTA_KINDS:
            raise CodecError(f"segment kind {p.kind} does not belong in a delta")
        if p.tensor >= len(self.specs):
            raise CodecError(f"segment names tensor #{p.tensor}, table has {len(self.specs)}")
        spec = self.specs[p.tensor]
        if not 0 <= p.start <= p.stop <= spec.numel:
            raise CodecError(f"segment of {spec.name} covers [{p.start}, {p.stop}), tensor has {spec.numel}")
        assert p.raw is not None
        return p

    def decode_segment(self, p: Any, base: np.ndarray | None = None, out: slabs.Arena | None = None
                       ) -> tuple[int, tuple[int, int], np.ndarray, np.ndarray, tuple[int, int]]:
        """``(tensor, range, positions, new words, sums' change)`` of one segment, decoded against
        the live words in place (host memory, whole tensor), ``base`` (the range rebuilt from every
        rank) or a copy of the segment's range (the decoder told its origin: positions and sums'
        change are the tensor's); positions and new words cut from ``out`` (the update's
        :func:`~rollout.engines.vllm.apply.slices.outputs`) when given."""
        spec = self.specs[p.tensor]
        d, seed = dtypes.from_code(spec.dtype), np.uint64(self.seeds[p.tensor])
        if base is None and self.host_memory and self.offset[p.tensor] is not None:
            # in place; the decoder also returns the sums' change
            pos, new, ab = segdecode.decode(p.raw, p.body_at, p.start, p.stop, d,
                                            self.host_words(p.tensor, 0, spec.numel), seed, out)
            return p.tensor, (p.start, p.stop), pos, new, ab
        mp = self._maps[p.tensor] if base is None and self.host_memory else None
        if mp is not None:  # a strided block: its range copied into this thread's scratch words
            base = kernels.gather_mapped(self._mem(p.tensor), p.start, p.stop, *mp,
                                              self._scratch_words(p.stop - p.start, self.word_types[p.tensor]))
        old = self.host_words(p.tensor, p.start, p.stop) if base is None else base
        pos, new, ab = segdecode.decode(p.raw, p.body_at, p.start, p.stop, d, old, seed, out, origin=p.start)
        return p.tensor, (p.start, p.stop), pos, new, ab

    def _scratch_words(self, n: int, word: Any) -> np.ndarray:
        """``n`` words of type ``word`` kept by the calling thread for its next segment of this update
        (no page faults of fresh memory per segment); valid until its next call."""
        have = getattr(self._scratch, "words", None)
        if have is None or have.dtype != word or have.shape[0] < n:
            have = self._scratch.words = np.empty(max(n, 1 << 16), dtype=word)
        return have[:n]

    def apply_delta(self, manifest: Manifest, chunks: Sequence[bytes | memoryview | None],
                    streamed: Streamed | None = None) -> str:
        """Decode, check, write, check again; all or nothing, on every rank (see module doc).

        ``streamed``: the chunks were already decoded as they arrived
        (:mod:`rollout.engines.vllm.apply.stream`); its changes are checked and committed the same way."""
        t0 = time.perf_counter()

        def planned() -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
            changes, sums = self.decode(manifest, chunks) if streamed is None else streamed.finish()
            got = fold_root(self.table_hash, sums)
            if got != manifest.target_fingerprint:
                raise FingerprintMismatch(manifest.target_fingerprint, got)
            return changes

        changes = together(self.group, planned, "another tensor-parallel rank refused the delta")
        t1 = time.perf_counter()
        fp = self.commit(changes, manifest.target_fingerprint)
        self.timing = {"decode_s": round(t1 - t0, 4), "commit_s": round(time.perf_counter() - t1, 4),
                       "changes": sum(p[0].shape[0] for parts in changes.values() for p in parts),
                       "segments_decoded": self.decoded}
        if streamed is not None:  # decode_s: what was left after the last chunk arrived
            self.timing.update(overlapped=True, decode_busy_s=round(streamed.busy_s, 4))
        return fp

    def load_snapshot(self, manifest: Manifest, chunks: Sequence[bytes | memoryview]) -> str:
        """Write a verified snapshot into every live word; returns the audited fingerprint."""
        import torch

        from p2psync.codec.decode import decode_state

        self.check_manifest(manifest)
        if manifest.kind != "snapshot":
            raise CodecError(f"expected a snapshot, got a {manifest.kind}")
        staged = together(self.group, lambda: decode_state(list(manifest.tensors), enumerate(chunks),
                                                           len(manifest.chunks), manifest.target_fingerprint,
                                                           self.threads),
                          "another tensor-parallel rank refused the snapshot")
        for i, spec in enumerate(self.specs):
            w, place = staged.words(spec.name), self.places[i]
            if place is None:
                continue
            if self.offset[i] is not None:
                self.flat[i].copy_(torch.from_numpy(w.view(np_signed(w))).to(self.device))
                continue
            kept = self.kept[i]
            for ck, dst in place.chunks(_HOST_RANGE):
                self.flat[i].index_copy_(0, torch.from_numpy(dst).to(self.device),
                                         torch.from_numpy(self.live_words(i, w[ck])).to(self.device))
                if kept is not None:  # a rounded tensor: its checkpoint words kept beside the live ones
                    kept.put(ck, w[ck])
        got = self.audit()
        if got != manifest.target_fingerprint:
            raise FingerprintMismatch(manifest.target_fingerprint, got)
        return got


def _hash_at(words: np.ndarray, offset: int, seed: np.uint64) -> tuple[int, int]:
    """Hash lanes of ``words`` standing at positions ``offset...`` of their tensor."""
    if offset == 0:
        a, b = wordops.hash_range(words, 0, words.shape[0], seed)
    else:
        a, b = wordops.hash_sparse(np.arange(offset, offset + words.shape[0], dtype=np.int64), words, seed)
    return int(a), int(b)
