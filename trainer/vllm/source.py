"""From vLLM's ``WeightSource`` to what a :class:`~trainer.publisher.Publisher` reads, per trainer rank.

A Publisher reads a ``torch.nn.Module`` (its checkpoint table, :mod:`trainer.pieces`). Two ways
to give it one:

- **The module itself**: a plain ``ModuleSource`` (exactly that class) in a process that is not
  one of several ``torch.distributed`` ranks (:func:`module_of`), or whose module holds DTensor
  parameters (FSDP2, FSDP2 over TP: :func:`sharded_module`). The publisher reads the module's
  memory bucket by bucket (accelerator memory: one bucket), under its checkpoint names (a MoE
  block's fused experts as the per-expert tensors ``save_pretrained`` writes), with no copy; of a
  DTensor, the elements its placements give this rank, with no gather.
- **A mirror** (:class:`SourceMirror`) of any other source: before each version the source is
  iterated and what it yields is copied into host tensors of the rollout dtype (the cast the
  publisher would make), under the names it yields (a source's names are the checkpoint names
  vLLM loads). Of a source with ``held_names()``, the mirror holds those tensors only.

An :class:`Extraction` is what one rank does per version; the engine holds one, chosen the same
way on every rank (:func:`is_sharded`):

- a replicated trainer (one process, or DDP-like ranks that each hold the whole model): rank 0
  runs a :class:`WholeModel` (the whole model published from its memory, ``solo``); every other
  rank a :class:`Follower` (iterates the source when rank 0 does, since materialising is a
  collective: FSDP ``full_tensor``, a Megatron export; publishes nothing);
- a sharded trainer (``held_names()`` is not ``None``: pipeline stages, expert splits; or a
  ``ModuleSource`` of DTensors in a world of several ranks): every rank runs :class:`Sharded`, a
  Publisher over what it holds (rank 0 with the node, docs/TRAINER.md "Sharded trainers"); no
  rank gathers or allocates a tensor it does not hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

from trainer.pieces import hold_at
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


def _has_dtensors(module: torch.nn.Module) -> bool:
    from trainer.pieces import _is_dtensor

    return any(_is_dtensor(t) for t in module.state_dict(keep_vars=True).values())


def sharded_module(source: Any) -> torch.nn.Module | None:
    """The module of a plain ``ModuleSource`` that holds DTensors (FSDP2, FSDP2 over TP) in a world of
    several ranks: each rank reads its shards of it in place (:class:`Sharded`)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    if type(source) is not ModuleSource or world_size() == 1:
        return None
    module = getattr(source, "_module", None)
    return module if isinstance(module, torch.nn.Module) and _has_dtensors(module) else None


def held_of(source: Any) -> frozenset[str] | None:
    """``source.held_names()`` as a set (``None``: the source yields the whole model)."""
    held = source.held_names() if callable(getattr(source, "held_names", None)) else None
    if held is None:
        return None
    if isinstance(held, str) or not all(isinstance(n, str) for n in held):
        raise InitInfoError("source", f"held_names() must be a collection of names, got {held!r}")
    return frozenset(held)


def is_sharded(source: Any) -> bool:
    """Whether this rank's source is one rank's share of a sharded trainer (see module doc)."""
    return held_of(source) is not None or sharded_module(source) is not None


def published_names(module: torch.nn.Module, rank: int) -> frozenset[str] | None:
    """The ``held`` of rank ``rank``'s Publisher over a module of DTensors: every DTensor (its
    placements say which elements), and on rank 0 the plain tensors too (buffers, parameters FSDP
    left whole: the same on every rank, so one rank publishes them)."""
    if rank == 0:
        return None
    from p2psync.checkpoint_names import unique_tensors
    from trainer.pieces import _is_dtensor

    return frozenset(n for n, t in unique_tensors(module).items() if _is_dtensor(t))


def check_source(source: Any) -> None:
    """Refuse a source this engine cannot publish from (:class:`InitInfoError` naming ``source``)."""
    if source is None:
        raise InitInfoError("source", "missing: give trainer_init a WeightSource of the trainer's weights "
                            "(e.g. vllm.distributed.weight_transfer.base.ModuleSource(model))")
    if not (callable(getattr(source, "metadata", None)) and callable(getattr(source, "__iter__", None))):
        raise InitInfoError("source", f"must be a WeightSource (metadata() and iteration), got "
                            f"{type(source).__name__}")


