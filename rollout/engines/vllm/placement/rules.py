"""Hand-written placement rules (fused layouts, tied weights, TP shards), and :class:`LayoutError`.

A vLLM model's placement is learnt from its own loaders
(:mod:`rollout.engines.vllm.placement.probe`); these rules serve modules without a
``load_weights`` (test stand-ins shaped like vLLM's), and a test on real vLLM
modules shows they agree with the derived placement where they apply.

The trainer publishes Hugging Face checkpoint tensors (``...q_proj.weight``,
``...gate_proj.weight``, one entry for tied embeddings). vLLM holds them in its
own parameters: ``qkv_proj`` stacks ``[q; k; v]`` rows and ``gate_up_proj``
stacks ``[gate; up]`` rows (the model's ``packed_modules_mapping``), a tied
``lm_head`` is the embedding's own parameter, the vocabulary is padded, and with
tensor parallelism every rank holds a slice: column-parallel layers (and their
fused shards, the embedding and ``lm_head``) split rows, row-parallel layers split
columns, everything else is replicated.

:func:`place` turns a checkpoint name and shape into the :class:`Piece` of it this
rank holds: checkpoint rows ``rows`` and columns ``cols`` sit at row ``at_row``
(column 0) of parameter ``param``. ``counted`` says whether this rank's elements
count towards the fingerprint (replicated pieces count on one rank only, so that
per-rank sums of element hashes add up to the trainer's). Only the model's module
attributes are read (the sizes and shards vLLM's layers record, never a class name), so the rules
are testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2psync.errors import P2PSyncError


class LayoutError(P2PSyncError):
    """A checkpoint tensor has no place in the vLLM model, or not the shape the model expects."""


@dataclass(frozen=True)
class Piece:
    """Checkpoint rows ``rows`` x columns ``cols`` held at ``param[at_row:...,: cols width]``."""

    name: str
    """Checkpoint (trainer table) name."""
    param: str
    """vLLM parameter name (as ``model.named_parameters()`` says)."""
    shape: tuple[int, ...]
    """The checkpoint tensor's full shape."""
    rows: tuple[int, int]
    cols: tuple[int, int]
    at_row: int
    counted: bool = True

    @property
    def width(self) -> int:
        """Columns of the checkpoint tensor (1 for a vector)."""
        return self.shape[1] if len(self.shape) == 2 else 1

    @property
    def whole(self) -> bool:
        """The piece is the whole checkpoint tensor (no tensor-parallel split)."""
        return self.rows == (0, self.shape[0] if self.shape else 1) and self.cols == (0, self.width)


def _parent(model: Any, param: str) -> Any:
    mod = model
    for part in param.split(".")[:-1]:
        mod = getattr(mod, part)
    return mod


def _fused(model: Any, name: str, params: dict[str, Any]) -> tuple[str, int] | None:
    """``(fused parameter name, shard index)`` if ``name`` is a shard of a fused vLLM layer."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    parts = name.split(".")
    if len(parts) < 2:
        return None
    for fused, shards in packed.items():
        if parts[-2] in shards:
            candidate = ".".join(parts[:-2] + [fused, parts[-1]])
            if candidate in params:
                return candidate, list(shards).index(parts[-2])
    return None


def _tp(layer: Any) -> tuple[int, int]:
    return int(getattr(layer, "tp_rank", 0) or 0), int(getattr(layer, "tp_size", 1) or 1)


def _split(layer: Any) -> str | None:
    """How a tensor-parallel linear layer splits its weight across ranks, read from the sizes vLLM's
    linear layers record (``vllm/model_executor/layers/linear.py``, CPU and CUDA builds alike):
    ``"rows"`` when a rank holds ``output_size_per_partition`` of ``output_size`` output rows
    (``ColumnParallelLinear`` and its fused subclasses), ``"columns"`` when it holds
    ``input_size_per_partition`` of ``input_size`` input columns (``RowParallelLinear``); None for
    anything else (``ReplicatedLinear`` records no per-partition sizes). What the layer holds decides,
    not its class's name (an out-of-tree replacement of a layer class records the same sizes)."""
    try:
        out_part, out = int(layer.output_size_per_partition), int(layer.output_size)
        in_part, inp = int(layer.input_size_per_partition), int(layer.input_size)
    except (AttributeError, TypeError):
        return None
    if out_part < out and in_part == inp:
        return "rows"
    if in_part < inp and out_part == out:
        return "columns"
    return None


