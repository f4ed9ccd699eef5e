"""A real training workload for codec demos and benchmarks.

A Qwen3-shaped causal LM built from a transformers config (random init, no
download) or loaded from a local folder, trained with fp32 master weights and
AdamW on a learnable synthetic language, published as bf16 casts: the same
shape of change an RL trainer produces after each optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def build_model(preset: str = "small", model_path: str | None = None, seed: int = 0) -> torch.nn.Module:
    """fp32 model: from ``model_path`` (a local HF folder) or a random-init Qwen3 of ``preset``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if model_path:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r} (choose from {', '.join(PRESETS)})")
    torch.manual_seed(seed)
    cfg = Qwen3Config(**PRESETS[preset], max_position_embeddings=512, tie_word_embeddings=True)
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


@dataclass
class StepInfo:
    step: int
    loss: float


class Workload:
    """fp32 master weights + AdamW on next-token prediction of a learnable synthetic sequence."""

    def __init__(self, model: torch.nn.Module, lr: float, batch: int = 4, seq: int = 64, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = model
        self.dtype = dtype
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab: int = model.config.vocab_size  # type: ignore[union-attr,assignment]  # a transformers model
        self.batch, self.seq = batch, seq
        self.steps = 0

    def _batch(self) -> torch.Tensor:
        # x[t+1] = (a * x[t] + b) mod V with a per-row (a, b): learnable structure, not noise.
        v = self.vocab
        a = torch.randint(1, 8, (self.batch, 1), generator=self.gen)
        b = torch.randint(0, v, (self.batch, 1), generator=self.gen)
        x = torch.empty(self.batch, self.seq, dtype=torch.long)
        x[:, :1] = torch.randint(0, v, (self.batch, 1), generator=self.gen)
        for t in range(1, self.seq):
            x[:, t : t + 1] = (a * x[:, t - 1 : t] + b) % v
        return x

    def step(self) -> StepInfo:
        self.model.train()
        ids = self._batch()
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return StepInfo(self.steps, float(out.loss.detach()))

    def published(self) -> dict[str, torch.Tensor]:
        """The rollout-dtype cast of every weight under its checkpoint name (tied weights appear once),
        as the engine holds it: the publisher's table (:func:`trainer.pieces.published_table`)."""
        from p2psync.checkpoint_names import checkpoint_views, unique_tensors

        tensors = unique_tensors(self.model)
        with torch.no_grad():
            return {v.name: v.of(tensors[v.source]).to(self.dtype).contiguous()
                    for v in checkpoint_views(self.model, tensors)}
