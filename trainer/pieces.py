"""What the trainer publishes: the tensor table and the pieces of it this process holds.

Table. The published table is the model's checkpoint table
(:mod:`p2psync.checkpoint_names`): the names and layout ``save_pretrained`` writes, e.g. one
tensor per expert where transformers holds a MoE block's experts fused. For a model without a
load-time conversion that is its ``state_dict`` order with every tensor held once (tied weights,
e.g. ``lm_head.weight`` = ``embed_tokens.weight``, keep their first name). Full (global) shapes,
floating tensors in the rollout dtype (``bf16`` by default, as the rollout engine holds them),
other tensors as they are. It is the same table as :meth:`trainer.workload.Workload.published`.
A checkpoint tensor that is a view of a fused parameter is read through that view: no copy of
the parameter (one whose view is strided, not one flat range, is read through a copy of that
one checkpoint tensor per bucket).

Pieces. A piece is one contiguous flat element range ``[offset, offset + numel)``
of one table tensor that this process reads from its own memory. Without
sharding every tensor is one piece at offset 0. With FSDP2 / DTensor parameters
sharded on dim 0 (FSDP2's default ``Shard(0)``, also nested over several mesh
dims for HSDP), the local shard of a row-major tensor *is* a contiguous flat
range of the full tensor, so each rank encodes its shard as a range of the full
tensor and the receiver sees an ordinary full-model artifact (see
:mod:`trainer.publisher`). For ``Replicate`` mesh dims only coordinate 0
publishes, so every element is published by exactly one rank. A checkpoint
tensor that is one flat range of a sharded fused parameter (an expert of
``gate_up_proj``) is published by the ranks whose shards hold part of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch

from p2psync import dtypes
from p2psync.checkpoint_names import View, checkpoint_views, unique_tensors
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
    at: int = 0
    """Where the piece's elements start in the flat local tensor of ``source``."""
    view: View | None = None
    """Set for a checkpoint tensor that is a strided view of ``source`` (not one flat range)."""

    def local(self) -> torch.Tensor:
        """This process's elements as a flat contiguous tensor (a view where possible)."""
        t = self.source.detach()
        if _is_dtensor(t):
            t = t.to_local()
        if self.view is not None:
            flat = self.view.of(t).reshape(-1)  # strided: a copy of this one checkpoint tensor
        elif not t.is_contiguous():
            raise ValueError(f"{self.spec.name}: local tensor is not contiguous; cannot read it as a flat range")
        else:
            flat = t.reshape(-1)[self.at : self.at + self.numel]
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
    tensors; integer and bool tensors always keep their dtype). A name is a checkpoint name, or
    an in-memory name whose checkpoint tensors all take that dtype.
    """
    overrides = dict(overrides or {})
    used: set[str] = set()
    specs: list[TensorSpec] = []
    pieces: list[Piece] = []
    tensors = unique_tensors(model)
    for v in checkpoint_views(model, tensors):
        t = tensors[v.source]
        out = t.dtype
        if t.is_floating_point():
            key = v.name if v.name in overrides else v.source
            out = overrides.get(key, dtype)
            used.add(key)
        spec = TensorSpec(v.name, dtypes.from_torch(out).code, v.shape)
        index = len(specs)
        specs.append(spec)
        if _is_dtensor(t):
            rows = dtensor_rows(t)
            if rows is None:
                continue
            shape = v.source_shape
            row = int(t.numel()) // shape[0] if shape and shape[0] else 1
            lo, hi = rows[0] * row, rows[1] * row
            if v.whole:
                pieces.append(Piece(index, spec, lo, hi - lo, t, out))
                continue
            if not v.contiguous:
                raise ValueError(f"{v.name}: a strided view of the sharded {v.source}; only checkpoint tensors "
                                 "that are one flat range of a sharded parameter are supported")
            a, b = max(lo, v.offset), min(hi, v.offset + spec.numel)
            if a < b:
                pieces.append(Piece(index, spec, a - v.offset, b - a, t, out, at=a - lo))
        elif v.contiguous:
            pieces.append(Piece(index, spec, 0, spec.numel, t, out, at=v.offset))
        else:
            pieces.append(Piece(index, spec, 0, spec.numel, t, out, view=v))
    unknown = set(overrides) - used
    if unknown:
        raise ValueError(f"dtype overrides name tensors the model does not have: {sorted(unknown)}")
    return specs, pieces
