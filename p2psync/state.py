"""A model state: an ordered table of tensors, viewed as raw words, with its fingerprint.

The fingerprint is what every node compares to know it holds exactly the
trainer's bits. Per tensor it is a pair of 64-bit sums of element hashes
``h(tensor, position, word)``; the root folds the table hash and every tensor's
sums with xxh3-128. Because the per-tensor value is a sum, a delta updates it
by subtracting the hashes of the old words and adding those of the new ones,
in time proportional to the changed elements; :meth:`ModelState.audit`
recomputes it from every element.

This is an integrity check against accidents (bugs, wrong bases, bit rot), not
a cryptographic commitment: authenticity comes from the signed manifest and its
per-chunk hashes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from p2psync import dtypes
from p2psync import wordops
from p2psync.workers import run_ordered
from p2psync.errors import TensorTableMismatch

if TYPE_CHECKING:
    import torch

# Fingerprints hash in ranges of this many elements so that threads can share a tensor.
_HASH_RANGE = 1 << 24


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    """safetensors dtype code."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.from_code(self.dtype).width

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape)]


def table_hash(specs: Iterable[TensorSpec]) -> str:
    """xxh3-128 of the canonical tensor table (order matters)."""
    text = json.dumps([s.to_json() for s in specs], separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_hexdigest(text.encode())


@functools.lru_cache(maxsize=4096)
def tensor_seed(name: str) -> np.uint64:
    """The per-tensor seed of the element hashes (cached: decoding asks once per segment)."""
    return np.uint64(xxhash.xxh3_64_intdigest(name.encode(), seed=0x5032505359))


def check_table(expected: list[TensorSpec], actual: list[TensorSpec]) -> None:
    """Raise :class:`TensorTableMismatch` naming every difference, or return."""
    if expected == actual:
        return
    exp = {s.name: s for s in expected}
    act = {s.name: s for s in actual}
    unknown = [n for n in exp if n not in act]
    missing = [n for n in act if n not in exp]
    reshaped = [n for n in exp if n in act and exp[n].shape != act[n].shape]
    retyped = [n for n in exp if n in act and exp[n].dtype != act[n].dtype]
    raise TensorTableMismatch(unknown=unknown, missing=missing, reshaped=reshaped, retyped=retyped)


def fold_root(thash: str, sums: Iterable[tuple[int, int]]) -> str:
    h = xxhash.xxh3_128(bytes.fromhex(thash))
    buf = bytearray()
    for a, b in sums:
        buf += int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")
    h.update(bytes(buf))
    return h.hexdigest()


def hash_words(words: np.ndarray, seed: np.uint64, pool: ThreadPoolExecutor | None = None) -> tuple[int, int]:
    n = words.shape[0]
    ranges = [(s, min(n, s + _HASH_RANGE)) for s in range(0, n, _HASH_RANGE)] or [(0, 0)]
    if pool is None or len(ranges) == 1:
        parts = [wordops.hash_range(words, s, e, seed) for s, e in ranges]
    else:
        parts = list(pool.map(lambda r: wordops.hash_range(words, r[0], r[1], seed), ranges))
    a = sum(int(p[0]) for p in parts) & 0xFFFFFFFFFFFFFFFF
    b = sum(int(p[1]) for p in parts) & 0xFFFFFFFFFFFFFFFF
    return a, b


_THREADED_CHANGES = 1 << 18
"""Fewer changes than this are written on the calling thread (:meth:`ModelState.apply_parts`)."""

class ModelState:
    """An ordered table of contiguous CPU tensors and its incrementally maintained fingerprint.

    Contract: ``fingerprint`` always describes the current bits of the tensors, as long
    as they are changed only through :meth:`apply_sparse` (the codec's apply path) or
    followed by :meth:`invalidate`.
    """

    def __init__(self, tensors: Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]):
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        self._tensors: dict[str, "torch.Tensor"] = {}
        self._words: dict[str, np.ndarray] = {}
        specs = []
        for name, t in items:
            if name in self._tensors:
                raise ValueError(f"duplicate tensor name {name!r}")
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            self._tensors[name] = t
            self._words[name] = dtypes.words_of(t)
            specs.append(TensorSpec(name, dtypes.from_torch(t.dtype).code, tuple(int(s) for s in t.shape)))
        self.specs: list[TensorSpec] = specs
        self.index: dict[str, int] = {s.name: i for i, s in enumerate(specs)}
        self.table_hash = table_hash(specs)
        self._sums: list[tuple[int, int]] | None = None

    # --- access -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def tensor(self, name: str) -> "torch.Tensor":
        return self._tensors[name]

    def words(self, name: str) -> np.ndarray:
        return self._words[name]

    def tensors(self) -> dict[str, "torch.Tensor"]:
        return dict(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    # --- fingerprint --------------------------------------------------------------------
    def _compute_sums(self, threads: int) -> list[tuple[int, int]]:
        # One list of hash ranges over every tensor, longest first, on the calling thread and
        # ``threads - 1`` helpers (no pool per call; a small tensor does not wait for a big one).
        ranges = [(k, s, min(spec.numel, s + _HASH_RANGE)) for k, spec in enumerate(self.specs)
                  for s in range(0, spec.numel, _HASH_RANGE)]
        words = [self._words[spec.name] for spec in self.specs]
        seeds = [tensor_seed(spec.name) for spec in self.specs]

        def part(j: int) -> tuple[int, int]:
            k, s, e = ranges[j]
            return wordops.hash_range(words[k], s, e, seeds[k])

        order = sorted(range(len(ranges)), key=lambda j: ranges[j][1] - ranges[j][2])
        parts, _, error = run_ordered(len(ranges), order, part, max(1, threads))
        if error is not None:
            raise error
        sums = [[0, 0] for _ in self.specs]
        for (k, _, _), got in zip(ranges, parts):
            assert got is not None  # no error: every item ran
            a, b = got
            sums[k][0] += int(a)
            sums[k][1] += int(b)
        return [(a & 0xFFFFFFFFFFFFFFFF, b & 0xFFFFFFFFFFFFFFFF) for a, b in sums]

    def tensor_sums(self, threads: int = 2) -> list[tuple[int, int]]:
        if self._sums is None:
            self._sums = self._compute_sums(threads)
        return list(self._sums)

    @property
    def fingerprint(self) -> str:
        return fold_root(self.table_hash, self.tensor_sums())

    def audit(self, threads: int = 2) -> str:
        """Recompute the fingerprint from every element (ignores the cached sums)."""
        return fold_root(self.table_hash, self._compute_sums(threads))

    def invalidate(self) -> None:
        """Forget the cached fingerprint after the tensors were changed behind our back."""
        self._sums = None

    def updated_sums(self, changes: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, int]]:
        """Per-tensor sums after replacing the words at the given positions.

        ``changes[i] = (positions, new_words)`` for tensor index ``i``; the state is not touched.
        """
        sums = self.tensor_sums()
        for i, (pos, new) in changes.items():
            spec = self.specs[i]
            seed = tensor_seed(spec.name)
            old = self._words[spec.name][pos]
            oa, ob = wordops.hash_sparse(pos, old, seed)
            na, nb = wordops.hash_sparse(pos, new, seed)
            a, b = sums[i]
            sums[i] = ((a - int(oa) + int(na)) & 0xFFFFFFFFFFFFFFFF, (b - int(ob) + int(nb)) & 0xFFFFFFFFFFFFFFFF)
        return sums

    def apply_sparse(
        self, changes: Mapping[int, tuple[np.ndarray, np.ndarray]], sums: list[tuple[int, int]] | None = None,
        threads: int = 1,
    ) -> None:
        """Write the new words in place and adopt ``sums`` (from :meth:`updated_sums`)."""
        if sums is None:
            sums = self.updated_sums(changes)
        self.apply_parts([(i, pos, new) for i, (pos, new) in changes.items()], sums, threads)

    def apply_parts(self, parts: Iterable[tuple[int, np.ndarray, np.ndarray]], sums: list[tuple[int, int]],
                    threads: int = 1, *, in_range: bool = False) -> None:
        """Like :meth:`apply_sparse` with the changes as ``(tensor index, positions, new words)``
        parts, several of which may name one tensor (e.g. one per decoded segment: no
        concatenation). With ``threads`` > 1 the parts are written on that many threads (the
        scatter releases the GIL; it is memory-bound, about one cache line per change).

        ``in_range=True`` declares that every position is already known to lie in its tensor
        (the decoder's positions: each segment's lie in its checked range), which skips a pass
        over them on the calling thread (~1.3 ms for 1.4 M changes) before the threads start."""
        jobs = []
        for i, pos, new in parts:
            words = self._words[self.specs[i].name]
            pos = np.asarray(pos)
            new = np.asarray(new)
            if pos.dtype == np.int64 and new.dtype == words.dtype and pos.shape == new.shape and pos.ndim == 1 \
                    and (in_range or wordops.in_range(pos, words.shape[0])):
                jobs.append((words, pos, new))
            else:
                words[pos] = new
        jobs.sort(key=lambda j: -j[1].shape[0])  # biggest first: the threads finish together
        # A pool per call costs thread starts and joins (~0.5 ms, more under load): worth it only when
        # the scatter is long (about a nanosecond per change).
        if threads <= 1 or len(jobs) <= 1 or sum(j[1].shape[0] for j in jobs) < _THREADED_CHANGES:
            for words, pos, new in jobs:
                wordops.scatter(words, pos, new)
        else:
            _, _, error = run_ordered(len(jobs), range(len(jobs)), lambda k: wordops.scatter(*jobs[k]),
                                      min(threads, len(jobs)))
            if error is not None:
                raise error
        self._sums = sums

    def clone(self) -> "ModelState":
        """A copy of the raw words (torch's own clone would normalise e.g. bool bytes)."""
        c = ModelState.empty_like(self.specs)
        for name, w in self._words.items():
            c._words[name][:] = w
        c._sums = None if self._sums is None else list(self._sums)
        return c

    @classmethod
    def empty_like(cls, specs: list[TensorSpec]) -> "ModelState":
        import torch

        return cls((s.name, torch.empty(s.shape, dtype=dtypes.from_code(s.dtype).torch_dtype())) for s in specs)
