"""The checkpoint words the engine keeps for tensors vLLM rounds at load.

A ``float32`` checkpoint served with ``dtype="bfloat16"`` (or ``float16``) is
rounded by vLLM's load (:class:`~rollout.engines.vllm.placement.casts.Rounding`):
the live words no longer hold the checkpoint's low bits, yet the trainer's
deltas, the fingerprint and the audit are defined on the checkpoint's words. So
:class:`~rollout.engines.vllm.apply.weights.LiveWeights` keeps, for each rounded
tensor this rank holds and only those, a host copy of its checkpoint words in
checkpoint order (the "kept" words; memory: the checkpoint's bytes of those
tensors, e.g. 4 bytes per element of a ``float32`` checkpoint, beside vLLM's 2):

- at binding, read from the checkpoint vLLM loaded (:data:`Reader`; the vLLM
  backend reads the model's local folder, :mod:`rollout.engines.vllm.worker.checkpoint`)
  and checked: their rounding must be the live words, else
  :class:`NotTheLoadedCheckpoint` (the engine does not hold that checkpoint);
- every read (decode base, fingerprint, audit, read-back) returns the kept words
  and checks that rounding them gives the live words
  (:class:`~rollout.engines.vllm.placement.rules.LayoutError` naming the tensor
  otherwise: the parameter was written outside p2psync);
- a delta writes the rounded new words into the parameter and the new words into
  the kept copy, hashes old and new as kept, checks the live words written, and
  its undo restores both; a snapshot writes both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from p2psync.errors import P2PSyncError
from p2psync.state import TensorSpec

Reader = Callable[[Sequence[TensorSpec]], dict[str, np.ndarray]]
"""The checkpoint vLLM loaded: the flat unsigned words of the given tensors, in checkpoint order;
raises :class:`CheckpointUnreadable`."""

_RANGE = 1 << 22
"""Elements checked at a time at binding."""


class LiveWeights(Protocol):
    """What this module reads of :class:`~rollout.engines.vllm.apply.weights.LiveWeights`."""

    specs: list[TensorSpec]
    casts: list[Any]
    places: list[Any]
    word_types: list[Any]
    kept: list[np.ndarray | None]

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


def rounded(live: LiveWeights) -> list[int]:
    """Indices of the tensors this rank holds that vLLM rounds at load (their words are kept)."""
    return [i for i, (c, pl) in enumerate(zip(live.casts, live.places)) if c is not None and not c.readable
            and pl is not None]


def load(live: LiveWeights, reader: Reader | None) -> list[np.ndarray | None]:
    """The kept words of ``live``'s rounded tensors (None for the others), read by ``reader`` and
    checked against the live words (module doc). Raises :class:`CheckpointUnreadable` (no reader,
    a tensor missing or unlike the table) or :class:`NotTheLoadedCheckpoint`."""
    out: list[np.ndarray | None] = [None] * len(live.specs)
    want = rounded(live)
    if not want:
        return out
    specs = [live.specs[i] for i in want]
    if reader is None:
        raise CheckpointUnreadable(specs[0].name, "no reader of the loaded checkpoint was given")
    got = reader(specs)
    for i, s in zip(want, specs):
        w = got.get(s.name)
        word = live.word_types[i]
        if w is None or w.dtype.itemsize != np.dtype(word).itemsize or w.size != s.numel:
            raise CheckpointUnreadable(s.name, "the checkpoint has no tensor of that name, dtype and size "
                                       f"({s.dtype} {list(s.shape)})")
        kept = np.ascontiguousarray(w.reshape(-1)).view(word).copy()
        _verify(live, i, kept)
        out[i] = kept
    return out


def _verify(live: LiveWeights, i: int, kept: np.ndarray) -> None:
    cast, place = live.casts[i], live.places[i]
    assert cast is not None and place is not None
    for ck, dst in place.chunks(_RANGE):
        want = cast.to_live(kept[ck])
        got = live.live_at(i, dst)
        bad = want != got
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise NotTheLoadedCheckpoint(live.specs[i].name, int(ck[k]), int(kept[ck[k]]), int(got[k]), int(want[k]))


def words(live: LiveWeights, i: int, ck: Any, current: np.ndarray) -> np.ndarray:
    """The kept words of tensor ``i`` at checkpoint positions ``ck`` (an index array or a slice),
    checked against ``current``, the live words there (module doc)."""
    kept = live.kept[i]
    cast = live.casts[i]
    assert kept is not None and cast is not None
    got = kept[ck]
    cast.check(got, current, live.specs[i].name)
    return got
