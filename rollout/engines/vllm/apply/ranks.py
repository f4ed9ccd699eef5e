"""Tensor- and expert-parallel ranks applying one delta together: the rank group and base gathering.

With ``tensor_parallel_size > 1`` every vLLM worker holds a slice of most
tensors, and with expert parallelism some experts only
(:mod:`rollout.engines.vllm.placement.probe`). A delta segment's positions are
coded against every base word of its range, so each rank rebuilds that range
before decoding it: every rank writes the words it owns (its placement is
``counted``) into a zeroed block and the group sums the blocks. The owned
bits of different ranks never overlap, so the sum is their union, exact in any
integer view. One rank then decodes the range for the group (the rank whose row
block holds it, :mod:`rollout.engines.vllm.apply.slices`) and sends each other rank
the changes it holds (:meth:`RankGroup.exchange`); every rank writes those of
its own piece and hashes the words it owns at their global positions; the group
sums those lanes, so the fingerprint is the trainer's whole-model fingerprint.

All ranks run the same collectives in the same order (the same chunks give the
same segments), and every outcome is voted: a rank that fails (a fetch, a
decode, a write) makes every rank refuse and take its writes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from rollout.engines.vllm.placement.boxes import Placement

from p2psync.errors import P2PSyncError

MASK64 = 0xFFFFFFFFFFFFFFFF
T = TypeVar("T")


class RankRefused(P2PSyncError):
    """Another tensor-parallel rank failed its part of an update, so this rank refused it too."""


class RankGroup(Protocol):
    """The tensor-parallel ranks that share one model (collectives in call order on every rank)."""

    rank: int
    size: int

    def sum_(self, t: Any) -> None:
        """All-reduce SUM of the integer tensor ``t`` in place (host or device)."""

    def sum_u64(self, values: list[int]) -> list[int]:
        """Element-wise sum modulo 2**64 of ``values`` over the ranks."""

    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""

    def first(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (a picklable value), on every rank."""

    def texts(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order."""

    def objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""

    def exchange(self, outgoing: list[Any]) -> list[Any]:
        """``outgoing[q]`` (picklable: e.g. numpy arrays of changes) sent to rank ``q``; returns what each
        rank sent this one, in rank order (this rank's own slot: ``outgoing[rank]``)."""


class Solo:
    """One rank: every collective is the identity."""

    rank = 0
    size = 1

    def sum_(self, t: Any) -> None:
        return None

    def sum_u64(self, values: list[int]) -> list[int]:
        return [v & MASK64 for v in values]

    def all_true(self, ok: bool) -> bool:
        return ok

    def first(self, obj: Any) -> Any:
        return obj

    def texts(self, text: str) -> list[str]:
        return [text]

    def objects(self, obj: Any) -> list[Any]:
        return [obj]

    def exchange(self, outgoing: list[Any]) -> list[Any]:
        return list(outgoing)


class TorchGroup:
    """A :mod:`torch.distributed` group: ``host_group`` (gloo) for votes and lanes,
    ``tensor_group`` for blocks of words on the model's device (the same group on CPU)."""

    def __init__(self, host_group: Any, tensor_group: Any | None = None) -> None:
        import torch.distributed as dist

        self.host_group = host_group
        self.tensor_group = tensor_group if tensor_group is not None else host_group
        self.rank = dist.get_rank(host_group)
        self.size = dist.get_world_size(host_group)

    def sum_(self, t: Any) -> None:
        import torch.distributed as dist

        group = self.host_group if t.device.type == "cpu" else self.tensor_group
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def sum_u64(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        # int64 addition wraps modulo 2**64: the same sums as uint64
        t = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.host_group)
        return [int(v) & MASK64 for v in t.tolist()]

    def all_true(self, ok: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return bool(t.item())

    def first(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.host_group, 0), group=self.host_group)
        return box[0]

    def texts(self, text: str) -> list[str]:
        return [str(t) for t in self.objects(text)]

    def objects(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def exchange(self, outgoing: list[Any]) -> list[Any]:
        import torch.distributed as dist

        got: list[Any] = []
        for q in range(self.size):  # rank q scatters its list: one round per rank (gloo has no all-to-all)
            box: list[Any] = [None]
            dist.scatter_object_list(box, list(outgoing) if q == self.rank else None,
                                     src=dist.get_global_rank(self.host_group, q), group=self.host_group)
            got.append(box[0])
        return got


def together(group: RankGroup, fn: Callable[[], T], refused: str) -> T:
    """``fn()`` on every rank, then a vote: if it raised on any rank it fails on every rank, with
    that rank's own error there and :class:`RankRefused` (``refused``) on the others."""
    failed: Exception | None = None
    got: Any = None
    try:
        got = fn()
    except Exception as exc:
        failed = exc
    if not group.all_true(failed is None):
        raise failed or RankRefused(refused)
    return got


def vllm_group() -> RankGroup:
    """vLLM's tensor-parallel group of this worker."""
    from vllm.distributed.parallel_state import get_tp_group

    coord = get_tp_group()
    if coord.world_size == 1:
        return Solo()
    return TorchGroup(coord.cpu_group, coord.device_group)


def gather_ranges(group: RankGroup, ranges: Sequence[tuple[Placement | None, Any, int, int, Any]]
                  ) -> list[np.ndarray]:
    """Words ``[start, stop)`` of the whole checkpoint tensor, for each ``(place, flat, start, stop,
    word)`` in ``ranges``, rebuilt from every rank's placement with one collective for all of them
    (every rank calls it with the same ranges, in the same order; a rank holding nothing of a range
    adds zeros). ``flat`` is this rank's binding (a torch integer view); returns unsigned host words."""
    import torch

    if not ranges:
        return []
    device = ranges[0][1].device
    offsets = [0]
    for _, flat, start, stop, _ in ranges:  # each range padded to whole int32s
        offsets.append(offsets[-1] + -(-(stop - start) * flat.element_size() // 4))
    block = torch.zeros(offsets[-1], dtype=torch.int32, device=device)
    views = []
    for (place, flat, start, stop, _), lo, hi in zip(ranges, offsets, offsets[1:]):
        part = block[lo:hi].view(flat.dtype)
        views.append(part[:stop - start])
        if place is not None and place.counted:
            _copy_owned(part, place, flat, start, stop)
    # Owned bits never overlap, so the sum is exact in any integer view; int32 is one every
    # backend reduces (NCCL has no int16).
    group.sum_(block)
    host = block.cpu() if block.device.type != "cpu" else block
    out = []
    for (_, flat, _, _, word), lo, hi, v in zip(ranges, offsets, offsets[1:], views):
        out.append(host[lo:hi].view(flat.dtype)[:v.shape[0]].numpy().view(word))
    return out


def _copy_owned(part: Any, place: Placement, flat: Any, start: int, stop: int) -> None:
    """``part[ck - start] = flat[dst]`` for every element ``ck -> dst`` of ``place`` with ``ck`` in
    ``[start, stop)``: as strided copies of whole rows where the placement is a block of rows
    (:meth:`Placement.row_block`), else element by element."""
    import torch

    rb = place.row_block()
    if rb is None:
        which, local = place.local(np.arange(start, stop, dtype=np.int64))
        if which.shape[0]:
            idx = torch.from_numpy(local).to(flat.device)
            part.index_copy_(0, torch.from_numpy(which).to(flat.device), flat.index_select(0, idx))
        return
    ck0, dst0, rows, cs, ds, width = rb
    full_lo = max(0, -(-(start - ck0) // cs))  # the first row starting at or after start
    full_hi = min(rows, (stop - ck0 - width) // cs + 1) if stop - ck0 >= width else 0
    if full_hi > full_lo:
        n = full_hi - full_lo
        src = flat.as_strided((n, width), (ds, 1), flat.storage_offset() + dst0 + full_lo * ds)
        part.as_strided((n, width), (cs, 1), part.storage_offset() + ck0 + full_lo * cs - start).copy_(src)
    first = max(0, (start - ck0) // cs)
    last = min(rows - 1, (stop - 1 - ck0) // cs)
    for i in {first, last}:  # rows the range cuts (at its ends)
        if full_lo <= i < full_hi or not 0 <= i < rows:
            continue
        lo, hi = max(start, ck0 + i * cs), min(stop, ck0 + i * cs + width)
        if hi > lo:
            at = dst0 + i * ds + lo - ck0 - i * cs
            part[lo - start:hi - start].copy_(flat[at:at + hi - lo])
