"""Reading a placement probe back: where each checkpoint element id landed, per tensor, as runs.

:func:`rollout.engines.vllm.placement.probe.derive` feeds a layer's checkpoint tensors
through vLLM's loader as element ids into zeroed probes, in passes of at most
:data:`PASS_IDS` ids (``float32`` holds every integer up to 2**24 exactly): in
the pass starting at element ``lo``, the word ``w`` means element
``lo + w - 1`` of the batch (``bases[i]``: the first element of tensor ``i``),
0 a word no element was copied to. :class:`Readback` reads each probe back after
each pass as maximal runs contiguous on both sides (one compiled pass per probe,
memory per run), or, for a probe whose load moves single elements (transposed,
permuted), by a scatter of its ids; after the last pass it gives each tensor's
parameter and runs. It refuses, naming the tensor, a word that is not an id, an
element written twice, and a tensor spread over two parameters.
"""

from __future__ import annotations

import numpy as np

from p2psync.state import TensorSpec
from rollout.engines.vllm.placement.rules import LayoutError
from rollout.engines.vllm.placement.boxes import maximal_runs
from rollout.engines.vllm.placement.kernels import OK, runs, scan

Runs = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Maximal runs contiguous on both sides: checkpoint starts (ascending), parameter starts, lengths."""

PASS_IDS = 1 << 24
"""Element ids fed in one pass: ``1 .. 2**24``, every one exact in ``float32``."""

_MAX_RUNS = 1 << 18
"""Runs one probe may read back as in one pass; more (an element-wise permutation or a transposed
load) are found by a scatter of its ids instead."""


class ComputedValues(LayoutError):
    """A probe read back a word that is not an element id: the loader computes values (the tensor
    named is a guess from the word when the pass fed several)."""


class Readback:
    """The runs of one batch's probes (``names``), gathered pass by pass (:meth:`read`), then placed
    per tensor (:meth:`placed`)."""

    def __init__(self, batch: list[TensorSpec], bases: np.ndarray, names: list[str]) -> None:
        self.batch, self.bases, self.names = batch, bases, names
        cap = min(_MAX_RUNS, int(bases[-1]))
        self._buf = tuple(np.empty(cap, dtype=np.int64) for _ in range(3))
        self._parts: list[tuple[np.ndarray, ...]] = []

    def read(self, views: list[np.ndarray], lo: int, count: int) -> list[bool]:
        """Read every probe (``views``, in ``names`` order) after the pass of ids ``lo + 1 ..
        lo + count``; per probe, whether it held any."""
        held = []
        p0, i0, ln = self._buf
        for k, v in enumerate(views):
            n, bad = runs(v, count, p0, i0, ln)
            if bad != OK:
                raise self._computed(self.names[k], v, bad, lo)
            if n >= 0:
                pos, ids, lens = p0[:n].copy(), i0[:n] + lo, ln[:n].copy()
            else:
                pos, ids, lens = self._scattered(k, v, lo, count)
            held.append(pos.shape[0] > 0)
            if pos.shape[0]:
                self._parts.append((pos, ids, lens, np.full(pos.shape[0], k, dtype=np.int64)))
        return held

    def _scattered(self, k: int, v: np.ndarray, lo: int, count: int) -> tuple[np.ndarray, ...]:
        """Probe ``k``'s runs found by scattering each id to where it landed (memory per id of the pass)."""
        inv = np.empty(count, dtype=np.int64)
        seen = np.zeros(count, dtype=np.uint8)
        _, bad, dup = scan(v, count, inv, seen)
        if bad != OK:
            raise self._computed(self.names[k], v, bad, lo)
        if dup != OK:
            raise self._twice(lo + dup, self.names[k], self.names[k])
        ck = np.flatnonzero(seen)
        ids, pos, lens = maximal_runs(ck, inv[ck]) if ck.shape[0] else (ck, ck, ck)
        return pos, ids + lo, lens

    def placed(self) -> dict[str, tuple[str, Runs]]:
        """Each held tensor's parameter and runs (checkpoint positions within the tensor)."""
        if not self._parts:
            return {}
        pos, ids, lens, probe = (np.concatenate(x) for x in zip(*self._parts))
        order = np.argsort(ids, kind="stable")
        pos, ids, lens, probe = pos[order], ids[order], lens[order], probe[order]
        over = np.flatnonzero(ids[1:] < (ids + lens)[:-1])
        if over.shape[0]:
            j = int(over[0])
            raise self._twice(int(ids[j + 1]), self.names[int(probe[j])], self.names[int(probe[j + 1])])
        pos, ids, lens, probe = _split(self.bases, *_joined(pos, ids, lens, probe))
        tensor = np.searchsorted(self.bases, ids, side="right") - 1
        edges = np.searchsorted(tensor, np.arange(len(self.batch) + 1))
        got: dict[str, tuple[str, Runs]] = {}
        for i, s in enumerate(self.batch):
            lo, hi = int(edges[i]), int(edges[i + 1])
            if lo == hi:
                continue
            where = probe[lo:hi]
            if int(where.min()) != int(where.max()):
                targets = sorted({self.names[int(k)] for k in where})
                raise LayoutError(f"{s.name}: vLLM's loader spreads it over several parameters ({targets})")
            got[s.name] = (self.names[int(where[0])], (ids[lo:hi] - self.bases[i], pos[lo:hi], lens[lo:hi]))
        return got

    def _owner(self, element: int) -> str:
        """The name of the tensor whose elements include ``element`` (of the batch)."""
        return self.batch[int(np.searchsorted(self.bases, element, side="right")) - 1].name

    def _computed(self, name: str, v: np.ndarray, bad: int, lo: int) -> ComputedValues:
        total = int(self.bases[-1])
        guess = min(max(lo + int(v[bad]) - 1, 0), total - 1) if np.isfinite(v[bad]) else lo
        return ComputedValues(f"{self._owner(guess)}: vLLM's loader computes the values of {name} from the "
                           "checkpoint (not a copy of its elements); it cannot be updated in place")

    def _twice(self, element: int, first: str, again: str) -> LayoutError:
        name = self._owner(element)
        if first != again:
            return LayoutError(f"{name}: vLLM's loader spreads it over several parameters ({sorted({first, again})})")
        return LayoutError(f"{name}: vLLM's loader writes some of its elements to more than one place in {again}")


