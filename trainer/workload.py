"""A real training workload for codec demos and benchmarks.

A model of :mod:`p2psync.presets` (a Qwen3-shaped causal LM built from a transformers
config with random init, no download, or loaded from a local folder) trained with fp32 master weights and
AdamW on a learnable synthetic language, published as bf16 casts: the same
shape of change an RL trainer produces after each optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
