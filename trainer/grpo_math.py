"""GRPO's arithmetic, pure torch: group-relative advantages, the clipped off-policy surrogate, KL.

Notation per response token ``t`` of response ``i``: ``logp`` under the weights
being trained, ``old`` the behaviour log-probability the rollout engine reported
when it sampled the token (a version up to ``k`` steps older: that staleness is
what the importance ratio corrects), ``ref`` under a frozen reference model.

- advantage ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the group of the same
  prompt (``std`` unbiased, as TRL; ``scale=False`` gives Dr. GRPO's unscaled form);
- ratio ``rho = exp(logp - old)``; loss ``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``;
- KL (Schulman's k3, always >= 0): ``exp(ref - logp) - (ref - logp) - 1``, weighted ``beta``;
- aggregation ``"token"``: mean over every response token of the batch (DAPO);
  ``"sequence"``: mean over tokens of each response, then over responses (GRPO paper).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(rewards: Sequence[float] | torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one group's rewards (float32); all zero for a group of one or equal rewards."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    adv = r - r.mean()
    if scale and r.numel() > 1:
        adv = adv / (r.std(unbiased=True) + eps)
    return adv if r.numel() > 1 else torch.zeros_like(r)


@dataclass
class LossStats:
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    """Share of tokens whose ratio was clipped (the clipped branch was taken)."""
    ratio_mean: float
    tokens: int


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float = 0.2, clip_high: float = 0.2, ref_logp: torch.Tensor | None = None,
              beta: float = 0.0, aggregate: str = "token") -> tuple[torch.Tensor, LossStats]:
    """Loss to minimise for ``[B, T]`` token tensors; ``advantages`` is ``[B]``, ``mask`` marks response tokens."""
    if aggregate not in ("token", "sequence"):
        raise ValueError(f"aggregate: must be 'token' or 'sequence', got {aggregate!r}")
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    policy = per_token
    kl = torch.zeros_like(logp)
    if beta and ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + beta * kl

    def agg(x: torch.Tensor) -> torch.Tensor:
        if aggregate == "token":
            return (x * mask).sum() / mask.sum().clamp(min=1.0)
        per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.mean()

    loss = agg(per_token)
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        took_clip = (clipped < unclipped).to(mask.dtype) * mask
        stats = LossStats(float(loss), float(agg(policy)), float(agg(kl)), float(took_clip.sum() / n),
                          float((ratio * mask).sum() / n), int(mask.sum()))
    return loss, stats


def response_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      temperature: float = 1.0, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(``log_softmax(logits / T)`` of each response token ``[B, T]``, mask ``[B, T]``), teacher-forced.

    Same rule as the rollout engines report (see :mod:`rollout.engines.base`): tempered, float32.
    """
    B = len(prompts)
    T = max((len(r) for r in responses), default=0)
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    where = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        n = len(r)
        if n:
            targets[i, :n] = torch.tensor(list(r))
            where[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)  # logits at t predict token t + 1
            mask[i, :n] = 1.0
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    picked = logits.gather(1, where.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(picked / t, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp * mask, mask
