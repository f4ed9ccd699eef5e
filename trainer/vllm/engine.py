"""p2psync as vLLM's trainer-side weight-transfer engine (``WeightTransferTrainerFactory``, backend ``p2psync``).

A trainer that already speaks vLLM's API switches to p2psync by changing the init info::

    engine = WeightTransferTrainerFactory.trainer_init(
        P2PSyncTrainerInitInfo(node_config="trainer.toml", rank=rank, worker_init_info={"tls_dir": "vllm-tls"}),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"), source=ModuleSource(model))
    ...; opt.step()
    engine.send_weights()                      # the next version, a signed sparse delta
    engine.shutdown()

``trainer_init`` on rank 0: check the init info and the source, load the node's config, start
the trainer node on a thread of its own (:class:`~trainer.background.BackgroundNode`; or attach
to a started one), publish the source's weights as a signed snapshot (version 0, or the version
the node already holds if it holds exactly these bits), then send vLLM's workers the init of the
``p2psync`` worker backend: the node's address, the cluster token, the trainer's public key (PEM
text), that version, and ``worker_init_info`` on top. ``send_weights`` on rank 0: publish the next
version as a signed sparse delta (the call returns once the node holds it), then
``start_weight_update``, ``update_weights({"version": v})`` (the workers pull the delta from their
parent and apply it in place, verified) and ``finish_weight_update(weight_version=str(v))``.
Relays and rollout nodes can follow the same trainer node as always; the engines vLLM serves pull
through any node of the tree (``worker_init_info={"url": ...}``).

Other ranks: no node, no client call; they iterate the source when rank 0 does (materialising is a
collective), see :mod:`trainer.vllm.source`.

Sharded trainers (a source with ``held_names()``: pipeline stages, expert splits; a ``ModuleSource``
of DTensors, FSDP2 or FSDP2 over TP, at several ranks): every rank publishes what it holds through
the Publisher's sharded path (:class:`~trainer.vllm.source.Sharded`; docs/TRAINER.md "Sharded
trainers"), with no gather: rank 0 with the node, signing one manifest for the whole model, the
others with ``node=None``, over a gloo group of the engine's. ``trainer_init`` and ``send_weights``
are collectives of every rank; ``init_info.rank`` must be the rank in the default group. Each step
of the init ends with an exchange, so that a refusal on any rank (rank 0's node config, a source's
names, a tensor held by no rank or by two, a refused placement) raises on every rank, naming the
field or the tensor, and nothing is left waiting. ``send_weights``: every rank publishes its share;
once the node holds the version, rank 0 drives the client. A rank that fails mid-send (its source,
its extraction) makes every rank raise :class:`~trainer.publish_record.PublishError`; the node
keeps the previous version, vLLM is told nothing, and the engine publishes no more (shut it down
and start again).

Failure: anything wrong in the init info, the node's config or the source raises
:class:`~trainer.vllm.info.InitInfoError` before a node starts; a failure after (the workers
refused the init) stops what was started and raises. A refused update raises
:class:`WorkersRefused` with the server's answer; the version stays published, vLLM keeps its
previous weights, and the next ``send_weights`` takes the workers from there to the newest version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

from p2psync import config as p2p_config
from p2psync import keys
from p2psync.config import NodeConfig
from p2psync.errors import ConfigError, P2PSyncError
from trainer.publish_record import PublishError
from trainer.vllm.info import InitInfoError, P2PSyncTrainerInitInfo
from trainer.vllm.prefix_cache import reset_prefix_cache, resetter
from trainer.vllm.source import (Extraction, Follower, Sharded, SourceMirror, WholeModel, check_source, held_of,
                                 is_sharded, module_of, published_names, sharded_module, table_of, world_size)

logger = logging.getLogger(__name__)


_CALLS = {"init": "init_weight_transfer_engine", "start": "start_weight_update", "update": "update_weights",
          "finish": "finish_weight_update", "reset": "reset_prefix_cache"}


class WorkersRefused(P2PSyncError):
    """vLLM answered a weight-transfer call with an error; ``step`` is the call (``init``, ``start``,
    ``update``, ``finish``, ``reset``: the prefix cache's reset after an update), ``version`` the
    p2psync version it was for, ``detail`` the server's answer."""

    def __init__(self, step: str, version: int | None, detail: str) -> None:
        call = _CALLS.get(step, step)
        super().__init__(f"vLLM refused {call}{'' if version is None else f' (version {version})'}: {detail}")
        self.step, self.version, self.detail = step, version, detail


def _detail(exc: BaseException) -> str:
    """The server's answer inside a client error (an HTTP body names the worker's error class), else the error."""
    response = getattr(exc, "response", None)
    text = getattr(response, "text", None)
    return f"{exc}: {text}" if isinstance(text, str) and text else f"{type(exc).__name__}: {exc}"


def node_config(value: Any) -> NodeConfig:
    """The trainer node's config from ``node_config`` (an object or a TOML path), checked for a trainer node."""
    from trainer.background import BackgroundNode

    if isinstance(value, BackgroundNode):
        if value.node is None:
            raise InitInfoError("node_config", "a BackgroundNode that is not started (use it inside its with "
                                "block, or call start() first)")
        cfg = value.config
    elif isinstance(value, NodeConfig):
        cfg = value
    else:
        path = Path(value)
        if not path.is_file():
            raise InitInfoError("node_config", f"no such file: {str(value)!r}")
        try:
            cfg = p2p_config.load(path)
        except ConfigError as exc:
            raise InitInfoError(f"node_config.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
    try:
        cfg.validate()
    except ConfigError as exc:
        raise InitInfoError(f"node_config.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
    if cfg.role != "trainer":
        raise InitInfoError("node_config.role", f"must be 'trainer' (the node that publishes), got {cfg.role!r}")
    if not cfg.trainer_private_key:
        raise InitInfoError("node_config.trainer_private_key", "missing: the trainer node signs every version")
    return cfg


def worker_init(cfg: NodeConfig, address: str, version: int | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """The ``init_info`` of the ``p2psync`` worker backend: from the trainer node, then ``extra`` on top."""
    from cryptography.hazmat.primitives import serialization

    pem = keys.load_public(cfg.trainer_public_key).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    out: dict[str, Any] = {"url": address, "token": cfg.token(), "public_key": pem, "version": version}
    out.update(extra or {})
    return out


def _prepared(info: P2PSyncTrainerInitInfo, client: Any) -> tuple[NodeConfig, dict[str, Any]]:
    """Rank 0's checks before anything starts: the node's config and the worker init it leads to, and a
    client that can reset the servers' prefix cache (unless told not to)."""
    if info.reset_prefix_cache and resetter(client) is None:
        raise InitInfoError("reset_prefix_cache", f"the client ({type(client).__name__}) offers no way to reset the "
                            "servers' prefix cache (no reset_prefix_cache(), base_url or Ray handles); give it a "
                            "reset_prefix_cache() method, or set reset_prefix_cache=False and reset it yourself "
                            "after each update")
    cfg = node_config(info.node_config)
    extra = dict(info.worker_init_info or {})
    if cfg.tls.enabled and "tls_dir" not in extra and not str(extra.get("url", "https://")).startswith("http://"):
        raise InitInfoError("worker_init_info.tls_dir", "missing: the trainer node takes mutual TLS only; give the "
                            "certificate folder vLLM presents (`p2psync cert issue --id vllm`), as vLLM's machine "
                            "sees it")
    try:
        keys.load_public(cfg.trainer_public_key)
        cfg.token()
    except ConfigError as exc:
        raise InitInfoError(f"node_config.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
    import inspect

    from trainer.publisher import Publisher

    accepted = set(inspect.signature(Publisher.__init__).parameters) - {"self", *_SET_BY_ENGINE}
    for name in info.publisher_options or {}:
        if name in _SET_BY_ENGINE:
            raise InitInfoError(f"publisher_options.{name}", "set by the engine (the rollout dtype and the model id "
                                "are fields of the init info)")
        if name not in accepted:
            raise InitInfoError(f"publisher_options.{name}", f"not an option of the Publisher (it takes: "
                                f"{', '.join(sorted(accepted))})")
    return cfg, extra


_SET_BY_ENGINE = ("model", "node", "loop", "dtype", "model_id", "solo", "optimizer", "group", "held", "table")


def _control_group(timeout_s: float) -> Any:
    """A gloo group over every rank of the default group, for the engine's exchanges and the sharded
    Publisher's, whose operations wait ``timeout_s`` for a rank at most (``None`` in a process of one rank)."""
    if world_size() == 1:
        return None
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _agree(group: Any, error: BaseException | None, what: str = "") -> None:
    """Every rank raises if any rank failed this step of the init: its own error, or one naming the rank
    that failed (an :class:`InitInfoError` with that rank's field, else a :class:`P2PSyncError`)."""
    mine = None if error is None else (getattr(error, "field", None), str(error), type(error).__name__)
    everyone: list[Any] = [mine]
    if group is not None:
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    for r, e in enumerate(everyone):
        if e is not None:
            field, text, kind = e
            if field is not None:
                raise InitInfoError(field, f"rank {r}: {text.removeprefix(f'{field}: ')}")
            raise P2PSyncError(f"rank {r} failed {what or 'trainer_init'}: {kind}: {text}")


def _check_split(group: Any, names: list[str], held: set[str]) -> None:
    """Every rank raises :class:`InitInfoError` naming the first tensor of the table that no rank's
    ``held_names()`` names, or that two ranks' do (before any node starts)."""
    everyone: list[Any] = [held]
    if group is not None:
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, held, group=group)
    for name in names:
        holders = [r for r, h in enumerate(everyone) if name in h]
        if len(holders) != 1:
            raise InitInfoError("source", f"{name}: " + (
                "held by no rank (no rank's held_names() names it)" if not holders else
                f"held by ranks {holders} (a tensor must be held by exactly one rank's held_names())"))


class P2PSyncTrainerEngine(TrainerWeightTransferEngine[P2PSyncTrainerInitInfo]):
    """Publishes a ``WeightSource`` through a p2psync trainer node and drives vLLM's workers to each version.

    Promises: every version the workers are told to reach is signed and held by the trainer node
    before the call; the workers apply it bit-exactly or keep their previous weights (the worker
    backend's contract); on rank 0 ``version`` is the newest version published.
    """

    init_info_cls = P2PSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.extraction: Extraction | None = None
        self.background: Any = None
        """The trainer node's :class:`~trainer.background.BackgroundNode` (rank 0)."""
        self.owns_node = False
        self.version: int | None = None
        self.worker_init: dict[str, Any] | None = None
        """The ``init_info`` sent to the workers (rank 0)."""
        self.failed: PublishError | None = None
        """The version ``send_weights`` raised for (nothing later is published)."""
        self.reset: Callable[[], bool] | None = None
        """How the servers' prefix cache is reset after each update (rank 0; ``None``: not by the engine)."""

    @classmethod
    def trainer_init(cls, init_info: P2PSyncTrainerInitInfo, *, client: Any, source: Any = None) -> Self:
        if not isinstance(init_info, P2PSyncTrainerInitInfo):
            raise InitInfoError("init_info", f"must be a P2PSyncTrainerInitInfo, got {type(init_info).__name__}")
        init_info.check()
        check_source(source)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if init_info.reset_prefix_cache and init_info.is_sender:
            engine.reset = resetter(client)  # None is refused by _prepared, before anything starts
        group = _control_group(init_info.timeout_s)
        error: BaseException | None = None
        try:
            sharded = is_sharded(source)
        except InitInfoError as exc:
            error, sharded = exc, False
        _agree(group, error)
        if group is not None:
            import torch.distributed as dist

            modes: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(modes, sharded, group=group)
            if len(set(modes)) > 1:
                raise InitInfoError("source", f"ranks {[r for r, m in enumerate(modes) if m]} hold a share of the "
                                    f"model (held_names(), DTensors), ranks {[r for r, m in enumerate(modes) if not m]}"
                                    " the whole model: every rank's source must be one or the other")
        if sharded:
            return engine._init_sharded(init_info, group)
        module = module_of(source)
        if not engine.is_sender:
            engine.extraction = Follower(source, iterate=module is None)
            engine.extraction.start()
            return engine
        cfg, extra = _prepared(init_info, client)
        dtype = getattr(torch, init_info.dtype)
        options = dict(init_info.publisher_options or {})
        refresh = None
        if module is None:
            mirror = SourceMirror(source.metadata(), dtype, options.get("dtype_overrides"))
            module, refresh = mirror, lambda: mirror.refresh(source)
        from trainer.background import BackgroundNode
        from trainer.publisher import Publisher

        if isinstance(init_info.node_config, BackgroundNode):
            engine.background = init_info.node_config
        else:
            engine.background = BackgroundNode(cfg).start()
            engine.owns_node = True
        try:
            bg = engine.background
            pub = Publisher(module, bg.node, loop=bg.loop, dtype=dtype, model_id=init_info.model_id, solo=True,
                            **options)
            engine.extraction = WholeModel(pub, refresh)
            engine.version = engine.extraction.start()
            engine.worker_init = worker_init(cfg, bg.node.address, engine.version, {**extra})
            try:
                client.init_weight_transfer_engine(engine.worker_init)
            except Exception as exc:
                raise WorkersRefused("init", engine.version, _detail(exc)) from exc
        except BaseException:
            engine._abandon()
            raise
        logger.info("p2psync: vLLM's workers initialised at version %s from %s", engine.version,
                    engine.worker_init["url"])
        return engine

    def _init_sharded(self, info: P2PSyncTrainerInitInfo, group: Any) -> Self:
        """``trainer_init`` of every rank of a sharded trainer (see module doc); steps end in exchanges."""
        import torch.distributed as dist

        source: Any = self.source
        rank = 0 if group is None else dist.get_rank(group)
        cfg: NodeConfig | None = None
        extra: dict[str, Any] = {}
        dtype = getattr(torch, info.dtype)
        options = dict(info.publisher_options or {})
        overrides = dict(options.pop("dtype_overrides", None) or {})
        module: torch.nn.Module | None = None
        held: frozenset[str] | None = None
        table = None
        mirror: SourceMirror | None = None
        error: BaseException | None = None
        try:  # 1. the checks of every rank (rank 0: the node's config), before anything starts
            if info.rank != rank:
                raise InitInfoError("rank", f"is {info.rank} but this process is rank {rank} of the default "
                                    "torch.distributed group; a sharded trainer's engine runs on every rank, rank 0 "
                                    "with the node")
            if self.is_sender:
                cfg, extra = _prepared(info, self.client)
            module = sharded_module(source)
            if module is not None:
                held = published_names(module, rank)
            else:
                metadata = list(source.metadata())
                table = table_of(metadata, dtype, overrides)
                mirror = SourceMirror(metadata, dtype, overrides, held=held_of(source))
                overrides = {n: d for n, d in overrides.items() if n in mirror.held}
        except Exception as exc:  # noqa: BLE001 - every rank raises (_agree)
            error = exc
        _agree(group, error)
        if mirror is not None:
            _check_split(group, [spec.name for spec in table or ()], set(mirror.held))
        error = None
        try:  # 2. the first pass of the source (a collective of its own), rank 0's node
            if mirror is not None:
                mirror.refresh(source)
            if self.is_sender:
                from trainer.background import BackgroundNode

                if isinstance(info.node_config, BackgroundNode):
                    self.background = info.node_config
                else:
                    assert cfg is not None
                    self.background = BackgroundNode(cfg).start()
                    self.owns_node = True
        except Exception as exc:  # noqa: BLE001 - every rank raises (_agree)
            error = exc
        try:
            _agree(group, error)
            from trainer.publisher import Publisher

            bg = self.background
            read = mirror if mirror is not None else module
            assert read is not None
            pub = Publisher(read, bg.node if bg else None,
                            loop=bg.loop if bg else None, dtype=dtype, model_id=info.model_id, group=group,
                            held=held, table=table, dtype_overrides=overrides, **options)
            self.extraction = Sharded(pub, None if mirror is None else (lambda: mirror.refresh(source)))
            self.version = self.extraction.start()  # 3. version 0: a bad share raises on every rank
            error = None
            if self.is_sender:  # 4. vLLM's workers (rank 0), and every rank learns how it went
                assert cfg is not None and bg is not None
                self.worker_init = worker_init(cfg, bg.node.address, self.version, {**extra})
                try:
                    self.client.init_weight_transfer_engine(self.worker_init)
                except Exception as exc:
                    error = WorkersRefused("init", self.version, _detail(exc))
                    error.__cause__ = exc
            _agree(group, error, "init_weight_transfer_engine")
        except BaseException:
            self._abandon()
            raise
        if self.is_sender:
            logger.info("p2psync: vLLM's workers initialised at version %s from %s (%d sharded ranks)",
                        self.version, self.worker_init["url"] if self.worker_init else None,
                        1 if group is None else dist.get_world_size(group))
        return self

    def send_weights(self) -> None:
        """Publish the source's current weights as the next version and bring vLLM's workers to it (see
        module doc). Called on every rank; only rank 0 calls the client (and, unless sharded, publishes)."""
        if self.extraction is None:
            raise P2PSyncError("send_weights after shutdown (or before trainer_init)")
        try:
            version = self.extraction.publish()
        except PublishError as exc:
            self.failed = exc
            raise
        if not self.is_sender or version is None:
            return
        self.version = version
        self._drive(version)

    def _drive(self, version: int) -> None:
        step = "start"
        try:
            self.client.start_weight_update()
            step = "update"
            self.client.update_weights({"version": version})
            step = "finish"
            self.client.finish_weight_update(weight_version=str(version))
            if self.reset is not None:
                step = "reset"
                reset_prefix_cache(self.reset)
        except Exception as exc:
            raise WorkersRefused(step, version, _detail(exc)) from exc

    def shutdown(self) -> None:
        """Finish publishing, then stop the trainer node if this engine started it (idempotent)."""
        extraction, self.extraction = self.extraction, None
        try:
            if extraction is not None:
                extraction.close()
        except PublishError as exc:
            if self.failed is None or exc.version != self.failed.version:
                raise
            logger.info("p2psync: shut down after version %d failed (raised by send_weights)", exc.version)
        finally:
            if self.owns_node and self.background is not None:
                self.background.stop()
            self.background, self.owns_node = None, False

    def _abandon(self) -> None:
        """:meth:`shutdown` after a failed init: the failure that led here is the one the caller sees."""
        try:
            self.shutdown()
        except Exception as exc:  # noqa: BLE001 - logged; the init's own error is re-raised by the caller
            logger.warning("p2psync: cleaning up after a failed trainer_init: %r", exc)
