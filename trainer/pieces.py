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

Pieces. A piece is the elements of one table tensor that this process reads from its own
memory and publishes. Without sharding every tensor is one piece at offset 0. A rank of a
sharded trainer publishes the tensors it holds by name (``held``: pipeline stages, expert
splits) and, of a DTensor, the elements its placements give it (:func:`dtensor_indices`:
``Shard(d)``, ``_StridedShard``, ``Replicate`` with coordinate 0 publishing). A shard that is one
flat range of its tensor (``Shard(0)``, FSDP2's default) is one piece ``[offset, offset + numel)``
encoded as a range of the full tensor; a box of long runs is a piece per run; a box of short runs
(a row-parallel weight's ``Shard(1)``) is one *strided* piece, encoded on rank 0
(:mod:`trainer.strided`). A checkpoint tensor that is one flat range of a sharded fused parameter
(an expert of ``gate_up_proj``) is published by the ranks whose shards hold part of it. The
ranks agree at start that every element is published by exactly one rank (:func:`agree_table`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
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
    runs: tuple[np.ndarray, np.ndarray] | None = None
    """A *strided* piece (a shard of a ``Shard(d>0)`` / ``_StridedShard`` DTensor): its elements are
    the flat runs (global starts, lengths) of the table tensor, one after the other in the local
    tensor; ``offset`` is then the first run's start. ``None``: one flat range."""

    def global_positions(self, pos: np.ndarray) -> np.ndarray:
        """The table tensor's flat positions of the piece's elements ``pos`` (sorted piece positions)."""
        if self.runs is None:
            return pos + self.offset
        starts, lengths = self.runs
        locs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        k = np.searchsorted(locs, pos, side="right") - 1
        return pos + (starts - locs)[k]

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


def hold_at(root: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Register ``t`` as a buffer of ``root`` under the dotted ``name`` (a checkpoint name), making
    the submodules on its path, so that ``root``'s state dict lists it under that name (what the
    publisher reads from a module that mirrors a stream or a source of named tensors)."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        sub = owner._modules.get(part)
        if sub is None:
            sub = torch.nn.Module()
            owner.add_module(part, sub)
        owner = sub
    owner.register_buffer(leaf, t)


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return isinstance(t, DTensor)


MIN_RUN = 1 << 18
"""Elements from which each flat run of a shard that is several runs of its tensor (a ``Shard(d>0)``
or ``_StridedShard`` box) is a piece of its own, encoded here with the default coding: a segment
costs ~130 bytes of tables, small beside a run this long. Narrower runs make one *strided* piece,
whose changes rank 0 encodes (:mod:`trainer.strided`)."""


def _chunk(idx: np.ndarray, parts: int, k: int) -> np.ndarray:
    """Chunk ``k`` of ``idx`` split in ``parts`` as ``torch.chunk`` does (ceil sizes, trailing chunks empty)."""
    n = idx.shape[0]
    size = -(-n // parts) if n else 0
    return idx[min(n, k * size):min(n, (k + 1) * size)]


def dtensor_indices(t: DTensor, name: str = "") -> list[np.ndarray] | None:
    """Per dimension, the global indices (increasing) of the elements this rank holds of ``t``, or
    ``None`` if another rank publishes them (a ``Replicate`` mesh dim at a coordinate other than 0,
    or a rank outside the mesh). The local tensor is their product, in row-major order
    (:func:`box_indices`). A refused placement raises ``ValueError`` naming ``name``."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not part of the mesh
        return None
    if _replica_elsewhere(mesh):
        return None
    spec = getattr(t, "_spec", None)
    order = getattr(spec, "shard_order", None)
    if order is not None and not all(list(e.mesh_dims) == sorted(e.mesh_dims) for e in order):
        raise ValueError(f"{name}: shard order {order!r} is not supported (only left-to-right placements)")
    return box_indices(tuple(t.shape), tuple(t.placements), tuple(mesh.shape), tuple(coord), name)


def _replica_elsewhere(mesh: Any) -> bool:
    """Whether another copy of a DTensor on the sub-mesh ``mesh`` publishes it: with FSDP2 over TP the
    tensors FSDP2 alone shards (embeddings, norms) live on the ``dp`` sub-mesh, one copy per ``tp``
    coordinate. The root mesh's dims along which the sub-mesh does not extend are replica dims, and
    only coordinate 0 of each publishes (as for a ``Replicate`` mesh dim)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else mesh
    if root is mesh:
        return False
    grid = root.mesh.cpu().numpy()
    where = {int(r): idx for idx, r in np.ndenumerate(grid)}
    members = [where[int(r)] for r in mesh.mesh.reshape(-1).tolist()]
    coord = root.get_coordinate()
    if coord is None:
        return True
    return any(grid.shape[i] > 1 and len({m[i] for m in members}) == 1 and coord[i] != 0
               for i in range(grid.ndim))


def box_indices(shape: tuple[int, ...], placements: tuple, mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                name: str = "") -> list[np.ndarray] | None:
    """:func:`dtensor_indices` of a tensor of ``shape`` with ``placements`` at ``coord`` of a mesh
    of ``mesh_shape``.

    Placements, left to right as DTensor applies them: ``Shard(d)`` (``torch.chunk`` of what the
    earlier mesh dims left of dim ``d``), ``_StridedShard(d, split_factor=s)`` (what FSDP2 over TP
    makes: what is left of dim ``d`` cut in ``s`` chunks, each cut in the mesh dim's size, this
    coordinate's part of every one of them, in order), ``Replicate``. Anything else
    (``Partial``) raises ``ValueError`` naming ``name`` and the placement.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    idx = [np.arange(s, dtype=np.int64) for s in shape]
    for mesh_dim, pl in enumerate(placements):
        n, k = mesh_shape[mesh_dim], coord[mesh_dim]
        if isinstance(pl, _StridedShard):
            sf = int(pl.split_factor)
            cur = idx[pl.dim]
            idx[pl.dim] = np.concatenate([_chunk(_chunk(cur, sf, j), n, k) for j in range(sf)])
        elif isinstance(pl, Shard):
            idx[pl.dim] = _chunk(idx[pl.dim], n, k)
        elif isinstance(pl, Replicate):
            if k != 0:
                return None
        else:
            raise ValueError(f"{name}: placement {pl!r} is not supported (Shard, _StridedShard and Replicate are)")
    return idx


def flat_runs(shape: tuple[int, ...], idx: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of consecutive row-major flat positions that the box
    ``product(idx)`` of a tensor of ``shape`` covers, in the box's own row-major order (so run ``k``
    holds local elements ``[sum(lengths[:k]), sum(lengths[:k + 1]))``)."""
    if not shape:
        return np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64)
    if any(i.shape[0] == 0 for i in idx):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    j = len(shape) - 1  # innermost dim not held whole: everything inside it is one flat block
    while j >= 0 and idx[j].shape[0] == shape[j]:
        j -= 1
    if j < 0:
        return np.zeros(1, dtype=np.int64), np.array([int(np.prod(shape))], dtype=np.int64)
    inner = int(np.prod(shape[j + 1:], dtype=np.int64))
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    cut = np.flatnonzero(np.diff(idx[j]) != 1) + 1
    a = idx[j][np.concatenate([[0], cut])]
    lens = np.diff(np.concatenate([[0], cut, [idx[j].shape[0]]]))
    outer = np.zeros(1, dtype=np.int64)
    for d in range(j):
        outer = (outer[:, None] + idx[d][None, :] * strides[d]).reshape(-1)
    starts = (outer[:, None] + (a * inner)[None, :]).reshape(-1)
    lengths = np.broadcast_to(lens * inner, (outer.shape[0], lens.shape[0])).reshape(-1).astype(np.int64)
    return starts, lengths


def _pieces_of_runs(index: int, spec: TensorSpec, t: torch.Tensor, out: torch.dtype, starts: np.ndarray,
                    lengths: np.ndarray, locs: np.ndarray) -> list[Piece]:
    """The pieces of runs (global ``starts``, ``lengths``, local positions ``locs`` in the flat
    local tensor): one flat piece per run when there is one or all are long, else one strided piece."""
    keep = lengths > 0
    starts, lengths, locs = starts[keep], lengths[keep], locs[keep]
    if starts.shape[0] == 0:
        return []
    consecutive = bool(np.all(locs[1:] == locs[:-1] + lengths[:-1]))
    if starts.shape[0] == 1 or int(lengths.min()) >= MIN_RUN or not consecutive:
        return [Piece(index, spec, int(s), int(n), t, out, at=int(a)) for s, n, a in zip(starts, lengths, locs)]
    return [Piece(index, spec, int(starts[0]), int(lengths.sum()), t, out, at=int(locs[0]), runs=(starts, lengths))]


def _held(names: Collection[str] | None, v: View) -> bool:
    return names is None or v.name in names or v.source in names


def published_table(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16,
                    overrides: Mapping[str, torch.dtype] | None = None,
                    held: Collection[str] | None = None) -> tuple[list[TensorSpec], list[Piece]]:
    """(tensor table of ``model``, pieces this process publishes), in table order.

    ``overrides``: rollout dtype per tensor name where it differs from ``dtype`` (for floating
    tensors; integer and bool tensors always keep their dtype). A name is a checkpoint name, or
    an in-memory name whose checkpoint tensors all take that dtype.
    ``held``: the names this process publishes (checkpoint names, or in-memory names standing for
    all their checkpoint tensors: vLLM's ``WeightSource.held_names()``); ``None``: all. The others
    are not read at all (they may be on the ``meta`` device). A DTensor's pieces are the elements
    its placements give this rank (:func:`dtensor_indices`); a refused placement raises
    ``ValueError`` naming the parameter.
    """
    overrides = dict(overrides or {})
    held = None if held is None else set(held)
    used: set[str] = set()
    specs: list[TensorSpec] = []
    pieces: list[Piece] = []
    tensors = unique_tensors(model)
    boxes: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
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
        if not _held(held, v):
            continue
        if _is_dtensor(t):
            if v.source not in boxes:
                idx = dtensor_indices(t, v.source)
                boxes[v.source] = None if idx is None else flat_runs(tuple(t.shape), idx)
            box = boxes[v.source]
            if box is None:
                continue
            starts, lengths = box
            locs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            if v.whole:
                pieces.extend(_pieces_of_runs(index, spec, t, out, starts, lengths, locs))
                continue
            if not v.contiguous:
                raise ValueError(f"{v.name}: a strided view of the sharded {v.source}; only checkpoint tensors "
                                 "that are one flat range of a sharded parameter are supported")
            a = np.maximum(starts, v.offset)
            b = np.minimum(starts + lengths, v.offset + spec.numel)
            pieces.extend(_pieces_of_runs(index, spec, t, out, a - v.offset, np.maximum(b - a, 0), locs + a - starts))
        elif v.contiguous:
            pieces.append(Piece(index, spec, 0, spec.numel, t, out, at=v.offset))
        else:
            pieces.append(Piece(index, spec, 0, spec.numel, t, out, view=v))
    unknown = set(overrides) - used
    if unknown:
        raise ValueError(f"dtype overrides name tensors the model does not have: {sorted(unknown)}")
    return specs, pieces


@dataclass(frozen=True)
class RankShare:
    """What one rank says about its share at start: its table (what its model holds; the full one when
    its model has every tensor), the elements it publishes per name, the names it holds as strided
    pieces, and the error its planning raised (every rank then raises it)."""

    specs: list[TensorSpec]
    elements: dict[str, int]
    strided: frozenset[str]
    error: str | None = None


def share_of(specs: list[TensorSpec], pieces: list[Piece], error: BaseException | None = None) -> RankShare:
    elements: dict[str, int] = {}
    for p in pieces:
        elements[p.spec.name] = elements.get(p.spec.name, 0) + p.numel
    return RankShare(specs, elements, frozenset(p.spec.name for p in pieces if p.runs is not None),
                     None if error is None else f"{type(error).__name__}: {error}")


def agree_table(shares: list[RankShare], given: list[TensorSpec] | None = None) -> tuple[list[TensorSpec], frozenset[str]]:
    """(the published table, the names encoded on rank 0 as strided) from every rank's share.

    The table is ``given`` (e.g. vLLM's ``WeightSource.metadata()`` in checkpoint names), else the
    ranks' tables if they agree, else their union in rank order (pipeline stages whose modules hold
    only their own layers). Raises ``ValueError`` naming the first tensor that no rank holds, that
    more than one rank holds (its elements published twice), or whose spec differs between ranks;
    and with a rank's error if a rank's planning failed (a placement it refuses)."""
    for r, s in enumerate(shares):
        if s.error is not None:
            raise ValueError(f"rank {r}: {s.error}")
    if given is not None:
        table = list(given)
    elif all(s.specs == shares[0].specs for s in shares):
        table = list(shares[0].specs)
    else:
        table, seen = [], {}
        for s in shares:
            for spec in s.specs:
                if spec.name not in seen:
                    seen[spec.name] = spec
                    table.append(spec)
    by_name = {s.name: s for s in table}
    for r, share in enumerate(shares):
        for spec in share.specs:
            if spec.name in share.elements and by_name.get(spec.name) != spec:
                raise ValueError(f"{spec.name}: rank {r} holds it as {spec.dtype} {list(spec.shape)}, the table "
                                 f"has {by_name[spec.name] if spec.name in by_name else 'no such tensor'}")
    for spec in table:
        holders = [r for r, s in enumerate(shares) if s.elements.get(spec.name)]
        total = sum(s.elements.get(spec.name, 0) for s in shares)
        if not holders:
            raise ValueError(f"{spec.name}: held by no rank (every tensor of the table must be published by one)")
        if total != spec.numel:
            raise ValueError(f"{spec.name}: ranks {holders} publish {total} elements of its {spec.numel} (a tensor "
                             "must be held by exactly one rank, or sharded so that each element is)")
    return table, frozenset().union(*(s.strided for s in shares))


def rebind(pieces: list[Piece], table: list[TensorSpec], strided: frozenset[str]) -> list[Piece]:
    """``pieces`` indexed in ``table``, and strided where their tensor is strided on some rank (so that
    no flat segment of one rank overlaps the segments rank 0 encodes for that tensor)."""
    index = {s.name: i for i, s in enumerate(table)}
    out = []
    for p in pieces:
        runs = p.runs
        if runs is None and p.spec.name in strided:
            runs = (np.array([p.offset], dtype=np.int64), np.array([p.numel], dtype=np.int64))
        out.append(Piece(index[p.spec.name], table[index[p.spec.name]], p.offset, p.numel, p.source, p.dtype, p.at,
                         p.view, runs))
    return out
