"""The rollout worker's job config (``--job-config``): :class:`WorkerOptions`, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from p2psync.errors import ConfigError
from rollout.engines import check_name
from rollout.engines.base import EngineConfig


@dataclass(frozen=True)
class WorkerOptions:
    """The job config (``--job-config``), validated; unknown keys are an error."""

    engine: str = "hf"
    """An engine of :data:`rollout.engines.ENGINES`: ``"hf"`` (transformers), ``"vllm"``, or ``"vllm-lora"``
    (the node follows a LoRA adapter's stream; ``model_path`` is the frozen base)."""
    preset: str = "small"
    """Model preset (as the trainer's); ignored with ``model_path`` or ``model_config``."""
    model_path: str | None = None
    model_config: dict[str, Any] | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    threads: int = 0
    """torch threads for generation and codec threads for applying (0: torch default, 2 for the codec)."""
    max_batch: int = 16
    """Most sequences (responses) in one engine batch."""
    max_grants: int = 8
    """Most prompt groups requested at once."""
    progress_every: int = 8
    """Stream progress every this many new tokens of a response."""
    request_wait: float = 2.0
    """Seconds one ``request`` may wait for work."""
    switch: str = "step"
    """``"step"``: switch version between decode steps; ``"batch"``: only between batches."""
    audit: bool = True
    """Recompute the engine's fingerprint from every weight after each switch (else the incremental one)."""
    events_path: str | None = None
    seed: int = 0
    """Sampling seed of requests that carry none."""
    release_timeout: float = 5.0
    vllm: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name(self.engine)
        for name in ("max_batch", "max_grants", "progress_every"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.switch not in ("step", "batch"):
            raise ConfigError("switch", f"must be 'step' or 'batch', got {self.switch!r}")
        if self.request_wait <= 0 or self.release_timeout <= 0:
            raise ConfigError("request_wait" if self.request_wait <= 0 else "release_timeout", "must be > 0")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> WorkerOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown rollout worker option (known: {', '.join(sorted(known))})")
        return cls(**options)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(engine=self.engine, preset=self.preset, model_path=self.model_path,
                            model_config=self.model_config, dtype=self.dtype, device=self.device,
                            threads=self.threads, vllm=dict(self.vllm))