def _joined(pos: np.ndarray, ids: np.ndarray, lens: np.ndarray, probe: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs (``ids`` ascending, disjoint) with those that continue one another in the same probe
    joined: a run read back in two passes (its ids on both sides of a pass's end)."""
    go_on = (ids[1:] == (ids + lens)[:-1]) & (pos[1:] == (pos + lens)[:-1]) & (probe[1:] == probe[:-1])
    if not go_on.any():
        return pos, ids, lens, probe
    first = np.flatnonzero(np.concatenate([[True], ~go_on]))
    return pos[first], ids[first], np.add.reduceat(lens, first), probe[first]


def _split(bases: np.ndarray, pos: np.ndarray, ids: np.ndarray, lens: np.ndarray, probe: np.ndarray
           ) -> tuple[np.ndarray, ...]:
    """The runs (``ids`` ascending, disjoint) cut where one tensor's ids end and the next one's begin
    (two tensors of the batch loaded side by side read back as one run)."""
    cuts = bases[1:-1]
    j = np.searchsorted(ids, cuts, side="right") - 1
    inside = (j >= 0) & (cuts > ids[np.maximum(j, 0)]) & (cuts < (ids + lens)[np.maximum(j, 0)])
    if not inside.any():
        return pos, ids, lens, probe
    keep = np.ones(ids.shape[0], dtype=bool)
    extra: list[tuple[int, int, int, int]] = []
    for r in np.unique(j[inside]):
        at = [int(ids[r]), *(int(c) for c in cuts[inside & (j == r)]), int(ids[r] + lens[r])]
        keep[r] = False
        extra += [(int(pos[r]) + a - at[0], a, b - a, int(probe[r])) for a, b in zip(at, at[1:])]
    more = np.array(extra, dtype=np.int64)
    pos, ids, lens, probe = (np.concatenate([x[keep], more[:, c]]) for c, x in enumerate((pos, ids, lens, probe)))
    order = np.argsort(ids, kind="stable")
    return pos[order], ids[order], lens[order], probe[order]
