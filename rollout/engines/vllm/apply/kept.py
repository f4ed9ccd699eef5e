"""The checkpoint words the engine keeps for tensors vLLM rounds at load.

A ``float32`` checkpoint served with ``dtype="bfloat16"`` (or ``float16``) is
rounded by vLLM's load (:class:`~rollout.engines.vllm.placement.casts.Rounding`):
the live words no longer hold the checkpoint's low bits, yet the trainer's
deltas, the fingerprint and the audit are defined on the checkpoint's words. So
:class:`~rollout.engines.vllm.apply.weights.LiveWeights` keeps, for each rounded
tensor this rank holds and only those, a host copy of the checkpoint words it
holds (:class:`Kept`; memory: the checkpoint's bytes of those words, e.g. 4 bytes
per element of a ``float32`` checkpoint, beside vLLM's 2). A tensor-parallel rank
holds a box of the tensor (its rows of a column-parallel weight, its columns of a
row-parallel one: :func:`box_of`) and keeps that box only, in checkpoint order:

- at binding, read from the checkpoint vLLM loaded, that box only (:data:`Reader`;
  the vLLM backend reads the model's local folder,
  :mod:`rollout.engines.vllm.worker.checkpoint`) and checked: their rounding must be
  the live words, else :class:`NotTheLoadedCheckpoint` (the engine does not hold
  that checkpoint);
- every read (decode base, fingerprint, audit, read-back, a range the ranks
  rebuild together) returns the kept words and checks that rounding them gives the
  live words (:class:`~rollout.engines.vllm.placement.rules.LayoutError` naming the
  tensor otherwise: the parameter was written outside p2psync);
- a delta writes the rounded new words into the parameter and the new words into
  the kept copy, each rank those of its box, hashes old and new as kept, checks the
  live words written, and its undo restores both; a snapshot writes both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from p2psync.errors import P2PSyncError
from p2psync.state import TensorSpec
from rollout.engines.vllm.placement.boxes import Family, Placement
from rollout.engines.vllm.placement.rules import LayoutError

Box = tuple[tuple[int, int], ...]
"""A box of a tensor: per dimension (outermost first), the indices ``[lo, hi)`` it spans."""

Reader = Callable[[Sequence[TensorSpec], Sequence[Box]], dict[str, np.ndarray]]
"""The checkpoint vLLM loaded: for each given tensor, the flat unsigned words of the given box of it,
in checkpoint (C) order; raises :class:`CheckpointUnreadable`."""

_RANGE = 1 << 22
"""Elements checked at a time at binding."""


class LiveWeights(Protocol):
    """What this module reads of :class:`~rollout.engines.vllm.apply.weights.LiveWeights`."""

    specs: list[TensorSpec]
    casts: list[Any]
    places: list[Any]
    word_types: list[Any]
    kept: list[Kept | None]

    def live_at(self, i: int, dst: np.ndarray) -> np.ndarray: ...


class CheckpointUnreadable(P2PSyncError):
    """The checkpoint words of a tensor vLLM rounded at load cannot be read (why: ``reason``)."""

    def __init__(self, tensor: str, reason: str) -> None:
        super().__init__(f"{tensor}: vLLM rounds it at load, so p2psync keeps its checkpoint words, read from "
                         f"the checkpoint vLLM loaded; they cannot be read: {reason}")
        self.tensor = tensor
        self.reason = reason


class NotTheLoadedCheckpoint(P2PSyncError):
    """The checkpoint read for a rounded tensor does not round to the live words: the engine does not
    hold that checkpoint (it was changed on disk after vLLM loaded it, or the weights were written since)."""

    def __init__(self, tensor: str, position: int, word: int, live: int, want: int) -> None:
        super().__init__(f"{tensor}: element {position} of the checkpoint vLLM loaded ({word:#x}) rounds to "
                         f"{want:#x}, the engine holds {live:#x}: the engine does not hold that checkpoint")
        self.tensor = tensor
        self.position = position


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_size(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def box_of(place: Placement, shape: Sequence[int]) -> Box:
    """The box of a tensor of ``shape`` whose elements ``place`` holds; raises :class:`LayoutError`
    naming the tensor when they are not exactly one box (every tensor-parallel slice vLLM makes is one:
    rows, columns, a vocabulary block)."""
    shape = tuple(int(n) for n in shape)
    if place.whole or not shape:
        return whole_box(shape)
    lo = [n for n in shape]
    hi = [0] * len(shape)
    for ck, _ in place.chunks(_RANGE):
        for k, idx in enumerate(np.unravel_index(ck, shape)):
            if idx.shape[0]:
                lo[k] = min(lo[k], int(idx.min()))
                hi[k] = max(hi[k], int(idx.max()) + 1)
    box = tuple((a, b) if b > a else (0, 0) for a, b in zip(lo, hi))
    if box_size(box) != place.held:
        raise LayoutError(f"{place.name}: vLLM rounds it at load and this rank holds {place.held} of its elements, "
                          f"not one box of it (the box around them, {list(box)}, has {box_size(box)}): its "
                          "checkpoint words cannot be kept as a slice")
    return box


class Kept:
    """The checkpoint words of one rounded tensor that this rank holds: the elements of ``box`` of a
    tensor of ``shape``, in checkpoint order (``words``, unsigned). A checkpoint position ``p`` held
    here is kept at :meth:`slots` ``(p)``: its index inside the box, raveled."""

    def __init__(self, shape: Sequence[int], box: Box, words: np.ndarray) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.box = box
        self.words = words
        self.whole = box == whole_box(self.shape)
        if words.shape != (box_size(box),):
            raise ValueError(f"{words.shape[0]} words kept for a box of {box_size(box)}")

    def slots(self, ck: Any) -> Any:
        """Where checkpoint positions ``ck`` (an index array, or a slice of consecutive positions all
        held here) are kept; positions outside the box are the caller's error."""
        if self.whole:
            return ck
        if isinstance(ck, slice):
            first = int(self.slots(np.array([ck.start], dtype=np.int64))[0])
            return slice(first, first + ck.stop - ck.start)  # consecutive positions held: consecutive slots
        rem = np.asarray(ck, dtype=np.int64)
        out = np.zeros(rem.shape, dtype=np.int64)
        scale = 1
        for (lo, hi), n in zip(reversed(self.box), reversed(self.shape)):
            rem, at = np.divmod(rem, n)
            out += (at - lo) * scale
            scale *= hi - lo
        return out

    def at(self, ck: Any) -> np.ndarray:
        """The kept words at checkpoint positions ``ck`` (a copy for an index array)."""
        return self.words[self.slots(ck)]

    def put(self, ck: Any, words: np.ndarray) -> None:
        """Keep ``words`` at checkpoint positions ``ck``."""
        self.words[self.slots(ck)] = words

    def placement(self, like: Placement) -> Placement:
        """Where the kept words hold the tensor's elements, as a placement of ``like``'s tensor into the
        kept array (``counted`` as ``like``): the ranges the ranks rebuild together are read from it."""
        strides = [math.prod(self.shape[k + 1:]) for k in range(len(self.shape))]
        sizes = [hi - lo for lo, hi in self.box]
        inner = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
        dims = tuple((n, cs, ks) for n, cs, ks in zip(sizes, strides, inner)) or ((1, 1, 1),)
        ck0 = sum(lo * cs for (lo, _), cs in zip(self.box, strides))
        fam = Family(dims, np.array([ck0], dtype=np.int64), np.zeros(1, dtype=np.int64))
        return Placement(like.name, like.param, like.shape, [fam], like.counted, like.cast)


