"""Rollout engines by name: the contract in :mod:`rollout.engines.base`, one module per backend.

A backend is imported only when it is chosen (``import rollout.engines`` pulls in
neither transformers nor vLLM).
"""

from __future__ import annotations

import importlib

from p2psync.errors import ConfigError
from rollout.engines.base import EngineConfig, RolloutEngine

ENGINES: dict[str, tuple[str, str]] = {
    "hf": ("rollout.engines.hf", "HFEngine"),
    "vllm": ("rollout.engines.vllm.engine", "VLLMEngine"),
    "vllm-lora": ("rollout.engines.vllm.adapter_engine", "VLLMAdapterEngine"),
}
"""Engine name -> (module, class). The class has ``build(config: EngineConfig)``."""


def check_name(name: str) -> None:
    """Raise :class:`ConfigError` (field ``engine``) unless ``name`` is a registered engine."""
    if name not in ENGINES:
        raise ConfigError("engine", f"unknown engine {name!r} (choose from {', '.join(sorted(ENGINES))})")


def engine_class(name: str) -> type[RolloutEngine]:
    """The class of engine ``name`` (imports its module now)."""
    check_name(name)
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)


def build_engine(config: EngineConfig) -> RolloutEngine:
    """The engine ``config.engine`` names, built from ``config``."""
    return engine_class(config.engine).build(config)  # type: ignore[attr-defined]


__all__ = ["ENGINES", "EngineConfig", "RolloutEngine", "build_engine", "check_name", "engine_class"]
