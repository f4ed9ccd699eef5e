"""Starting vLLM for a rollout engine: the ``vllm.LLM`` arguments p2psync needs, the refusals
before any process starts (quantized checkpoints, another weight-transfer backend, vLLM missing),
and an ``LLM`` whose processes end with this one."""

from __future__ import annotations

import json
import os
from typing import Any

from p2psync.errors import ConfigError, P2PSyncError
from rollout.engines.base import EngineConfig
from rollout.engines.vllm.placement.repack import QUANTIZED_WHY


CPU_KV_CACHE_BYTES = 1 << 30
"""The KV cache of a vLLM engine on CPU unless ``config.vllm`` sizes it (``kv_cache_memory_bytes`` or
``gpu_memory_utilization``)."""


def llm_kwargs(config: EngineConfig, model: str) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``config`` (``config.vllm`` overrides the defaults).

    Also allows vLLM's pickle fallback for ``collective_rpc`` callables in the processes the LLM
    starts (local processes; the engine's status, audit and read-back are module-level functions)."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    kw: dict[str, Any] = dict(model=model, dtype=config.dtype, skip_tokenizer_init=True, enforce_eager=True,
                              max_model_len=512, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                              weight_transfer_config={"backend": "p2psync"})
    if config.device == "cpu" and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(config.vllm):
        # On CPU vLLM's memory fraction is of the NUMA node's RAM and must also hold the weights: 0.1 of a
        # 16 GiB node leaves no KV cache for a 1 GB model. A KV cache of its own size holds on any machine.
        kw["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    kw.update(config.vllm)
    if kw.get("quantization"):
        raise ConfigError("vllm.quantization", f"engine 'vllm' refuses {kw['quantization']!r}: {QUANTIZED_WHY}")
    method = checkpoint_quantization(str(kw["model"]))
    if method is not None:
        raise ConfigError("model_path", f"engine 'vllm' refuses {kw['model']}: its config.json is quantized "
                          f"({method}): {QUANTIZED_WHY}")
    wt = kw.get("weight_transfer_config") or {}
    if (wt.get("backend") if isinstance(wt, dict) else getattr(wt, "backend", None)) != "p2psync":
        raise P2PSyncError("engine 'vllm': weight_transfer_config must name the 'p2psync' backend")
    return kw


def checkpoint_quantization(model: str) -> str | None:
    """The quantization method the checkpoint folder ``model`` declares in its ``config.json``
    (``quantization_config`` or ``compression_config``, as vLLM reads them; ``"unknown"`` when it
    names none), or None: not quantized, or not a local folder (a hub id is vLLM's to resolve)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError as exc:
        raise ConfigError("model_path", f"{path} is not JSON: {exc}") from exc
    q = cfg.get("quantization_config") or cfg.get("compression_config") if isinstance(cfg, dict) else None
    if not q:
        return None
    return str(q.get("quant_method") or q.get("format") or "unknown") if isinstance(q, dict) else "unknown"


def require_vllm(engine: str) -> None:
    """Raise :class:`P2PSyncError` naming ``engine`` and how to install vLLM when it is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise P2PSyncError(f"engine {engine!r} needs vLLM installed (pip install 'p2psync[vllm]'): {exc}") from exc


def start_llm(kw: dict[str, Any]) -> Any:
    """``vllm.LLM(**kw)`` whose engine-core and worker processes end when this process dies, even by
    SIGKILL (:func:`rollout.engines.vllm.plugin.owned_processes`)."""
    from vllm import LLM

    from rollout.engines.vllm.plugin import owned_processes

    with owned_processes():
        return LLM(**kw)
