"""Writing a decoded delta into a vLLM model's live words: undo-logged, fingerprinted, all or nothing.

:class:`Committer` is the writing half of
:class:`~rollout.engines.vllm.apply.weights.LiveWeights` (which binds the table,
reads and decodes): it scatters only the changed words, keeps the old ones,
folds the fingerprint from the words as read back from the live memory, and
writes the old words back when the result is not the manifest's target or any
rank failed. Host memory: one compiled pass per part (a tensor stored
contiguously: :func:`p2psync.wordops.scatter_logged`; one held as a strided
block: :func:`rollout.engines.vllm.apply.kernels.scatter_mapped_logged`; others: the
placement's positions, then a gather and a hash). A device: torch's index ops.

A tensor vLLM rounds at load (its checkpoint words kept beside the live ones,
:mod:`rollout.engines.vllm.apply.kept`) is written in both: the rounded new words into
the parameter, checked as read back, the new words into the kept copy; it is hashed
from the kept words, and its undo restores both.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from p2psync import wordops
from p2psync.codec import slabs
from p2psync.errors import FingerprintMismatch
from p2psync.state import fold_root
from p2psync.workers import run_ordered
from rollout.engines.vllm.apply import kernels
from rollout.engines.vllm.apply.ranks import RankGroup, RankRefused
from rollout.engines.vllm.placement.rules import LayoutError

if TYPE_CHECKING:
    import torch

    from rollout.engines.vllm.apply.kept import Kept
    from rollout.engines.vllm.placement.boxes import Placement

MASK64 = 0xFFFFFFFFFFFFFFFF
Item = tuple[int, "np.ndarray | None", np.ndarray, np.ndarray]
"""A part of a delta to write: ``(tensor, local positions or None, checkpoint positions, new words)``."""


def sum_add(s: tuple[int, int], a: int, b: int) -> tuple[int, int]:
    return ((s[0] + int(a)) & MASK64, (s[1] + int(b)) & MASK64)


def np_signed(a: np.ndarray) -> type:
    return {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]


def to_host(t: Any) -> np.ndarray:
    return (t.cpu() if t.device.type != "cpu" else t).numpy()


class Committer:
    """The write path of :class:`~rollout.engines.vllm.apply.weights.LiveWeights` (module doc)."""

    group: RankGroup
    specs: list[Any]
    table_hash: str
    threads: int
    cpus: set[int] | None
    places: list[Placement | None]
    offset: list[int | None]
    flat: list[torch.Tensor]
    device: Any
    host_memory: bool
    sums: list[tuple[int, int]]
    word_types: list[Any]
    kept: list[Kept | None]
    casts: list[Any]
    seeds: list[Any]
    _maps: list[tuple[int, np.ndarray, np.ndarray] | None]

    def _mem(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def checkpoint_words(self, i: int, live: np.ndarray, ck: Any) -> np.ndarray:
        raise NotImplementedError

    def live_words(self, i: int, words: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def group_sums(self, sums: list[tuple[int, int]]) -> list[tuple[int, int]]:
        raise NotImplementedError

    def commit(self, changes: dict[int, list[tuple[np.ndarray, np.ndarray]]], target: str) -> str:
        """Scatter ``changes`` with an undo log; keep them only if the live words hash to ``target``.

        Parts are written on ``threads`` threads. In host memory one compiled pass per part keeps
        the old word, stores the new one and hashes both as read from the live words
        (:func:`p2psync.wordops.scatter_logged`). On a device, torch's index ops keep the old words,
        write, and read the written words back to the host to be hashed. With tensor parallelism
        each rank writes the changes its pieces hold, hashes those it owns, and the ranks sum the
        lanes and vote: one rank's failure takes every rank's writes back."""
        items = self._local_parts(changes)
        undo: list[Any] = [None] * len(items)
        lanes: list[tuple[int, int] | None] = [None] * len(items)
        # The undo log (a word per change, dropped with this update) in memory of its own: huge
        # pages where the kernel gives them, instead of fresh 4 KiB pages in a new process.
        arena = slabs.Arena(fresh=True)
        write = functools.partial(self._write_host, arena=arena) if self.host_memory else self._write_device
        order = sorted(range(len(items)), key=lambda j: -items[j][2].shape[0])
        failed: BaseException | None = None
        try:
            _, _, failed = run_ordered(len(items), order, lambda j: write(j, items[j], undo, lanes),
                                       min(self.threads, max(1, len(items))), self.cpus)
        except BaseException as exc:
            failed = exc
        if not self.group.all_true(failed is None):
            self._undo(items, undo)
            raise failed or RankRefused("another tensor-parallel rank could not write the delta")
        delta = [(0, 0)] * len(self.specs)
        for (t, *_), ln in zip(items, lanes):
            assert ln is not None
            delta[t] = sum_add(delta[t], ln[0], ln[1])
        sums = [sum_add(a, *d) for a, d in zip(self.sums, self.group_sums(delta))]
        got = fold_root(self.table_hash, sums)  # the same on every rank
        if got != target:
            self._undo(items, undo)
            raise FingerprintMismatch(target, got)
        self.sums = sums
        return got

    def _local_parts(self, changes: dict[int, list[tuple[np.ndarray, np.ndarray]]]
                     ) -> list[Item]:
        """``(tensor, local positions, global positions, new words)`` of the changes this rank holds
        (local None: a strided block, mapped while written)."""
        items: list[Item] = []
        for t, parts in changes.items():
            place = self.places[t]
            if place is None:
                continue
            mapped = self.host_memory and self._maps[t] is not None
            for pos, new in parts:
                if self.offset[t] is not None:
                    items.append((t, pos, pos, new))
                    continue
                if mapped:  # mapped while written (:func:`kernels.scatter_mapped_logged`)
                    items.append((t, None, pos, new))
                    continue
                which, local = place.local(pos)
                if which.shape[0] == pos.shape[0]:
                    items.append((t, local, pos, new))
                elif which.shape[0]:
                    items.append((t, local, pos[which], new[which]))
        return items

    def _write_host(self, j: int, item: Item, undo: list[Any],
                    lanes: list[tuple[int, int] | None], arena: slabs.Arena) -> None:
        t, local, glob, new = item
        words = self._mem(t)
        new = self.live_words(t, new).view(words.dtype)  # converted where vLLM keeps another dtype
        seed = np.uint64(self.seeds[t])
        if local is None:  # a strided block: map, keep, write, hash in one pass
            mp = self._maps[t]
            assert mp is not None
            base, cstr, dstr = mp
            old = arena.array(new.shape[0], words.dtype)
            undo[j] = old
            a, b = kernels.scatter_mapped_logged(words, glob, new, old, seed, base, cstr, dstr)
        elif local is glob:  # one pass: keep, write, hash
            old = arena.array(new.shape[0], words.dtype)
            undo[j] = old  # set before the write: a failure part-way is taken back whole
            a, b = wordops.scatter_logged(words, local, new, old, seed)
        elif (kept := self.kept[t]) is not None:  # rounded at load: written in the live and the kept words
            old = words[local]
            before = self.checkpoint_words(t, old, glob)  # a copy, checked against the live words
            undo[j] = (old, before)
            wordops.scatter(words, local, new)
            self._keep(t, glob, item[3], words[local], new)
            a, b = wordops.hash_change(glob, before, kept.at(glob), seed)
        else:  # mapped (positions in memory are not the hashed ones) or converted: hashed as checkpoint words
            old = words[local]
            undo[j] = old
            wordops.scatter(words, local, new)
            a, b = wordops.hash_change(glob, self.checkpoint_words(t, old, glob),
                                       self.checkpoint_words(t, words[local], glob), seed)
        lanes[j] = (int(a), int(b)) if self.counts(t) else (0, 0)

    def counts(self, t: int) -> bool:
        """Whether this rank's words of tensor ``t`` count towards the fingerprint (it holds some, and
        no lower rank holds the same copy)."""
        place = self.places[t]
        return place is not None and place.counted

    def _write_device(self, j: int, item: Item, undo: list[Any],
                      lanes: list[tuple[int, int] | None]) -> None:
        import torch

        t, local, glob, new = item
        assert local is not None  # strided blocks are mapped while written in host memory only
        flat = self.flat[t]
        idx = torch.from_numpy(local).to(self.device)
        old = flat.index_select(0, idx)
        kept = self.kept[t]
        before = self.checkpoint_words(t, to_host(old), glob) if kept is not None else None
        undo[j] = (idx, old, before)
        live_new = self.live_words(t, new)
        flat.index_copy_(0, idx, torch.from_numpy(live_new).to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        written = to_host(flat.index_select(0, idx))
        if kept is not None and before is not None:  # rounded at load: the kept words take the new ones
            self._keep(t, glob, new, written, live_new)
            a, b = wordops.hash_change(glob, before, kept.at(glob), np.uint64(self.seeds[t]))
        else:
            a, b = wordops.hash_change(glob, self.checkpoint_words(t, to_host(old), glob),
                                       self.checkpoint_words(t, written, glob), np.uint64(self.seeds[t]))
        lanes[j] = (int(a), int(b)) if self.counts(t) else (0, 0)

    def _keep(self, t: int, glob: np.ndarray, new: np.ndarray, written: np.ndarray, live_new: np.ndarray) -> None:
        """Store checkpoint words ``new`` at positions ``glob`` of tensor ``t``'s kept words, after
        checking that the live words ``written`` there are their rounding ``live_new``."""
        kept = self.kept[t]
        assert kept is not None
        kept.put(glob, new)  # first: the undo restores these whatever the check says
        bad = np.ascontiguousarray(written).view(live_new.dtype) != live_new
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise LayoutError(f"{self.specs[t].name}: element {int(glob[k])} reads back {int(written[k]):#x} after "
                              f"{int(live_new[k]):#x} was written")

    def _undo(self, items: list[Item], undo: list[Any]) -> None:
        """Write back the old words of every part that was (or may have been) written (and the kept
        words of a tensor rounded at load)."""
        for (t, local, glob, _), entry in zip(items, undo):
            if entry is None:
                continue
            if local is None:
                mp = self._maps[t]
                assert mp is not None
                local = kernels.map_positions(glob, *mp)
            before = None
            if isinstance(entry, np.ndarray):
                wordops.scatter(self._mem(t), local, entry)
            elif len(entry) == 2:
                old, before = entry
                wordops.scatter(self._mem(t), local, old)
            else:
                idx, old, before = entry
                self.flat[t].index_copy_(0, idx, old)
            kept = self.kept[t]
            if before is not None and kept is not None:
                kept.put(glob, before)
