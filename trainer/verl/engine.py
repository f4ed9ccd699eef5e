"""verl's checkpoint engine ``p2psync``: the class verl's registry resolves, and its trainer side.

verl 0.9.1 builds one registered class on both sides of a weight sync
(``verl/checkpoint_engine/base.py``): the actor worker calls
``CheckpointEngineRegistry.new(backend, is_master=rank == 0, bucket_size=..., **engine_kwargs)``
and then ``send_weights(get_per_tensor_param(), global_steps)``; the rollout's
``CheckpointEngineWorker`` calls ``CheckpointEngineRegistry.new(backend, bucket_size=...,
**engine_kwargs)`` (no ``is_master``) and hands ``receive_weights(global_steps)`` to its server
adapter. Between them ``CheckpointEngineManager`` runs, per sync, ``prepare`` on every worker,
the class's ``build_topology`` over what they returned, ``init_process_group`` with each
worker's share, the two transfers, and ``finalize``.

:class:`P2PSyncCheckpointEngine` is that class. Built without ``is_master`` it returns the
rollout side, :class:`rollout.verl.P2PSyncRolloutEngine`, imported by name: the trainer and the
rollout packages never import each other, and a trainer process never loads the rollout side.

The trainer side (rank 0 of the actor) runs a trainer node (:class:`~trainer.background.BackgroundNode`)
and a :class:`~trainer.publisher.Publisher` over :class:`NamedWeights`, a host copy of the stream
verl sends in the rollout dtype: the first sync publishes it as version 0 (a signed snapshot),
each later one as a signed sparse delta against the version before. Its ``prepare`` tells the
rollout side where the node is and which version this sync publishes; the rollout side makes its
vLLM engine reach exactly that version. Other actor ranks iterate the stream (verl assembles
each full tensor collectively) and keep nothing.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from p2psync import config as node_config
from p2psync.errors import ConfigError
from trainer.pieces import hold_at

logger = logging.getLogger(__name__)

BACKEND = "p2psync"
"""The name verl's rollout config selects (``checkpoint_engine.backend``)."""
ROLLOUT_SIDE = "rollout.verl:P2PSyncRolloutEngine"
"""The rollout side, by name (see module doc)."""


