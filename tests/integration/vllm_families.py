"""Tiny random-init decoder families for the vLLM tests, and their versions as checkpoints on disk.

Every config keeps head_dim 64 (vLLM's CPU attention takes only some sizes) and
MoE expert sizes a multiple of 32 (the CPU MoE kernel pads others). A
:class:`CheckpointLineage` trains a model with AdamW and saves each version
with ``save_pretrained`` (bf16, or another ``dtype``): the tensor table is the checkpoint's own
(per-expert tensors for MoE models, fused ``qkv_proj`` where the file has it),
so the trainer's table and what vLLM loads are the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from p2psync.codec.encode import CodecOptions
from p2psync.state import ModelState
from vllm_helpers import CHUNK, Lineage

BASE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=512)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

FAMILIES: dict[str, dict[str, Any]] = {
    # dense
    "llama": dict(BASE, intermediate_size=256, num_key_value_heads=1),
    "qwen2": dict(BASE, intermediate_size=256, num_key_value_heads=1),  # q/k/v biases
    "qwen3": dict(BASE, intermediate_size=256, num_key_value_heads=1, head_dim=64),
    "gemma": dict(BASE, intermediate_size=256, num_key_value_heads=1, head_dim=64),  # tied, gelu
    "phi3": dict(BASE, intermediate_size=256, num_key_value_heads=1, pad_token_id=0),  # qkv_proj fused on disk
    "starcoder2": dict(BASE, intermediate_size=256, num_key_value_heads=1),  # biases everywhere
    "gpt2": dict(vocab_size=512, n_embd=128, n_layer=2, n_head=2, n_positions=512),  # Conv1D: transposed load
    "falcon": dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                   new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False,
                   bias=False, max_position_embeddings=512),  # fused qkv split per kv head by the loader
    # mixture of experts
    "qwen3_moe": dict(BASE, intermediate_size=256, num_key_value_heads=1, head_dim=64, **MOE),
    "qwen2_moe": dict(BASE, intermediate_size=256, num_key_value_heads=1, shared_expert_intermediate_size=64,
                      **MOE),  # shared expert
    "mixtral": dict(BASE, intermediate_size=64, num_key_value_heads=1, num_local_experts=4,
                    num_experts_per_tok=2),
    "olmoe": dict(BASE, intermediate_size=64, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2),
    # router (gate and e_score_correction_bias) kept in float32 by vLLM for the bf16 checkpoint:
    # placed with a cast; layer 0 dense, layer 1 MoE with a shared expert
    "glm4_moe": dict(BASE, intermediate_size=256, num_key_value_heads=1, head_dim=64, n_routed_experts=4,
                     n_shared_experts=1, moe_intermediate_size=64, num_experts_per_tok=2, first_k_dense_replace=1,
                     n_group=1, topk_group=1, num_mtp_layers=0),
    # multi-head latent attention + MoE with a shared expert (placement only: vLLM's CPU build cannot
    # run MLA at these sizes); layer 0 dense, layers 1 and 2 alike
    "deepseek_v2": dict(BASE, num_hidden_layers=3, intermediate_size=256, num_key_value_heads=2,
                        q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                        v_head_dim=32, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64,
                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                        topk_method="greedy"),
}


def hf_config(family: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **dict(FAMILIES[family], **overrides))


def read_checkpoint(directory: Path) -> ModelState:
    """The tensors of a ``save_pretrained`` folder, named and laid out as on disk."""
    from safetensors import safe_open

    items = []
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            items.extend((k, st.get_tensor(k)) for k in st.keys())
    return ModelState(items)


class CheckpointLineage(Lineage):
    """Versions ``0..steps`` of a tiny ``family`` model trained with AdamW (fp32 master weights), each
    saved as a ``dtype`` checkpoint under ``root/v<k>``; ``states[k]`` is that checkpoint's tensor table.
    ``config``: settings over the family's."""

    def __init__(self, family: str, root: Path, steps: int, seed: int = 0, lr: float = 1e-3,
                 config: dict[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        from transformers import AutoModelForCausalLM

        from trainer.workload import Workload

        torch.manual_seed(seed)
        self.config = hf_config(family, **(config or {}))
        model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(3.0)  # peaked next-token distributions
        self.work = Workload(model, lr=lr, seed=seed)
        self.opts = CodecOptions(chunk_size=CHUNK)
        self.dtype = dtype
        self.dirs: list[Path] = []
        self.states: list[ModelState] = []
        for v in range(steps + 1):
            if v:
                self.work.step()
            self.dirs.append(self._save(model, root / f"v{v}"))
            self.states.append(read_checkpoint(self.dirs[-1]))

    def _save(self, model: Any, directory: Path) -> Path:
        import copy

        copy.deepcopy(model).to(self.dtype).save_pretrained(directory)
        return directory

    def checkpoint(self, directory: Path, version: int) -> str:
        return str(self.dirs[version])
