"""The tensor table under checkpoint names: where each tensor of a model's checkpoint on disk lies in
the model's memory.

transformers 5.x converts some checkpoints when it loads them and converts back when it saves
them (``save_pretrained``): a mixture-of-experts block holds its experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) while the
checkpoint, which vLLM and every other engine load, holds ``mlp.experts.{e}.gate_proj.weight``,
``up_proj`` and ``down_proj`` per expert. p2psync publishes, applies and fingerprints the
checkpoint's table, so that the trainer, the transformers engine, vLLM and ``p2psync delta`` on
checkpoint folders agree on one table.

How the mapping is found. Not by rules per architecture: :func:`checkpoint_views` runs
transformers' own save-time conversion (``revert_weight_conversion``, what ``save_pretrained``
applies) on *meta* tensors shaped like the model's, with ``Tensor.contiguous`` made a no-op (it
never changes values, only where they are stored). Every checkpoint tensor that comes out as a
view of one in-memory tensor is that tensor's elements at an offset with strides (a
:class:`View`): the trainer reads it and the engines write it in place, with no copy of the
model. A checkpoint tensor the conversion builds from several in-memory tensors or by a copying
permutation (``torch.cat``, interleaving) is not a view: its in-memory tensors keep their
in-memory names (with a warning), as they would without a conversion. Models without a
conversion (dense Llama / Qwen / Mistral ...) keep their ``state_dict`` names, order and
therefore fingerprints.

Table order: ``state_dict`` order of the in-memory tensors (tied weights once, first name, as
before); an in-memory tensor split by the conversion is replaced, where it stood, by its
checkpoint tensors in natural name order (``experts.2`` before ``experts.10``).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2psync.errors import CheckpointLayoutError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= max(1, s)
    return tuple(reversed(out))


@dataclass(frozen=True)
class View:
    """Checkpoint tensor ``name`` is ``as_strided(source, shape, stride, offset)`` of the in-memory
    tensor ``source`` (a ``state_dict`` name; offsets and strides in elements of its full,
    row-major tensor)."""

    name: str
    source: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    source_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def contiguous(self) -> bool:
        """Its elements are one flat range ``[offset, offset + numel)`` of the source, in order."""
        return self.numel <= 1 or all(st == c for s, st, c in zip(self.shape, self.stride,
                                                                   contiguous_strides(self.shape)) if s != 1)

    @property
    def whole(self) -> bool:
        """The source itself (maybe renamed)."""
        return self.offset == 0 and self.shape == self.source_shape and self.contiguous

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This view of ``tensor`` (the in-memory tensor ``source``, a plain tensor): shares its memory."""
        t = tensor.detach()
        if self.whole:
            return t
        if not t.is_contiguous():
            raise CheckpointLayoutError(self.name, f"its in-memory tensor {self.source} is not contiguous")
        return t.as_strided(self.shape, self.stride, t.storage_offset() + self.offset)


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """Sort key comparing the numbers in a dotted name as numbers (``experts.2`` < ``experts.10``)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.]", name)]


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict(keep_vars=True)`` with every tensor once (tied weights keep their first name)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _identity(tensors: Mapping[str, Any]) -> list[View]:
    out = []
    for n, t in tensors.items():
        shape = tuple(int(s) for s in t.shape)
        out.append(View(n, n, shape, contiguous_strides(shape), 0, shape))
    return out


def _reverted_on_meta(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[int, str]] | None:
    """transformers' save-time conversion of meta stand-ins of ``tensors``, or ``None`` if the model
    has none. Returns (checkpoint name -> meta tensor, id of each stand-in -> in-memory name)."""
    # A PreTrainedModel exists only once transformers is imported: a process that has not imported
    # it (a plain torch trainer) holds none, and importing it here would pull in transformers'
    # own imports (accelerate, triton, ...) for nothing.
    if "transformers" not in sys.modules:
        return None
    try:
        import torch
        from torch.overrides import TorchFunctionMode
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers not installed, or a version without load-time conversions
        return None
    if not isinstance(model, PreTrainedModel):
        return None

    class _NoCopies(TorchFunctionMode):
        # ``contiguous`` never changes values, only where they live: skipping it keeps views views.
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.Tensor.contiguous:
                return args[0]
            return func(*args, **(kwargs or {}))

    meta = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in tensors.items()}
    sources = {id(t): n for n, t in meta.items()}
    with _NoCopies():
        out = revert_weight_conversion(model, dict(meta))
    if out is meta or (list(out) == list(meta) and all(out[n] is meta[n] for n in meta)):
        return None
    return out, sources


def checkpoint_views(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor] | None = None) -> list[View]:
    """The model's tensor table under checkpoint names, in table order (see module doc).

    ``tensors``: the in-memory tensors to map (default :func:`unique_tensors`; DTensors map by
    their full shapes). Raises :class:`~p2psync.errors.CheckpointLayoutError` naming a checkpoint
    tensor whose elements would be published twice or not at all.
    """
    if tensors is None:
        tensors = unique_tensors(model)
    got = _reverted_on_meta(model, tensors)
    if got is None:
        return _identity(tensors)
    reverted, sources = got
    by_source: dict[str, list[View]] = {}
    copied: list[str] = []
    for name, t in reverted.items():
        root = t if t._base is None else t._base
        src = sources.get(id(root))
        if src is None:  # built by the conversion (cat, interleave, ...): not a view
            copied.append(name)
            continue
        shape = tuple(int(s) for s in t.shape)
        source_shape = tuple(int(s) for s in tensors[src].shape)
        by_source.setdefault(src, []).append(
            View(name, src, shape, tuple(int(s) for s in t.stride()), int(t.storage_offset()), source_shape))
    unmapped = [n for n in tensors if n not in by_source]
    if copied:
        logger.warning("the checkpoint layout of %s is not a view of the model's memory (transformers' conversion "
                       "copies it); %s keep their in-memory names", ", ".join(sorted(copied)[:3]),
                       ", ".join(unmapped[:3]) or "no tensors")
    out: list[View] = []
    for src, t in tensors.items():
        views = by_source.get(src)
        if views is None:
            shape = tuple(int(s) for s in t.shape)
            out.append(View(src, src, shape, contiguous_strides(shape), 0, shape))
            continue
        if len(views) == 1 and views[0].whole:  # the tensor itself, maybe renamed
            out.append(views[0])
            continue
        _check_cover(src, views)
        out.extend(sorted(views, key=lambda v: natural_key(v.name)))
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointLayoutError(dup[0], "two in-memory tensors map to this checkpoint name")
    return out


def _check_cover(source: str, views: list[View]) -> None:
    """Every element of ``source`` in exactly one view."""
    numel = 1
    for s in views[0].source_shape:
        numel *= s
    for v in views:
        last = v.offset + sum((n - 1) * st for n, st in zip(v.shape, v.stride) if n > 0)
        if v.numel and (v.offset < 0 or last >= numel or min(v.stride, default=0) < 0):
            raise CheckpointLayoutError(v.name, f"its view reaches outside {source}")
    if all(v.contiguous for v in views):
        at = 0
        for v in sorted(views, key=lambda v: v.offset):
            if v.offset != at:
                what = "overlaps another" if v.offset < at else "leaves elements of it out"
                raise CheckpointLayoutError(v.name, f"its view of {source} {what}")
            at += v.numel
        if at != numel:
            raise CheckpointLayoutError(views[-1].name, f"the checkpoint tensors of {source} leave elements out")
        return
    import torch

    hits = torch.zeros(numel, dtype=torch.int32)
    for v in views:
        hits.as_strided(v.shape, v.stride, v.offset).add_(1)
    if not bool((hits == 1).all()):
        raise CheckpointLayoutError(views[0].name, f"the checkpoint tensors of {source} do not cover it exactly once")


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the model's own memory for it (a view; no copies), in table order.

    Tied weights: the second name of a tied tensor is listed too (after the table's names), as
    long as the conversion leaves that tensor whole.
    """
    tensors = unique_tensors(model)
    views = checkpoint_views(model, tensors)
    out = {v.name: v.of(tensors[v.source]) for v in views}
    whole = {v.source: v.name for v in views if v.whole}
    firsts = {id(t): n for n, t in tensors.items()}
    for name, t in model.state_dict(keep_vars=True).items():
        first = firsts.get(id(t))
        if first is not None and first != name and first in whole and name not in out:
            out[name] = t.detach()
    return out
