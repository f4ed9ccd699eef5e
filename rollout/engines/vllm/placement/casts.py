"""Dtype conversions vLLM's loaders make between a checkpoint tensor and the parameter it loads into.

Some models keep a parameter in another dtype than the checkpoint's: MoE routers
in ``float32`` for a ``bfloat16`` checkpoint (GLM-4-MoE's and Ernie-4.5-MoE's
``GateLinear(params_dtype=torch.float32)`` and ``e_score_correction_bias``,
DeepSeek-V2/V3's and MiniMax-M2's correction bias). Their loaders copy the
checkpoint tensor into the parameter with ``Tensor.copy_``, which converts it.

A conversion is placed when the checkpoint's words can be read back from the
live ones exactly, so that the fingerprint and the audit stay defined on the
checkpoint's words: widening ``bfloat16`` to ``float32`` (``copy_`` shifts the
16 bits into the high half of the ``float32`` word, NaN payloads included; the
live word of a checkpoint word ``w`` is ``w << 16``, and a live word whose low
16 bits are not zero is not a checkpoint word). Narrowing (``float32`` to
``bfloat16``, rounded) loses the checkpoint's low bits and any other pair is
refused naming the tensor (:class:`~rollout.engines.vllm.placement.rules.LayoutError`).
A loader that computes values rather than copying them is refused by the probe
before (:mod:`rollout.engines.vllm.placement.readback`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.engines.vllm.placement.rules import LayoutError


@dataclass(frozen=True)
class Cast:
    """A widening from the checkpoint's words (``word``) to the live words (``live``) by a left shift."""

    checkpoint: str
    """The checkpoint tensor's dtype (torch's name, e.g. ``bfloat16``)."""
    target: str
    """The live parameter's dtype (``float32``)."""
    word: Any
    live: Any
    shift: int

    def to_live(self, words: np.ndarray) -> np.ndarray:
        """The live words of checkpoint words ``words`` (what vLLM's load writes for them)."""
        return np.ascontiguousarray(words).view(self.word).astype(self.live) << self.live(self.shift)

    def to_checkpoint(self, live: np.ndarray, name: str) -> np.ndarray:
        """The checkpoint words of live words ``live`` of tensor ``name``; raises :class:`LayoutError`
        for a live word that is not the widening of one (its low bits are not zero)."""
        live = np.ascontiguousarray(live).view(self.live)
        low = live & self.live((1 << self.shift) - 1)
        if low.any():
            at = int(np.flatnonzero(low)[0])
            raise LayoutError(f"{name}: a live {self.target} word ({int(live[at]):#x}) is not a {self.checkpoint} "
                              "word widened exactly: the parameter no longer holds a checkpoint's values")
        return (live >> self.live(self.shift)).astype(self.word)


_WIDENINGS = {("bfloat16", "float32"): Cast("bfloat16", "float32", np.uint16, np.uint32, 16)}


def dtype_name(dtype: Any) -> str:
    """torch's name of ``dtype`` without its module (``torch.float32`` -> ``float32``)."""
    return str(dtype).removeprefix("torch.")


def cast_for(name: str, checkpoint: Any, live: Any) -> Cast | None:
    """The conversion vLLM's load makes from a ``checkpoint`` tensor ``name`` into a ``live``
    parameter (dtypes, torch's or their names): None when they are the same; raises
    :class:`LayoutError` naming the tensor for one this module cannot read back (module doc)."""
    a, b = dtype_name(checkpoint), dtype_name(live)
    if a == b:
        return None
    cast = _WIDENINGS.get((a, b))
    if cast is None:
        how = "narrows" if _width(b) < _width(a) else "converts"
        raise LayoutError(f"{name}: vLLM's loader {how} it from {a} to {b}; only {sorted(_WIDENINGS)} "
                          "(exact widenings, the checkpoint's words read back from the live ones) are placed")
    return cast


def _width(name: str) -> int:
    import torch

    dt = getattr(torch, name, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else 0
