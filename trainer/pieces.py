"""What the trainer publishes: the tensor table and the pieces of it this process holds.

Table. The published table is the model's ``state_dict`` order with every tensor
held once (tied weights, e.g. ``lm_head.weight`` = ``embed_tokens.weight``, keep
their first name), full (global) shapes, floating tensors in the rollout dtype
(``bf16`` by default, as the rollout engine holds them), other tensors as they
are. It is the same table as :meth:`trainer.workload.Workload.published`.

Pieces. A piece is one contiguous flat element range ``[offset, offset + numel)``
of one table tensor that this process reads from its own memory. Without
sharding every tensor is one piece at offset 0. With FSDP2 / DTensor parameters
sharded on dim 0 (FSDP2's default ``Shard(0)``, also nested over several mesh
dims for HSDP), the local shard of a row-major tensor *is* a contiguous flat
range of the full tensor, so each rank encodes its shard as a range of the full
tensor and the receiver sees an ordinary full-model artifact (see
:mod:`trainer.publisher`). For ``Replicate`` mesh dims only coordinate 0
publishes, so every element is published by exactly one rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch

from p2psync import dtypes
from p2psync.state import TensorSpec

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Piece:
    """Elements ``[offset, offset + numel)`` of table tensor ``index``, read from ``source``."""

    index: int
    spec: TensorSpec
    offset: int
    numel: int
    source: torch.Tensor
    """The parameter or buffer (a DTensor for sharded models; read through :meth:`local`)."""
    dtype: torch.dtype
    """Rollout dtype of the tensor."""

    def local(self) -> torch.Tensor:
        """This process's elements as a flat contiguous tensor (a view where possible)."""
        t = self.source.detach()
        if _is_dtensor(t):
            t = t.to_local()
        if not t.is_contiguous():
            raise ValueError(f"{self.spec.name}: local tensor is not contiguous; cannot read it as a flat range")
        flat = t.reshape(-1)
        if flat.shape[0] != self.numel:
            raise ValueError(f"{self.spec.name}: local tensor has {flat.shape[0]} elements, expected {self.numel}")
        return flat


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return isinstance(t, DTensor)


def _chunk_bounds(lo: int, hi: int, parts: int, k: int) -> tuple[int, int]:
    """Rows of chunk ``k`` of ``[lo, hi)`` split in ``parts`` as ``torch.chunk`` does (ceil sizes)."""
    n = hi - lo
    size = -(-n // parts) if n else 0
    a = min(n, k * size)
    return lo + a, lo + min(n, a + size)


def dtensor_rows(t: DTensor) -> tuple[int, int] | None:
    """Global rows ``[lo, hi)`` of dim 0 that this rank holds, or ``None`` if another rank publishes them.

    Supports placements made of ``Shard(0)`` and ``Replicate`` (FSDP2 and HSDP); anything else
    raises ``ValueError`` naming the placement.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not part of the mesh
        return None
    lo, hi = 0, (t.shape[0] if t.dim() else 1)
    for mesh_dim, pl in enumerate(t.placements):
        if type(pl) is Shard and pl.dim == 0:
            lo, hi = _chunk_bounds(lo, hi, mesh.size(mesh_dim), coord[mesh_dim])
        elif type(pl) is Replicate:
            if coord[mesh_dim] != 0:
                return None
        else:
            raise ValueError(f"placement {pl!r} is not supported (only Shard(0) and Replicate)")
    return lo, hi


def published_table(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16,
                    overrides: Mapping[str, torch.dtype] | None = None) -> tuple[list[TensorSpec], list[Piece]]:
    """(full tensor table, pieces this process publishes), in table order.

    ``overrides``: rollout dtype per tensor name where it differs from ``dtype`` (for floating
    tensors; integer and bool tensors always keep their dtype).
    """
    overrides = dict(overrides or {})
    specs: list[TensorSpec] = []
    pieces: list[Piece] = []
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied: the same Parameter object under a second name
            continue
        seen.add(id(t))
        if t.is_floating_point():
            out = overrides.pop(name, dtype)
        else:
            out = t.dtype
        shape = tuple(int(s) for s in t.shape)
        spec = TensorSpec(name, dtypes.from_torch(out).code, shape)
        index = len(specs)
        specs.append(spec)
        if _is_dtensor(t):
            rows = dtensor_rows(t)
            if rows is None:
                continue
            row = spec.numel // shape[0] if shape and shape[0] else 1
            lo, hi = rows
            pieces.append(Piece(index, spec, lo * row, (hi - lo) * row, t, out))
        else:
            pieces.append(Piece(index, spec, 0, spec.numel, t, out))
    if overrides:
        raise ValueError(f"dtype overrides name tensors the model does not have: {sorted(overrides)}")
    return specs, pieces
