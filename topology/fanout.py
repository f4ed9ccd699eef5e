"""A region's breadth-first fan-out over arrays, for regions whose links are all region figures.

:meth:`topology.planner._Builder.fan_out` attaches a region's machines one by
one, strongest first, to the first relay in a queue that still has a free
slot (a relay's slots: its spare uplink over the target rate, at most the
degree limit), and appends each attached machine to the queue with its own
slots. When every relay can carry the target to every machine (no measured
link, so a pair's bandwidth is the least of the two ends and the region's
figure) and the queue never runs dry, that process has a closed form:
machine ``i`` goes to the queue entry whose slot range covers ``i`` (a
cumulative sum). :func:`fan_out` computes it and answers None whenever
either condition fails, so the caller falls back to the one-by-one loop and
the two always give the same tree. :class:`Shares` serves that loop when the
queue runs dry.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

import numpy as np

from topology.model import NetworkModel
from topology.vector import F64, I64, Layout, ModelArrays, propagate


def fan_out(a: ModelArrays, heads: I64, head_slots: list[int], members: I64, target: float,
            max_degree: int) -> I64 | None:
    """Parent of each member as a position in ``[*heads, *members]``, or None (see module docstring).

    ``head_slots[k]`` is the free slots of ``heads[k]`` at this target; ``members`` are node
    indices, strongest first, with no children and nothing reserved on their uplinks.
    """
    if a.measured[heads].any() or a.measured[members].any():
        return None
    hs = np.array(head_slots, dtype=np.int64)
    head_pos = np.flatnonzero(hs > 0)
    if head_pos.size == 0:
        head_pos, hs = np.array([len(heads) - 1]), np.ones(len(heads), dtype=np.int64)
    k = np.minimum(max_degree, np.floor(a.up[members] / target + 1e-9)).astype(np.int64)
    k = np.maximum(k, 0)
    # Slots open before member i attaches: the heads', then those of the members before it.
    before = int(hs[head_pos].sum()) + np.concatenate(([0], np.cumsum(k)[:-1]))
    if np.any(before < np.arange(1, len(members) + 1)):
        return None  # the queue runs dry somewhere: the loop's fallback decides
    entry_pos = np.concatenate((head_pos, len(heads) + np.flatnonzero(k > 0)))
    entry_slots = np.concatenate((hs[head_pos], k[k > 0]))
    parent = np.repeat(entry_pos, entry_slots)[: len(members)]
    node = np.concatenate((heads, members))
    p, c = node[parent], members
    bw = np.minimum(np.minimum(a.up[p], a.down[c]), a.region_bw[a.reg[p], a.reg[c]])
    if np.any(bw < target):
        return None  # the loop would look past the first open relay
    return parent.astype(np.int64)


def worst_below(model: NetworkModel, a: ModelArrays, heads: I64, head_rate: F64, head_children: F64,
                members: I64, parent: I64, payload_bytes: int, chunk_bytes: int) -> float:
    """Worst estimate over ``members`` (attached as ``parent`` says) relative to their heads."""
    ntop = len(heads)
    node = np.concatenate((heads, members))
    # Parents come before children and are non-decreasing: each depth is a contiguous block.
    levels = [0, ntop]
    while levels[-1] < len(node):
        nxt = ntop + int(np.searchsorted(parent, levels[-1], side="left"))
        if nxt <= levels[-1]:
            raise ValueError("fan-out is not breadth first")
        levels.append(nxt)
    lay = Layout(node, np.concatenate((np.full(ntop, -1), parent)), levels)
    n_children = np.zeros(len(a.ids))
    n_children[heads] = head_children
    n_children[node] += np.bincount(parent, minlength=len(node)).astype(np.float64)
    paths = propagate(model, a, lay, n_children, None, payload_bytes, chunk_bytes,
                      head_rate, np.zeros(ntop), np.zeros(ntop))
    return float(paths.eta[ntop:].max())


class Shares:
    """For the one-by-one loop when no relay has a free slot: the attached machine that keeps the
    largest uplink share per child if given one more, below the degree cap (ties: the lower rank).

    A heap whose entries are refreshed when their machine gained a child since they were pushed
    (children only grow while a fan-out runs), instead of a pass over every attached machine per
    member: quadratic in a region's size when no relay has a free slot, as in a restarted
    coordinator's first plan before any member reported its bandwidth."""

    def __init__(self, model: NetworkModel, reserved: Mapping[str, float], children: Mapping[str, list[str]],
                 rank: Mapping[str, int], max_degree: int) -> None:
        self.m, self.reserved, self.children, self.rank, self.cap = model, reserved, children, rank, max_degree
        self.heap: list[tuple[float, int, str, int]] = []

    def key(self, n: str) -> tuple[float, int]:
        """What the pick maximises: (uplink share per child with one more, -rank)."""
        return ((self.m.node(n).uplink_bps - self.reserved.get(n, 0.0)) / (1 + len(self.children[n])), -self.rank[n])

    def _entry(self, n: str) -> tuple[float, int, str, int]:
        """Heap order: the largest share first, then the lower rank; with the children it was taken at."""
        return (-self.key(n)[0], self.rank[n], n, len(self.children[n]))

    def add(self, n: str) -> None:
        heapq.heappush(self.heap, self._entry(n))

    def best(self) -> str | None:
        """The pick among the machines added, or None when every one is at the degree cap."""
        children = self.children
        while self.heap:
            _, _, n, had = self.heap[0]
            if len(children[n]) >= self.cap:
                heapq.heappop(self.heap)  # full, and stays full while the fan-out runs
            elif len(children[n]) != had:
                heapq.heapreplace(self.heap, self._entry(n))
            else:
                return n
        return None


__all__ = ["Shares", "fan_out", "worst_below"]