def _rows_split(name: str, param: str, shape: tuple[int, ...], start: int, size: int, at_row: int,
                counted: bool = True) -> Piece:
    width = shape[1] if len(shape) == 2 else 1
    if start + size > shape[0]:
        raise LayoutError(f"{name}: rows [{start}, {start + size}) beyond its {shape[0]} rows")
    return Piece(name, param, shape, (start, start + size), (0, width), at_row, counted)


def place(model: Any, name: str, shape: tuple[int, ...], params: dict[str, Any], tp_rank: int = 0) -> Piece:
    """The piece of checkpoint tensor ``name`` (``shape``) this rank holds (see module doc).

    ``params`` is ``dict(model.named_parameters())`` (tied parameters appear once); ``tp_rank`` is
    this worker's tensor-parallel rank (replicated layers, e.g. norms, do not carry one)."""
    shape = tuple(shape)
    if len(shape) > 2:
        raise LayoutError(f"{name}: {len(shape)}-D tensors are not mapped (shape {shape})")
    fused = _fused(model, name, params)
    if fused is not None:
        param, k = fused
        layer = _parent(model, param)
        rank, size = _tp(layer)
        if hasattr(layer, "num_kv_heads") and hasattr(layer, "head_size"):  # QKVParallelLinear
            hd = int(layer.head_size)
            q, kv = int(layer.num_heads) * hd, int(layer.num_kv_heads) * hd
            replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
            if k == 0:
                return _rows_split(name, param, shape, rank * q, q, 0)
            # A kv head shared by ``replicas`` ranks counts once (on the first of them).
            return _rows_split(name, param, shape, (rank // replicas) * kv, kv, q + (k - 1) * kv,
                               counted=rank % replicas == 0)
        sizes = [int(s) // size for s in layer.output_sizes]  # MergedColumnParallelLinear: global sizes
        return _rows_split(name, param, shape, rank * sizes[k], sizes[k], sum(sizes[:k]))
    param = name
    if param not in params:
        # A tied output layer: vLLM holds one parameter for both names.
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if name == "lm_head.weight" and tied:
            emb = [p for p in params if p.endswith("embed_tokens.weight")]
            if len(emb) == 1:
                param = emb[0]
        if param not in params:
            raise LayoutError(f"{name}: no vLLM parameter of that name or fused layer holding it")
    layer = _parent(model, param)
    rank, size = _tp(layer)
    shard = getattr(layer, "shard_indices", None)
    if shard is not None:  # VocabParallelEmbedding / ParallelLMHead: padded vocabulary rows
        start, stop = int(shard.org_vocab_start_index), int(shard.org_vocab_end_index)
        return _rows_split(name, param, shape, start, stop - start, 0)
    split = _split(layer) if size > 1 else None
    if split == "columns" and param.endswith(".weight"):
        k = shape[1] // size
        return Piece(name, param, shape, (0, shape[0]), (rank * k, (rank + 1) * k), 0)
    if split == "rows":
        n = shape[0] // size
        return _rows_split(name, param, shape, rank * n, n, 0)
    # Replicated on every rank (norms, row-parallel biases): counted on rank 0 only.
    return _rows_split(name, param, shape, 0, shape[0] if shape else 1, 0, counted=max(rank, tp_rank) == 0)


def check_piece(piece: Piece, param_shape: tuple[int, ...]) -> None:
    """Raise :class:`LayoutError` unless the parameter can hold ``piece`` where it says."""
    ncols = piece.cols[1] - piece.cols[0]
    nrows = piece.rows[1] - piece.rows[0]
    if len(param_shape) != max(1, len(piece.shape)):
        raise LayoutError(f"{piece.name}: parameter {piece.param} has shape {tuple(param_shape)}, "
                          f"checkpoint tensor has {piece.shape}")
    if len(piece.shape) == 2 and param_shape[1] != ncols:
        raise LayoutError(f"{piece.name}: parameter {piece.param} has {param_shape[1]} columns, "
                          f"the piece {ncols}")
    if piece.at_row + nrows > param_shape[0]:
        raise LayoutError(f"{piece.name}: rows [{piece.at_row}, {piece.at_row + nrows}) beyond the "
                          f"{param_shape[0]} rows of {piece.param}")