def rounded(live: LiveWeights) -> list[int]:
    """Indices of the tensors this rank holds that vLLM rounds at load (their words are kept)."""
    return [i for i, (c, pl) in enumerate(zip(live.casts, live.places)) if c is not None and not c.readable
            and pl is not None]


def load(live: LiveWeights, reader: Reader | None) -> list[Kept | None]:
    """The kept words of ``live``'s rounded tensors (None for the others), this rank's box of each,
    read by ``reader`` and checked against the live words (module doc). Raises
    :class:`CheckpointUnreadable` (no reader, a tensor missing or unlike the table),
    :class:`NotTheLoadedCheckpoint`, or :class:`LayoutError` (a rank's elements not one box)."""
    out: list[Kept | None] = [None] * len(live.specs)
    want = rounded(live)
    if not want:
        return out
    specs = [live.specs[i] for i in want]
    boxes = [box_of(live.places[i], s.shape) for i, s in zip(want, specs)]
    if reader is None:
        raise CheckpointUnreadable(specs[0].name, "no reader of the loaded checkpoint was given")
    got = reader(specs, boxes)
    for i, s, box in zip(want, specs, boxes):
        w = got.get(s.name)
        word = live.word_types[i]
        if w is None or w.dtype.itemsize != np.dtype(word).itemsize or w.size != box_size(box):
            what = "" if box == whole_box(s.shape) else f", box {list(box)}"
            raise CheckpointUnreadable(s.name, "the checkpoint has no tensor of that name, dtype and size "
                                       f"({s.dtype} {list(s.shape)}{what})")
        kept = Kept(s.shape, box, np.ascontiguousarray(w.reshape(-1)).view(word).copy())
        _verify(live, i, kept)
        out[i] = kept
    return out


def _verify(live: LiveWeights, i: int, kept: Kept) -> None:
    cast, place = live.casts[i], live.places[i]
    assert cast is not None and place is not None
    for ck, dst in place.chunks(_RANGE):
        words = kept.at(ck)
        want = cast.to_live(words)
        got = live.live_at(i, dst)
        bad = want != got
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise NotTheLoadedCheckpoint(live.specs[i].name, int(ck[k]), int(words[k]), int(got[k]), int(want[k]))


def words(live: LiveWeights, i: int, ck: Any, current: np.ndarray) -> np.ndarray:
    """The kept words of tensor ``i`` at checkpoint positions ``ck`` (an index array or a slice),
    checked against ``current``, the live words there (module doc)."""
    kept = live.kept[i]
    cast = live.casts[i]
    assert kept is not None and cast is not None
    got = kept.at(ck)
    cast.check(got, current, live.specs[i].name)
    return got
