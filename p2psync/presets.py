"""Model shapes the trainer, the rollout engines, the demo and the benchmarks build by name.

Qwen3-shaped presets (:data:`PRESETS`) and tiny mixture-of-experts families
(:data:`MOE_FAMILIES`), built from a transformers config with a seeded random init (no
download) or loaded from a local folder. Both sides of a run build the same preset, so the
trainer's published tensor table is the engine's.
"""

from __future__ import annotations

from typing import Any

import torch

from p2psync.errors import ConfigError

PRESETS: dict[str, dict] = {
    # ~0.6M parameters: unit tests.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # ~0.5M parameters, head_dim 32 (a size vLLM's CPU attention takes): ``p2psync demo --quick``.
    "mini": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # ~19M parameters, 38 MB in bf16, head_dim 64: ``p2psync demo``, the sparse RL regime at lr 1e-6.
    "demo": dict(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # ~15M parameters: codec and rollout benchmarks.
    "small": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    # ~101M parameters: the codec benchmark.
    "bench": dict(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}


def preset_config(preset: str) -> Any:
    """The transformers config of ``preset`` (a Qwen3 with tied embeddings): what the trainer
    builds and what a rollout engine of the same preset builds, so their tensor tables agree.
    Raises :class:`~p2psync.errors.ConfigError` naming ``preset`` for an unknown name."""
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise ConfigError("preset", f"unknown {preset!r} (choose from {', '.join(PRESETS)})")
    return Qwen3Config(**PRESETS[preset], max_position_embeddings=512, tie_word_embeddings=True)


def build_model(preset: str = "small", model_path: str | None = None, seed: int = 0) -> torch.nn.Module:
    """fp32 model: from ``model_path`` (a local HF folder) or a random-init Qwen3 of ``preset``."""
    from transformers import AutoModelForCausalLM

    if model_path:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    cfg = preset_config(preset)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


MOE_FAMILIES: dict[str, dict] = {
    # Tiny random-init mixture-of-experts models whose experts transformers holds fused in memory
    # and saves one tensor per expert (tests of the checkpoint-named table).
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2),  # with a shared expert
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=2, pad_token_id=1),
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1),  # shared experts, MLA
}


def build_moe(model_type: str = "qwen3_moe", seed: int = 0, **overrides: object) -> torch.nn.Module:
    """fp32 tiny random-init MoE model of one of :data:`MOE_FAMILIES` (2 layers, 4 experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in MOE_FAMILIES:
        raise ValueError(f"model_type: unknown {model_type!r} (choose from {', '.join(MOE_FAMILIES)})")
    kw: dict[str, object] = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=256, tie_word_embeddings=False)
    if model_type == "deepseek_v3":
        kw.pop("head_dim")
    kw.update(MOE_FAMILIES[model_type])
    kw.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float32)
