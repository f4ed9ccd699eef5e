"""Publishing a LoRA adapter's versions, not the frozen base (RL on adapters).

    node = await Node.create(NodeConfig(role="trainer", ...))       # the adapter's own stream
    pub = await AdapterPublisher.create(peft_model, node, name="policy", base_fingerprint=fp, r=8,
                                        lora_alpha=16, target_modules=["q_proj", "v_proj"])
    for batch in data:
        ...; opt.step()
        await pub.publish()                                          # the adapter's next version

Every version is the adapter's tensors under PEFT's names plus its signed config
(:mod:`p2psync.adapter`), published through the ordinary :class:`~trainer.publisher.Publisher`
(extract, encode, sign, ``node.publish``) from a module that mirrors the adapter's live
parameters (no copy: a buffer per parameter, sharing its storage). The stream's model id names
the adapter (:func:`p2psync.adapter.stream_id`). Adapter steps change nearly every element: the
codec codes such ranges densely (``p2psync/codec/dense.py``), so a version never costs more than
the adapter's raw bf16 words.

``model``: a PEFT model (its ``lora_A``/``lora_B`` parameters, whatever the adapter's name in
memory), or a mapping of PEFT-named tensors; the config comes from ``peft_config`` when the
model has one and the arguments do not say it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from p2psync.adapter import AdapterConfig, check_tensors, config_tensor, peft_names, stream_id
from trainer.pieces import hold_at
from trainer.publisher import Publisher


def adapter_config_of(model: Any, *, name: str, base_fingerprint: str, r: int | None = None,
                      lora_alpha: float | None = None, target_modules: Sequence[str] | None = None,
                      base_model: str = "") -> AdapterConfig:
    """The :class:`AdapterConfig` of ``model``: from the arguments, else from a PEFT model's
    ``peft_config`` (its first adapter)."""
    peft = getattr(model, "peft_config", None)
    first = next(iter(peft.values())) if isinstance(peft, Mapping) and peft else None
    if r is None:
        r = getattr(first, "r", None)
    if lora_alpha is None:
        lora_alpha = getattr(first, "lora_alpha", None)
    if target_modules is None:
        target_modules = getattr(first, "target_modules", None)
    if r is None or lora_alpha is None or target_modules is None:
        from p2psync.errors import ConfigError

        raise ConfigError("adapter", "r, lora_alpha and target_modules: give them, or a PEFT model with peft_config")
    return AdapterConfig(name=name, r=int(r), lora_alpha=float(lora_alpha), target_modules=tuple(target_modules),
                         base_fingerprint=base_fingerprint,
                         base_model=base_model or str(getattr(first, "base_model_name_or_path", "") or ""))


def adapter_module(model: Any, config: AdapterConfig) -> torch.nn.Module:
    """A module whose state dict is the adapter state of ``model`` (PEFT names, live storage) and
    the config tensor: what the publisher reads."""
    named = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else dict(model)
    tensors = peft_names(named)
    check_tensors(tensors, config)
    root = torch.nn.Module()
    for n in sorted(tensors):
        hold_at(root, n, tensors[n].detach())
    from p2psync.adapter import CONFIG_TENSOR

    hold_at(root, CONFIG_TENSOR, config_tensor(config))
    return root


class AdapterPublisher(Publisher):
    """A :class:`~trainer.publisher.Publisher` of one LoRA adapter's versions (module docstring).

    Contract: every version it publishes is the adapter's tensors (bf16, PEFT names) and its
    config, signed together; versions are published in order on the stream ``lora:<name>``."""

    def __init__(self, model: Any, node: Any = None, *, name: str, base_fingerprint: str,
                 r: int | None = None, lora_alpha: float | None = None,
                 target_modules: Sequence[str] | None = None, base_model: str = "", **kwargs: Any) -> None:
        self.adapter = adapter_config_of(model, name=name, base_fingerprint=base_fingerprint, r=r,
                                         lora_alpha=lora_alpha, target_modules=target_modules, base_model=base_model)
        kwargs.setdefault("model_id", stream_id(name))
        super().__init__(adapter_module(model, self.adapter), node, **kwargs)
