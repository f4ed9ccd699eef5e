"""What a trainer hands vLLM's trainer-side factory to choose p2psync: :class:`P2PSyncTrainerInitInfo`.

Checked field by field when it is built (and again by the engine before anything starts): a
missing or mistyped field raises :class:`InitInfoError` naming it (``node_config``,
``worker_init_info.tls_dir``, ...). What the trainer node's config itself says is checked when
the engine loads it (:func:`trainer.vllm.engine.node_config`), still before any node starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from p2psync.config import NodeConfig
from p2psync.errors import ConfigError

BACKEND = "p2psync"
"""The name the engine is registered under in vLLM's ``WeightTransferTrainerFactory`` (the worker side's too)."""

WORKER_INIT_KEYS = ("url", "token", "public_key", "version", "node_id", "threads", "timeout", "tls_dir", "adapters")
"""The keys of the ``init_info`` the ``p2psync`` worker backend accepts (its ``worker/infos.py``; a test
checks that the two lists agree, since neither package imports the other)."""

_WORKER_TEXT = ("url", "token", "public_key", "node_id", "tls_dir")


class InitInfoError(ConfigError):
    """A field of the trainer's init info is missing, mistyped or unusable; ``field`` names it
    (``node_config``, ``worker_init_info.tls_dir``). Raised before any node starts or any request is sent."""


@dataclass
class P2PSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``p2psync`` backend (vLLM's ``TrainerInitInfo``; ``rank`` keyword-only).

    Rank 0 runs (or attaches to) the trainer node of ``node_config``, publishes the source's weights
    on it and tells vLLM's workers where to pull from; every other rank keeps the source's
    collectives in step, or, in a sharded trainer, publishes what it holds through rank 0
    (:class:`trainer.vllm.engine.P2PSyncTrainerEngine`). ``rank``: the rank in the default
    ``torch.distributed`` group (checked when sharded).
    """

    backend: ClassVar[str] = BACKEND

    node_config: Any = None
    """The trainer node: a :class:`p2psync.config.NodeConfig`, the path of its TOML file, or a started
    :class:`trainer.background.BackgroundNode` to attach to (left running at shutdown). Required on rank 0."""
    worker_init_info: dict[str, Any] | None = None
    """Added to (and overriding) the ``init_info`` sent to vLLM's workers, whose other keys come from the
    trainer node (``url``: its address, ``token``, ``public_key``: the trainer's key as PEM text,
    ``version``: the version published at init). With TLS on, ``tls_dir`` is required: the certificate
    folder vLLM presents (as seen from vLLM's machine). ``url`` points vLLM at a relay or rollout node
    instead; ``{"version": None}`` makes the first update load a snapshot (vLLM's loaded weights then
    need not be the trainer's version 0)."""
    model_id: str = "model"
    """The manifest's model id."""
    dtype: str = "bfloat16"
    """The rollout dtype floating weights are published in (a ``torch`` dtype name)."""
    publisher_options: dict[str, Any] | None = None
    """Further keyword arguments of :class:`trainer.publisher.Publisher` (``bucket_bytes``, ``threads``,
    ``position_coding``, ``dtype_overrides``, ...)."""
    timeout_s: float = 600.0
    """Several trainer ranks: how long any exchange between them (the timeout of the engine's own gloo
    group) waits for a rank before every rank still there raises. A rank whose process dies is noticed
    at once (its connections close); this bounds a rank that hangs. Longer than the largest gap between
    the ranks' calls of ``send_weights`` (the slowest rank's share of an extraction)."""
    reset_prefix_cache: bool = True
    """After each update, reset the servers' prefix cache (KV computed with the previous weights must
    not serve a prompt again): ``POST /reset_prefix_cache`` to an ``HTTPVLLMWeightSyncClient``'s server,
    ``reset_prefix_cache()`` on each actor of a ``RayVLLMWeightSyncClient``, or the client's own
    ``reset_prefix_cache()`` method. ``False``: the framework resets it itself (or serves no prefix
    cache); a client with none of these is refused at init unless this is ``False``."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`InitInfoError` for the first field that is missing or of the wrong type."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise InitInfoError("rank", f"must be an integer >= 0, got {self.rank!r}")
        if self.rank == 0:
            if self.node_config is None:
                raise InitInfoError("node_config", "missing: rank 0 runs the trainer node (a NodeConfig, the path "
                                    "of its TOML file, or a started BackgroundNode)")
            if not _node_like(self.node_config):
                raise InitInfoError("node_config", "must be a NodeConfig, the path of a TOML file or a "
                                    f"BackgroundNode, got {type(self.node_config).__name__}")
        w = self.worker_init_info
        if w is not None:
            if not isinstance(w, dict):
                raise InitInfoError("worker_init_info", f"must be a dict, got {type(w).__name__}")
            for k, v in w.items():
                if k not in WORKER_INIT_KEYS:
                    raise InitInfoError(f"worker_init_info.{k}", f"unknown key (the worker takes: "
                                        f"{', '.join(WORKER_INIT_KEYS)})")
                if k in _WORKER_TEXT and not (isinstance(v, str) and v.strip()):
                    raise InitInfoError(f"worker_init_info.{k}", f"must be a non-empty string, got {v!r}")
                if k == "version" and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise InitInfoError("worker_init_info.version", f"must be an integer >= 0 or None, got {v!r}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InitInfoError("model_id", f"must be a non-empty string, got {self.model_id!r}")
        if not isinstance(self.dtype, str) or not isinstance(getattr(torch, self.dtype, None), torch.dtype) \
                or not getattr(torch, self.dtype).is_floating_point:
            raise InitInfoError("dtype", f"must be the name of a floating torch dtype such as 'bfloat16', "
                                f"got {self.dtype!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise InitInfoError("timeout_s", f"must be a number of seconds > 0, got {self.timeout_s!r}")
        if not isinstance(self.reset_prefix_cache, bool):
            raise InitInfoError("reset_prefix_cache", f"must be true or false, got {self.reset_prefix_cache!r}")
        if self.publisher_options is not None and not isinstance(self.publisher_options, dict):
            raise InitInfoError("publisher_options", f"must be a dict, got {type(self.publisher_options).__name__}")


def _node_like(value: Any) -> bool:
    if isinstance(value, NodeConfig | str | os.PathLike):
        return True
    from trainer.background import BackgroundNode

    return isinstance(value, BackgroundNode)

