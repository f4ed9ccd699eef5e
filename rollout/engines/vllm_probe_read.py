"""Reading a placement probe back: where each checkpoint element id landed, per tensor, as runs.

:func:`rollout.engines.vllm_probe.derive` feeds a layer's checkpoint tensors
through vLLM's loader as element ids ``1 .. total`` (``bases[i]``: the first id
less one of tensor ``i``) into zeroed probes. Here each probe is read back into
maximal runs contiguous on both sides (:func:`read_runs`: one compiled pass per
probe, memory per run), or, for a load that moves single elements (transposed,
permuted), by a scatter of every id (:func:`read_scatter`). Either refuses,
naming the tensor, a word that is not an id, an element written twice, and a
tensor spread over two parameters.
"""

from __future__ import annotations

import numpy as np

from p2psync.state import TensorSpec
from rollout.engines.vllm_layout import LayoutError
from rollout.engines.vllm_placement import maximal_runs
from rollout.engines.vllm_probe_kernels import OK, runs, scan

Runs = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Maximal runs contiguous on both sides: checkpoint starts (ascending), parameter starts, lengths."""

_MAX_RUNS = 1 << 18
"""Runs one probe may read back as (:func:`read_runs`); more (an element-wise permutation or a
transposed load) are inverted by a scatter instead (:func:`read_scatter`)."""


def _computed(batch: list[TensorSpec], bases: np.ndarray, name: str, v: np.ndarray, bad: int) -> LayoutError:
    total = int(bases[-1])
    guess = min(max(int(v[bad]) - 1, 0), total - 1) if np.isfinite(v[bad]) else 0
    return LayoutError(f"{_owner(batch, bases, guess)}: vLLM's loader computes the values of {name} from the "
                       "checkpoint (not a copy of its elements); it cannot be updated in place")


def _twice(batch: list[TensorSpec], bases: np.ndarray, element: int, first: str, again: str) -> LayoutError:
    name = _owner(batch, bases, element)
    if first != again:
        return LayoutError(f"{name}: vLLM's loader spreads it over several parameters ({sorted({first, again})})")
    return LayoutError(f"{name}: vLLM's loader writes some of its elements to more than one place in {again}")


def read_runs(batch: list[TensorSpec], bases: np.ndarray, names: list[str], views: list[np.ndarray]
              ) -> dict[str, tuple[str, Runs]] | None:
    """Each held tensor's probe and runs, read as runs (one pass over each probe, memory per run);
    None when a probe holds more than :data:`_MAX_RUNS` runs."""
    total = int(bases[-1])
    cap = min(_MAX_RUNS, total)
    parts = []
    p0, i0, ln = (np.empty(cap, dtype=np.int64) for _ in range(3))
    for k, v in enumerate(views):
        n, bad = runs(v, total, p0, i0, ln)
        if bad != OK:
            raise _computed(batch, bases, names[k], v, bad)
        if n < 0:
            return None
        parts.append((p0[:n].copy(), i0[:n].copy(), ln[:n].copy(), np.full(n, k, dtype=np.int64)))
    if not parts:
        return {}
    pos, ids, lens, probe = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(ids, kind="stable")
    pos, ids, lens, probe = pos[order], ids[order], lens[order], probe[order]
    over = np.flatnonzero(ids[1:] < (ids + lens)[:-1])
    if over.shape[0]:
        j = int(over[0])
        raise _twice(batch, bases, int(ids[j + 1]), names[int(probe[j])], names[int(probe[j + 1])])
    pos, ids, lens, probe = _split(bases, pos, ids, lens, probe)
    tensor = np.searchsorted(bases, ids, side="right") - 1
    edges = np.searchsorted(tensor, np.arange(len(batch) + 1))
    got: dict[str, tuple[str, Runs]] = {}
    for i, s in enumerate(batch):
        lo, hi = int(edges[i]), int(edges[i + 1])
        if lo == hi:
            continue
        held = probe[lo:hi]
        if int(held.min()) != int(held.max()):
            targets = sorted({names[int(k)] for k in held})
            raise LayoutError(f"{s.name}: vLLM's loader spreads it over several parameters ({targets})")
        got[s.name] = (names[int(held[0])], (ids[lo:hi] - bases[i], pos[lo:hi], lens[lo:hi]))
    return got


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


def read_scatter(batch: list[TensorSpec], bases: np.ndarray, names: list[str], views: list[np.ndarray]
                 ) -> dict[str, tuple[str, Runs]]:
    """:func:`read_runs` by inverting the ids with a scatter: where each landed, in which probe
    (``which`` = 1 + the probe's index, 0 for none), one compiled pass over each probe
    (:func:`vllm_probe_kernels.scan`); memory per element of the batch."""
    total = int(bases[-1])
    inv = np.empty(total, dtype=np.int64)
    which = np.zeros(total, dtype=np.int32)
    for k, (n, v) in enumerate(zip(names, views)):
        _, bad, dup = scan(v, total, inv, which, k + 1)
        if bad != OK:
            raise _computed(batch, bases, n, v, bad)
        if dup != OK:
            raise _twice(batch, bases, dup, names[int(which[dup]) - 1], n)
    got: dict[str, tuple[str, Runs]] = {}
    for i, s in enumerate(batch):
        lo, hi = int(bases[i]), int(bases[i + 1])
        w = which[lo:hi]
        ck = np.flatnonzero(w > 0)
        if ck.shape[0] == 0:
            continue
        w_held = w[ck]
        if int(w_held.min()) != int(w_held.max()):
            targets = sorted({names[int(k) - 1] for k in np.unique(w_held)})
            raise LayoutError(f"{s.name}: vLLM's loader spreads it over several parameters ({targets})")
        got[s.name] = (names[int(w_held[0]) - 1], maximal_runs(ck, inv[lo:hi][ck]))
    return got


def _owner(batch: list[TensorSpec], bases: np.ndarray, element: int) -> str:
    """The name of the tensor of ``batch`` whose ids include ``element`` (``bases``: each one's first id)."""
    return batch[int(np.searchsorted(bases, element, side="right")) - 1].name
