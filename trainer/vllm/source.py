"""From vLLM's ``WeightSource`` to what a :class:`~trainer.publisher.Publisher` reads, per trainer rank.

A Publisher reads a ``torch.nn.Module`` (its checkpoint table, :mod:`trainer.pieces`). Two ways
to give it one:

- **The module itself** (:func:`module_of`): a plain ``ModuleSource`` in a process that is not
  one of several ``torch.distributed`` ranks. The publisher reads the module's memory bucket by
  bucket (accelerator memory: one bucket), under its checkpoint names (a MoE block's fused
  experts as the per-expert tensors ``save_pretrained`` writes), with no copy.
- **A mirror** (:class:`SourceMirror`) of any other source: before each version the source is
  iterated and what it yields is copied into host tensors of the rollout dtype (the cast the
  publisher would make), under the names it yields (a source's names are the checkpoint names
  vLLM loads). Materialising is a collective (FSDP ``full_tensor``, a Megatron export), so every
  rank iterates the source in step; only rank 0 keeps what it yields.

An :class:`Extraction` is what one rank does per version; the engine holds one. Rank 0 runs a
:class:`WholeModel` (the whole model published from its memory); every other rank a
:class:`Follower` (iterates the source, publishes nothing). A sharded producer (each rank
publishing what it holds, rank 0 signing one manifest, as :mod:`trainer.shard_io` already does
for FSDP2) is a third :class:`Extraction` on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from trainer.vllm.info import InitInfoError


def world_size() -> int:
    """Ranks of the default ``torch.distributed`` group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def module_of(source: Any) -> torch.nn.Module | None:
    """The module a plain ``ModuleSource`` iterates, where the publisher may read it directly (see module doc)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    # Exactly ModuleSource: a subclass may rename, filter or convert what it yields.
    if type(source) is not ModuleSource or world_size() > 1:
        return None
    module = getattr(source, "_module", None)  # ModuleSource keeps its module there (vLLM 0.32)
    return module if isinstance(module, torch.nn.Module) else None


def check_source(source: Any) -> None:
    """Refuse a source this engine cannot publish from (:class:`InitInfoError` naming ``source``)."""
    if source is None:
        raise InitInfoError("source", "missing: give trainer_init a WeightSource of the trainer's weights "
                            "(e.g. vllm.distributed.weight_transfer.base.ModuleSource(model))")
    if not (callable(getattr(source, "metadata", None)) and callable(getattr(source, "__iter__", None))):
        raise InitInfoError("source", f"must be a WeightSource (metadata() and iteration), got "
                            f"{type(source).__name__}")
    held = source.held_names() if callable(getattr(source, "held_names", None)) else None
    if held is not None:
        raise InitInfoError("source", "held_names() splits the model across ranks (pipeline or expert "
                            "parallel); the p2psync trainer engine publishes whole models from rank 0 only")


class SourceMirror(torch.nn.Module):
    """Host copies of a source's tensors as of its last pass, in the rollout dtype, under its names.

    Floating tensors are held in ``dtype`` (or ``overrides[name]``), others as they are. Its
    ``state_dict`` is the source's table (names split at dots into submodules, so a checkpoint
    name is a state-dict key), which is what the publisher reads.
    """

    def __init__(self, metadata: Iterable[Any], dtype: torch.dtype,
                 overrides: Mapping[str, torch.dtype] | None = None) -> None:
        super().__init__()
        overrides = dict(overrides or {})
        self.held: dict[str, torch.Tensor] = {}
        for meta in metadata:
            name = meta.name
            if not isinstance(name, str) or not name or name in self.held:
                raise InitInfoError("source", f"metadata() names {name!r} {'twice' if name in self.held else ''}"
                                    .rstrip())
            out = overrides.get(name, dtype) if meta.dtype.is_floating_point else meta.dtype
            t = torch.empty(tuple(meta.shape), dtype=out)
            *path, leaf = name.split(".")
            owner: torch.nn.Module = self
            try:
                for part in path:
                    child = owner._modules.get(part)
                    if child is None:
                        child = torch.nn.Module()
                        owner.add_module(part, child)
                    owner = child
                owner.register_buffer(leaf, t)
            except (KeyError, TypeError) as exc:
                raise InitInfoError("source", f"cannot hold {name!r} under its name: {exc}") from None
            self.held[name] = t
        if not self.held:
            raise InitInfoError("source", "metadata() names no tensors")

    def refresh(self, source: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Copy one pass of ``source`` in; every name of its metadata must come exactly once."""
        seen: set[str] = set()
        with torch.no_grad():
            for name, t in source:
                held = self.held.get(name)
                if held is None or name in seen:
                    raise InitInfoError("source", f"yielded {name!r} " + (
                        "twice in one pass" if name in seen else "which its metadata() does not name"))
                if t is None:
                    raise InitInfoError("source", f"yielded no tensor for {name!r} (a rank that holds part "
                                        "of the model only)")
                if tuple(t.shape) != tuple(held.shape):
                    raise InitInfoError("source", f"yielded {name!r} of shape {tuple(t.shape)}, its metadata() "
                                        f"says {tuple(held.shape)}")
                held.copy_(t.detach().to(dtype=held.dtype))  # cast where the tensor lives: fewer bytes moved
                seen.add(name)
        missing = [n for n in self.held if n not in seen]
        if missing:
            raise InitInfoError("source", f"one pass did not yield {missing[0]!r} ({len(missing)} missing)")


def drain(source: Iterable[Any]) -> None:
    """One pass over ``source``, keeping nothing (the collectives of materialising, in step with rank 0)."""
    for _ in source:
        pass


class Extraction(ABC):
    """What one trainer rank does for the versions the engine publishes."""

    @abstractmethod
    def start(self) -> int | None:
        """Publish the first version (rank 0: returns it, once the node holds it)."""

    @abstractmethod
    def publish(self) -> int | None:
        """Publish the source's current weights as the next version (rank 0: returns it, once the node holds it)."""

    def close(self) -> None:
        """Finish what is pending and release threads (idempotent)."""


class WholeModel(Extraction):
    """Rank 0 publishes the whole model: ``publisher`` reads either the source's module or a mirror that
    ``refresh`` fills from one pass of the source before each version."""

    def __init__(self, publisher: Any, refresh: Callable[[], None] | None = None) -> None:
        self.publisher = publisher
        self.refresh = refresh

    def start(self) -> int:
        if self.refresh is not None:
            self.refresh()
        return int(self.publisher.start_sync())

    def publish(self) -> int:
        if self.refresh is not None:
            self.refresh()
        version = int(self.publisher.publish_sync())
        self.publisher.flush_sync()  # the workers pull it next: the node must hold it
        return version

    def close(self) -> None:
        self.publisher.close_sync()


class Follower(Extraction):
    """A rank that publishes nothing: it iterates the source in step with rank 0 (when rank 0 iterates it)."""

    def __init__(self, source: Iterable[Any], iterate: bool) -> None:
        self.source = source
        self.iterate = iterate

    def start(self) -> None:
        if self.iterate:
            drain(self.source)
        return None

    def publish(self) -> None:
        if self.iterate:
            drain(self.source)
        return None