def table_of(metadata: Iterable[Any], dtype: torch.dtype, overrides: Mapping[str, torch.dtype] | None = None
             ) -> list[Any]:
    """The published table of a source's ``metadata()``: its names and full shapes, floating tensors in
    ``dtype`` (or ``overrides[name]``), others as they are (``TensorSpec`` list, metadata order)."""
    from p2psync import dtypes
    from p2psync.errors import CodecError
    from p2psync.state import TensorSpec

    overrides = dict(overrides or {})
    out = []
    for meta in metadata:
        dt = overrides.get(meta.name, dtype) if meta.dtype.is_floating_point else meta.dtype
        try:
            code = dtypes.from_torch(dt).code
        except CodecError as exc:
            raise InitInfoError("source", f"{meta.name}: {exc}") from None
        out.append(TensorSpec(meta.name, code, tuple(int(s) for s in meta.shape)))
    return out


class SourceMirror(torch.nn.Module):
    """Host copies of a source's tensors as of its last pass, in the rollout dtype, under its names.

    Floating tensors are held in ``dtype`` (or ``overrides[name]``), others as they are. Its
    ``state_dict`` is the source's table (names split at dots into submodules, so a checkpoint
    name is a state-dict key), which is what the publisher reads. ``held``: only these names are
    held (a rank of a sharded trainer, ``WeightSource.held_names()``); a pass yields ``None`` for
    the others, and a tensor it yields for one of them is not kept (another rank publishes it).
    """

    def __init__(self, metadata: Iterable[Any], dtype: torch.dtype,
                 overrides: Mapping[str, torch.dtype] | None = None, held: Collection[str] | None = None) -> None:
        super().__init__()
        overrides = dict(overrides or {})
        self.held: dict[str, torch.Tensor] = {}
        self.names: set[str] = set()
        """Every name of the metadata (held here or not)."""
        for meta in metadata:
            name = meta.name
            if not isinstance(name, str) or not name or name in self.names:
                raise InitInfoError("source", f"metadata() names {name!r} {'twice' if name in self.names else ''}"
                                    .rstrip())
            self.names.add(name)
            if held is not None and name not in held:
                continue
            out = overrides.get(name, dtype) if meta.dtype.is_floating_point else meta.dtype
            t = torch.empty(tuple(meta.shape), dtype=out)
            try:
                hold_at(self, name, t)
            except (KeyError, TypeError) as exc:
                raise InitInfoError("source", f"cannot hold {name!r} under its name: {exc}") from None
            self.held[name] = t
        if not self.names:
            raise InitInfoError("source", "metadata() names no tensors")
        unknown = sorted(set(held or ()) - self.names)
        if unknown:
            raise InitInfoError("source", f"held_names() names {unknown[0]!r}, which its metadata() does not "
                                f"({len(unknown)} such)")

    def refresh(self, source: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Copy one pass of ``source`` in; every name held here must come exactly once, with a tensor."""
        seen: set[str] = set()
        with torch.no_grad():
            for name, t in source:
                if name not in self.names or name in seen:
                    raise InitInfoError("source", f"yielded {name!r} " + (
                        "twice in one pass" if name in seen else "which its metadata() does not name"))
                held = self.held.get(name)
                if held is None:  # another rank's (a sharded source yields None for it)
                    seen.add(name)
                    continue
                if t is None:
                    raise InitInfoError("source", f"yielded no tensor for {name!r}" + (
                        " (a rank that holds part of the model only: give held_names())"
                        if len(self.held) == len(self.names) else ", which its held_names() names"))
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


class Sharded(Extraction):
    """One rank of a sharded trainer: ``publisher`` (every rank's, rank 0's with the node) reads what
    this rank holds, either its module in place (DTensor shards) or a mirror of the tensors it holds
    that ``refresh`` fills from one pass of the source before each version.

    Every rank calls :meth:`publish` for every version. A rank whose pass over the source fails still
    takes part in the version's exchange (:meth:`~trainer.publisher.Publisher.publish_sync`'s
    ``failure``), so that every rank raises :class:`~trainer.publish_record.PublishError` and the node
    keeps the previous version. Returns once every rank knows the version's outcome (rank 0: the
    node holds it)."""

    def __init__(self, publisher: Any, refresh: Callable[[], None] | None = None) -> None:
        self.publisher = publisher
        self.refresh = refresh

    def start(self) -> int:
        """Version 0 (the first pass of a mirror is the engine's, at init). A share the ranks do not
        agree on (a tensor held by no rank or by two, a refused placement) raises
        :class:`InitInfoError` naming the tensor, on every rank."""
        try:
            return int(self.publisher.start_sync())
        except ValueError as exc:
            raise InitInfoError("source", str(exc)) from None

    def publish(self) -> int:
        failure: BaseException | None = None
        if self.refresh is not None:
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - every rank raises PublishError for this version
                failure = exc
        version = int(self.publisher.publish_sync(failure=failure))
        self.publisher.flush_sync()  # every rank: the outcome; rank 0: the node holds it
        return version

    def close(self) -> None:
        self.publisher.close_sync()