class NamedWeights(torch.nn.Module):
    """The weights verl streams, held on the host in the dtype the rollout engines hold them.

    One buffer per streamed name (``model.layers.0.mlp.up_proj.weight`` is the buffer ``weight`` of
    nested modules ``model``, ``layers``, ``0``, ...), in stream order: its ``state_dict`` is the
    checkpoint table the stream names, which is what :class:`~trainer.publisher.Publisher` publishes.
    Contract: after :meth:`load` of a stream, every buffer holds that stream's tensor, cast to its
    rollout dtype; a stream naming another table (a name added, missing or reshaped) is refused
    with ``ValueError`` before anything is copied.
    """

    def __init__(self, first: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16,
                 overrides: Mapping[str, torch.dtype] | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.overrides = dict(overrides or {})
        self.table: dict[str, torch.Tensor] = {}
        self.tied: set[str] = set()
        """Second names of tied tensors (not published; their first name carries the elements)."""
        aliases: dict[tuple[int, int, tuple[int, ...]], str] = {}
        for name, t in first:
            if name in self.table:
                raise ValueError(f"{name}: named twice in one stream")
            key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape)) if t.numel() else None
            if key is not None and key in aliases:
                # a tied weight (lm_head = embed_tokens) yielded under its second name: published
                # once, under its first, as save_pretrained writes it and vLLM loads it
                logger.info("p2psync: %s is %s (tied); published once, as %s", name, aliases[key], aliases[key])
                self.table[name] = self.table[aliases[key]]
                self.tied.add(name)
                continue
            if key is not None:
                aliases[key] = name
            held = self._cast(name, t).cpu().clone()
            self.table[name] = held
            hold_at(self, name, held)

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.is_floating_point():
            t = t.to(self.overrides.get(name, self.dtype))  # on the tensor's own device: one bf16 copy crosses
        return t

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``stream`` in (see the class doc)."""
        got: list[tuple[str, torch.Tensor]] = []
        for name, t in stream:
            held = self.table.get(name)
            if held is None:
                raise ValueError(f"{name}: not in the table of the first sync (a new tensor)")
            if tuple(t.shape) != tuple(held.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the first sync's was {tuple(held.shape)}")
            got.append((name, self._cast(name, t).cpu()))
        missing = [n for n in self.table if n not in {g for g, _ in got}]
        if missing:
            raise ValueError(f"{missing[0]}: missing from this sync's stream ({len(missing)} tensors missing)")
        with torch.no_grad():
            for name, t in got:
                if name not in self.tied:
                    self.table[name].copy_(t)


def topology(actor_world_size: int, rollout_world_size: int,
             metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """verl's ``build_topology`` for p2psync: every rollout worker gets actor rank 0's ``prepare``
    answer (the trainer node's address, key, and the version this sync publishes); the actor ranks
    get nothing. p2psync plans its own dissemination tree; verl's topology only carries the target."""
    if len(metadata) != actor_world_size + rollout_world_size:
        raise ValueError(f"metadata: {len(metadata)} answers for {actor_world_size} actor and "
                         f"{rollout_world_size} rollout workers")
    trainer = next((m for m in metadata[:actor_world_size] if m and m.get("role") == "trainer"), None)
    if trainer is None:
        raise ValueError("metadata: no actor rank answered prepare() as the trainer (is_master=True)")
    return {}, {"trainer": [dict(trainer)] * rollout_world_size}


class P2PSyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine ``p2psync`` (see module doc); the instance verl builds on an actor rank.

    ``engine_kwargs`` (verl's ``checkpoint_engine.engine_kwargs.p2psync``, the same table on both
    sides): ``node``: the trainer node, a TOML file or a table of :class:`~p2psync.config.NodeConfig`
    fields (role ``trainer``); ``publisher``: :class:`~trainer.publisher.Publisher` options
    (``chunk_size``, ``bucket_bytes``, ``threads``, ``dtype`` as a torch dtype name, ...);
    ``rollout``: the rollout side's (:class:`rollout.verl.P2PSyncRolloutEngine`), ignored here.

    Contract: when ``send_weights`` returns on rank 0, the trainer node holds the stream's weights
    as the version :meth:`prepare` announced, signed, and serves it (to the rollout side's vLLM
    engines, through whatever tree p2psync planned); a failure raises there and publishes nothing
    after it.
    """

    wire_format = "delta_flush"
    """What the rollout side hands verl's server adapter (see :mod:`rollout.verl`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if "is_master" in kwargs:  # an actor rank (verl's ActorRolloutRefWorker)
            return super().__new__(cls)
        module, _, name = ROLLOUT_SIDE.partition(":")
        side = getattr(importlib.import_module(module), name)  # a rollout process (CheckpointEngineWorker)
        return side(*args, **kwargs)

    def __init__(self, bucket_size: int = 0, is_master: bool = False, node: str | Mapping[str, Any] | None = None,
                 publisher: Mapping[str, Any] | None = None, rollout: Mapping[str, Any] | None = None) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.node_spec = node
        self.options = dict(publisher or {})
        if "dtype" in self.options:
            self.options["dtype"] = _dtype(self.options["dtype"], "publisher.dtype")
        if "dtype_overrides" in self.options:
            self.options["dtype_overrides"] = {n: _dtype(d, f"publisher.dtype_overrides.{n}")
                                               for n, d in dict(self.options["dtype_overrides"]).items()}
        if is_master and node is None:
            raise ConfigError("engine_kwargs.p2psync.node", "the trainer node's config is required on actor rank 0")
        self.background: Any = None
        self.weights: NamedWeights | None = None
        self.publisher: Any = None
        self.fingerprints: dict[int, str] = {}
        """Version -> signed target fingerprint of every version this engine published (kept after close)."""

    # --- verl's contract ------------------------------------------------------------------------
    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return topology(actor_wg_world_size, rollout_world_size, metadata)

    def prepare(self) -> dict[str, Any]:
        """Rank 0: starts the trainer node (first call) and answers where it is and which version
        the coming ``send_weights`` publishes. Other ranks: ``{}``."""
        if not self.is_master:
            return {}
        node = self._node()
        nxt = 0 if self.publisher is None else self.publisher.version + 1
        if self.publisher is None and node.version is not None:
            nxt = node.version + 1  # a restarted trainer continues the node's chain (or adopts its head)
        cfg = self.background.config
        return {"role": "trainer", "url": node.address, "version": nxt,
                "public_key": Path(cfg.trainer_public_key).read_text() if cfg.trainer_public_key else ""}

    def init_process_group(self, **kwargs: Any) -> None:
        """Nothing to join: p2psync's nodes find each other by gossip."""

    def finalize(self) -> None:
        """Nothing per sync: the node keeps serving between syncs (it stops with :meth:`close`)."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the stream as the next version (see the class doc); returns verl metrics.

        The stream is read on the caller's thread (verl assembles each tensor with collectives on
        the rank's own device); encoding, signing and handing to the node run on a worker thread."""
        import asyncio

        if hasattr(weights, "__aiter__"):  # verl's rollout utilities accept both kinds of stream
            weights = [x async for x in weights]
        if not self.is_master:
            for _ in weights:
                pass
            return {}
        self.take(weights)
        return await asyncio.to_thread(self.publish_sync, global_steps)

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError("the trainer side only sends; verl builds the rollout side without is_master")

    # --- the work -------------------------------------------------------------------------------
    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: copy one sync's stream into the host copy (:class:`NamedWeights`)."""
        if self.weights is None:
            opts = self.options
            self.weights = NamedWeights(weights, opts.get("dtype", torch.bfloat16), opts.get("dtype_overrides"))
        else:
            self.weights.load(weights)

    def publish_sync(self, global_steps: int | None = None) -> dict[str, float]:
        """Rank 0: publish the host copy as the next version (version 0, a snapshot, the first time)
        and wait until the node holds it."""
        assert self.weights is not None, "take() a stream first"
        if self.publisher is None:
            from trainer.publisher import Publisher

            self._node()
            pub = Publisher(self.weights, self.background.node, loop=self.background.loop, **self.options)
            try:
                pub.start_sync()
            except BaseException:
                pub._shutdown()
                raise
            self.publisher = pub
        else:
            self.publisher.publish_sync()
            self.publisher.flush_sync()  # published (signed, held, served) when send_weights returns
        self.fingerprints.update(self.publisher.fingerprints)
        rec = self.publisher.records[-1] if self.publisher.records else None
        logger.info("p2psync: global step %s published as version %s", global_steps, self.publisher.version)
        out = {"checkpoint_engine/version": float(self.publisher.version)}
        if rec is not None and rec.version == self.publisher.version:
            out.update({"checkpoint_engine/changed_ratio": rec.changed_fraction,
                        "checkpoint_engine/payload_mbytes": rec.payload_bytes / (1 << 20)})
        return out

    def _node(self) -> Any:
        if self.background is None:
            from trainer.background import BackgroundNode

            spec = self.node_spec
            cfg = node_config.load(spec) if isinstance(spec, str | Path) else node_config.load(overrides=dict(spec or {}))
            if cfg.role != "trainer":
                raise ConfigError("engine_kwargs.p2psync.node.role", f"must be 'trainer', got {cfg.role!r}")
            self.background = BackgroundNode(cfg).start()
        return self.background.node

    def close(self) -> None:
        """Wait for the last version, stop the publisher's threads and the node (idempotent)."""
        try:
            if self.publisher is not None:
                self.publisher.close_sync()
        finally:
            self.publisher = None
            if self.background is not None:
                self.background.stop()
                self.background = None


def _dtype(name: Any, field: str) -> torch.dtype:
    d = getattr(torch, str(name).removeprefix("torch."), None) if not isinstance(name, torch.dtype) else name
    if not isinstance(d, torch.dtype):
        raise ConfigError(field, f"not a torch dtype: {name!r}")
    return d


CheckpointEngineRegistry.register(BACKEND)(P2PSyncCheckpointEngine)
