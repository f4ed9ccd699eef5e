"""A vLLM model's live parameters seen as the trainer's checkpoint tensors, and artifacts applied to them.

:class:`LiveWeights` binds every tensor of the trainer's table to the slice of
a vLLM parameter that holds it (:mod:`rollout.engines.vllm_layout`) as a flat
integer view of the raw bits: same memory, on the parameter's own device. Then:

- **Fingerprint.** The per-tensor sums of element hashes of
  :mod:`p2psync.state` over those views (:meth:`LiveWeights.audit` recomputes
  them from every live word; a device tensor is hashed in bounded host copies).
- **Delta apply, verify then commit.** :meth:`LiveWeights.apply_delta` checks
  the table and the base fingerprint, decodes every chunk against the live
  words (a segment's base range is read in place on CPU, copied to the host
  elsewhere: one segment at a time, never a whole tensor) and checks that the
  changes lead to the manifest's target before anything is written. It then
  keeps an undo log (the old words at the changed positions), scatters only the
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

Parameters the model does not compute with (size-0 weights of layers whose
matmul was repacked, e.g. by oneDNN on CPU, or layers whose matmul closes over a
packed copy) are refused with :class:`UnwritableParameter` when binding: writing
into them would change nothing the model computes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from p2psync import dtypes, wordops
from p2psync.codec import segdecode
from p2psync.codec.decode import split_chunk
from p2psync.codec.segment import KIND_DELTA, parse_head
from p2psync.workers import run_ordered
from p2psync.errors import CodecError, FingerprintMismatch, P2PSyncError, TensorTableMismatch, WrongBase
from p2psync.state import TensorSpec, fold_root, table_hash, tensor_seed
from rollout.engines.vllm_layout import LayoutError, Piece, check_piece, place

if TYPE_CHECKING:
    import torch

    from p2psync.artifact import Manifest

logger = logging.getLogger(__name__)

MASK64 = 0xFFFFFFFFFFFFFFFF
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


def _sum_add(s: tuple[int, int], a: int, b: int, sign: int = 1) -> tuple[int, int]:
    return ((s[0] + sign * int(a)) & MASK64, (s[1] + sign * int(b)) & MASK64)


class LiveWeights:
    """The trainer's tensor table bound to a vLLM model's live parameters (see module doc)."""

    def __init__(self, model: Any, specs: Sequence[TensorSpec], threads: int = 2) -> None:
        import torch

        self.specs = list(specs)
        self.table_hash = table_hash(self.specs)
        self.threads = max(1, threads)
        params = dict(model.named_parameters())
        self.pieces: list[Piece] = []
        self.flat: list[torch.Tensor] = []
        unknown: list[str] = []
        for spec in self.specs:
            try:
                piece = place(model, spec.name, spec.shape, params)
            except LayoutError:
                unknown.append(spec.name)
                continue
            p = params[piece.param]
            want = dtypes.from_code(spec.dtype).torch_dtype()
            if p.dtype != want:
                raise TensorTableMismatch(retyped=[spec.name])
            layer = model.get_submodule(piece.param.rsplit(".", 1)[0]) if "." in piece.param else model
            why = packed_reason(layer, p)
            if why is not None:
                raise UnwritableParameter(
                    f"{spec.name} -> vLLM parameter {piece.param}: {why}; on CPU build the engine with the "
                    "p2psync plugin loaded (it keeps plain weights) or on a GPU")
            check_piece(piece, tuple(p.shape))
            if not piece.whole:
                raise LayoutError(f"{spec.name}: this rank holds a tensor-parallel slice; decoding a delta "
                                  "needs every base word of a tensor, so only tensor_parallel_size=1 is supported")
            nrows = piece.rows[1] - piece.rows[0]
            rows = p.data[piece.at_row:piece.at_row + nrows]
            if not rows.is_contiguous():
                raise LayoutError(f"{spec.name}: the rows of {piece.param} that hold it are not contiguous")
            signed = getattr(torch, _SIGNED[p.element_size()])
            self.pieces.append(piece)
            self.flat.append(rows.reshape(-1).view(signed))
        if unknown:
            raise TensorTableMismatch(unknown=unknown)
        self.device = self.flat[0].device if self.flat else torch.device("cpu")
        self.timing: dict[str, float] = {}
        """Seconds spent decoding (and checking) and committing the last delta, and its changes."""
        self.host_memory = self.device.type == "cpu"
        """The live words are in host memory: decode against them in place and write them with
        compiled loops. Else (a device) decode against a host copy of one segment's range at a time
        and write with torch's index ops."""
        self._words = [dtypes.from_code(s.dtype).word for s in self.specs]
        self._seeds = [tensor_seed(s.name) for s in self.specs]
        self.sums: list[tuple[int, int]] = self._compute_sums()

    # --- reading ------------------------------------------------------------------------
    def host_words(self, i: int, start: int, stop: int) -> np.ndarray:
        """Words ``[start, stop)`` of tensor ``i`` as unsigned host words (a view on CPU, a copy elsewhere)."""
        part = self.flat[i][start:stop]
        if part.device.type != "cpu":
            part = part.cpu()
        return part.numpy().view(self._words[i])

    def _compute_sums(self) -> list[tuple[int, int]]:
        def one(i: int) -> tuple[int, int]:
            n = self.flat[i].numel()
            s = (0, 0)
            step = n if self.device.type == "cpu" else _HOST_RANGE
            for lo in range(0, n, max(1, step)):
                hi = min(n, lo + step)
                a, b = _hash_at(self.host_words(i, lo, hi), lo, self._seeds[i])
                s = _sum_add(s, a, b)
            return s

        order = sorted(range(len(self.specs)), key=lambda i: -self.flat[i].numel())
        out, _, err = run_ordered(len(self.specs), order, one, self.threads)
        if err is not None:
            raise err
        return [o for o in out if o is not None]

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the live words as last computed or verified."""
        return fold_root(self.table_hash, self.sums)

    def audit(self) -> str:
        """The fingerprint recomputed from every live word (the cached sums are replaced)."""
        self.sums = self._compute_sums()
        return self.fingerprint

    def read(self, name: str) -> np.ndarray:
        """A host copy of checkpoint tensor ``name``'s live words (unsigned)."""
        i = [s.name for s in self.specs].index(name)
        return self.host_words(i, 0, self.flat[i].numel()).copy()

    # --- applying -----------------------------------------------------------------------
    def _check(self, manifest: Manifest) -> None:
        from p2psync.state import check_table

        check_table(list(manifest.tensors), self.specs)

    def decode(self, manifest: Manifest, chunks: Sequence[bytes | memoryview]
               ) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], list[tuple[int, int]]]:
        """Decode a delta against the live words, reading only.

        Returns ``(changes, sums)``: tensor index -> [(positions, new words)] (one part per
        segment, in range order; positions distinct), and the per-tensor
        fingerprint sums the changes lead to (computed from the old and new words at the changed
        positions)."""
        self._check(manifest)
        if manifest.kind != "delta":
            raise CodecError(f"expected a delta, got a {manifest.kind}")
        if self.fingerprint != manifest.base_fingerprint:
            raise WrongBase(str(manifest.base_fingerprint), self.fingerprint, manifest.base_version)
        if len(chunks) != len(manifest.chunks):
            raise CodecError(f"{len(chunks)} of {len(manifest.chunks)} chunks given")
        segs = [seg for c in chunks for seg in split_chunk(c)]
        on_host = self.host_memory

        def one(k: int) -> tuple[int, tuple[int, int], np.ndarray, np.ndarray, tuple[int, int]]:
            p = parse_head(segs[k])
            if p.kind != KIND_DELTA:
                raise CodecError(f"segment kind {p.kind} does not belong in a delta")
            if p.tensor >= len(self.specs):
                raise CodecError(f"segment names tensor #{p.tensor}, table has {len(self.specs)}")
            spec = self.specs[p.tensor]
            if not 0 <= p.start <= p.stop <= spec.numel:
                raise CodecError(f"segment of {spec.name} covers [{p.start}, {p.stop}), tensor has {spec.numel}")
            assert p.raw is not None
            d, seed = dtypes.from_code(spec.dtype), np.uint64(self._seeds[p.tensor])
            if on_host:  # the live words themselves; the decoder also returns the sums' change
                pos, new, ab = segdecode.decode(p.raw, p.body_at, p.start, p.stop, d,
                                                self.host_words(p.tensor, 0, spec.numel), seed)
                return p.tensor, (p.start, p.stop), pos, new, ab
            # Off the host: a copy of this segment's range only (positions relative to it).
            old = self.host_words(p.tensor, p.start, p.stop)
            rel, new, _ = segdecode.decode(p.raw, p.body_at, 0, p.stop - p.start, d, old, seed)
            pos = rel + p.start
            oa, ob = wordops.hash_sparse(pos, old[rel], seed)
            na, nb = wordops.hash_sparse(pos, new, seed)
            return p.tensor, (p.start, p.stop), pos, new, ((int(na) - int(oa)) & MASK64, (int(nb) - int(ob)) & MASK64)

        order = sorted(range(len(segs)), key=lambda k: -len(segs[k]))
        out, _, err = run_ordered(len(segs), order, one, min(self.threads, max(1, len(segs))))
        if err is not None:
            raise err
        by: dict[int, list[tuple[tuple[int, int], np.ndarray, np.ndarray]]] = {}
        sums = list(self.sums)
        for t, span, pos, new, (da, db) in (o for o in out if o is not None):
            by.setdefault(t, []).append((span, pos, new))
            sums[t] = _sum_add(sums[t], da, db)
        changes: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for t, parts in by.items():
            parts.sort(key=lambda x: x[0])
            for x, y in zip(parts, parts[1:]):
                if y[0][0] < x[0][1]:  # positions are distinct inside a segment; segments must not overlap
                    raise CodecError(f"segments of {self.specs[t].name} overlap")
            # One part per segment, not concatenated: no second copy of the changes.
            changes[t] = [(pos.astype(np.int64, copy=False), new) for _, pos, new in parts]
        return changes, sums

    def apply_delta(self, manifest: Manifest, chunks: Sequence[bytes | memoryview]) -> str:
        """Decode, check, write, read back and check again; all or nothing (see module doc)."""
        t0 = time.perf_counter()
        changes, sums = self.decode(manifest, chunks)
        planned = fold_root(self.table_hash, sums)
        if planned != manifest.target_fingerprint:
            raise FingerprintMismatch(manifest.target_fingerprint, planned)
        t1 = time.perf_counter()
        fp = self.commit(changes, manifest.target_fingerprint)
        self.timing = {"decode_s": round(t1 - t0, 4), "commit_s": round(time.perf_counter() - t1, 4),
                       "changes": sum(p[0].shape[0] for parts in changes.values() for p in parts)}
        return fp

    def commit(self, changes: dict[int, list[tuple[np.ndarray, np.ndarray]]], target: str) -> str:
        """Scatter ``changes`` with an undo log; keep them only if the live words hash to ``target``.

        Parts are written on ``threads`` threads. In host memory one compiled pass per part keeps
        the old word, stores the new one and hashes both as read from the live words
        (:func:`p2psync.wordops.scatter_logged`). On a device, torch's index ops keep the old words,
        write, and read the written words back to the host to be hashed."""
        items = [(t, part) for t, parts in changes.items() for part in parts]
        undo: list[Any] = [None] * len(items)
        lanes: list[tuple[int, int] | None] = [None] * len(items)
        write = self._write_host if self.host_memory else self._write_device
        order = sorted(range(len(items)), key=lambda j: -items[j][1][0].shape[0])
        try:
            _, _, err = run_ordered(len(items), order, lambda j: write(j, items[j], undo, lanes),
                                    min(self.threads, max(1, len(items))))
            if err is not None:
                raise err
            sums = list(self.sums)
            for (t, _), ln in zip(items, lanes):
                assert ln is not None
                sums[t] = _sum_add(sums[t], ln[0], ln[1])
            got = fold_root(self.table_hash, sums)
            if got != target:
                raise FingerprintMismatch(target, got)
        except BaseException:
            self._undo(items, undo)
            raise
        self.sums = sums
        return got

    def _write_host(self, j: int, item: tuple[int, tuple[np.ndarray, np.ndarray]], undo: list[Any],
                    lanes: list[tuple[int, int] | None]) -> None:
        t, (pos, new) = item
        words = self.host_words(t, 0, self.specs[t].numel)
        old = np.empty_like(words, shape=new.shape)
        undo[j] = old  # set before the write: a failure part-way is taken back whole
        a, b = wordops.scatter_logged(words, pos, np.ascontiguousarray(new).view(words.dtype), old,
                                      np.uint64(self._seeds[t]))
        lanes[j] = (int(a), int(b))

    def _write_device(self, j: int, item: tuple[int, tuple[np.ndarray, np.ndarray]], undo: list[Any],
                      lanes: list[tuple[int, int] | None]) -> None:
        import torch

        t, (pos, new) = item
        flat = self.flat[t]
        idx = torch.from_numpy(pos).to(self.device)
        old = flat.index_select(0, idx)
        undo[j] = (idx, old)
        flat.index_copy_(0, idx, torch.from_numpy(np.ascontiguousarray(new).view(_np_signed(new))).to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        back = _to_host(flat.index_select(0, idx)).view(self._words[t])
        a, b = wordops.hash_change(pos, _to_host(old).view(self._words[t]), back, np.uint64(self._seeds[t]))
        lanes[j] = (int(a), int(b))

    def _undo(self, items: list[tuple[int, tuple[np.ndarray, np.ndarray]]], undo: list[Any]) -> None:
        """Write back the old words of every part that was (or may have been) written."""
        for (t, (pos, _)), entry in zip(items, undo):
            if entry is None:
                continue
            if isinstance(entry, np.ndarray):
                wordops.scatter(self.host_words(t, 0, self.specs[t].numel), pos, entry)
            else:
                idx, old = entry
                self.flat[t].index_copy_(0, idx, old)

    def load_snapshot(self, manifest: Manifest, chunks: Sequence[bytes | memoryview]) -> str:
        """Write a verified snapshot into every live word; returns the audited fingerprint."""
        import torch

        from p2psync.codec.decode import decode_state

        self._check(manifest)
        if manifest.kind != "snapshot":
            raise CodecError(f"expected a snapshot, got a {manifest.kind}")
        staged = decode_state(list(manifest.tensors), enumerate(chunks), len(manifest.chunks),
                              manifest.target_fingerprint, self.threads)
        for i, spec in enumerate(self.specs):
            w = staged.words(spec.name)
            self.flat[i].copy_(torch.from_numpy(w.view(_np_signed(w))).to(self.device))
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


def _np_signed(a: np.ndarray) -> type:
    return {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]


def _to_host(t: Any) -> np.ndarray:
    return (t.cpu() if t.device.type != "cpu" else t).numpy()
