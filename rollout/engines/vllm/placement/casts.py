"""Dtype conversions vLLM's loaders make between a checkpoint tensor and the parameter it loads into.

Some models keep a parameter in another dtype than the checkpoint's: MoE routers
in ``float32`` for a ``bfloat16`` checkpoint (GLM-4-MoE's and Ernie-4.5-MoE's
``GateLinear(params_dtype=torch.float32)`` and ``e_score_correction_bias``,
DeepSeek-V2/V3's and MiniMax-M2's correction bias), and every tensor of a
``float32`` checkpoint served with ``dtype="bfloat16"`` (or ``float16``). Their
loaders copy the checkpoint tensor into the parameter with ``Tensor.copy_``,
which converts it. Two kinds are placed, so that the fingerprint and the audit
stay defined on the checkpoint's words:

- :class:`Widening` (``bfloat16`` to ``float32``): exact. ``copy_`` shifts the 16
  bits into the high half of the ``float32`` word, NaN payloads included; the
  live word of a checkpoint word ``w`` is ``w << 16``, the checkpoint's words
  are read back from the live ones, and a live word whose low 16 bits are not
  zero is not a checkpoint word.
- :class:`Rounding` (``float32`` to ``bfloat16`` or ``float16``, and between
  ``bfloat16`` and ``float16``): the live word is torch's conversion of the
  checkpoint word, computed by torch itself (round to nearest, ties to even;
  overflow to inf; on torch 2.13's CPU every ``float32`` NaN becomes the
  ``bfloat16`` word ``0xFFFF``, while ``float16`` keeps the payload's high bits).
  The checkpoint's low bits are gone from the live word, so the engine keeps
  them: :class:`~rollout.engines.vllm.apply.weights.LiveWeights` holds a host
  copy of the checkpoint words of each rounded tensor
  (:mod:`rollout.engines.vllm.apply.kept`) and checks the live words against it.

Any other pair is refused naming the tensor
(:class:`~rollout.engines.vllm.placement.rules.LayoutError`). A loader that
computes values rather than copying them is refused by the probe before
(:mod:`rollout.engines.vllm.placement.readback`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from rollout.engines.vllm.placement.rules import LayoutError


@dataclass(frozen=True)
class Cast:
    """A conversion from a checkpoint tensor's words (``word``) to its parameter's (``live``)."""

    checkpoint: str
    """The checkpoint tensor's dtype (torch's name, e.g. ``bfloat16``)."""
    target: str
    """The live parameter's dtype (e.g. ``float32``)."""
    word: Any
    """The checkpoint's unsigned word type."""
    live: Any
    """The parameter's unsigned word type."""

    readable: ClassVar[bool] = True
    """Whether the checkpoint's words can be read back from the live ones (else the engine keeps them)."""

    def to_live(self, words: np.ndarray) -> np.ndarray:
        """The live words of checkpoint words ``words`` (what vLLM's load writes for them)."""
        raise NotImplementedError

    def to_checkpoint(self, live: np.ndarray, name: str) -> np.ndarray:
        """The checkpoint words of live words ``live`` of tensor ``name``; raises :class:`LayoutError`
        where they cannot be read back."""
        raise NotImplementedError

    def check(self, words: np.ndarray, live: np.ndarray, name: str) -> None:
        """Raise :class:`LayoutError` naming tensor ``name`` unless ``live`` are the live words of
        checkpoint words ``words`` (the same positions)."""
        want = self.to_live(words)
        got = np.ascontiguousarray(live).view(self.live)
        bad = want != got
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise LayoutError(f"{name}: a live {self.target} word ({int(got[at]):#x}) is not the conversion of "
                              f"the {self.checkpoint} word the engine keeps for it ({int(words[at]):#x} -> "
                              f"{int(want[at]):#x}): the parameter was written outside p2psync")


@dataclass(frozen=True)
class Widening(Cast):
    """A widening by a left shift of the checkpoint's words; read back exactly (module doc)."""

    shift: int = 16

    def to_live(self, words: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(words).view(self.word).astype(self.live) << self.live(self.shift)

    def to_checkpoint(self, live: np.ndarray, name: str) -> np.ndarray:
        """(base doc) A live word whose low bits are not zero is not the widening of one."""
        live = np.ascontiguousarray(live).view(self.live)
        low = live & self.live((1 << self.shift) - 1)
        if low.any():
            at = int(np.flatnonzero(low)[0])
            raise LayoutError(f"{name}: a live {self.target} word ({int(live[at]):#x}) is not a {self.checkpoint} "
                              "word widened exactly: the parameter no longer holds a checkpoint's values")
        return (live >> self.live(self.shift)).astype(self.word)


@dataclass(frozen=True)
class Rounding(Cast):
    """A conversion that loses bits (module doc): torch's own, as ``Tensor.copy_`` makes it at load;
    the checkpoint's words cannot be read back, the engine keeps them."""

    readable: ClassVar[bool] = False

    def to_live(self, words: np.ndarray) -> np.ndarray:
        import torch

        src = torch.from_numpy(np.ascontiguousarray(words).view(self.word).view(_signed(self.word)))
        out = src.view(getattr(torch, self.checkpoint)).to(getattr(torch, self.target))
        return out.view(getattr(torch, _signed(self.live).__name__)).numpy().view(self.live)

    def to_checkpoint(self, live: np.ndarray, name: str) -> np.ndarray:
        raise LayoutError(f"{name}: vLLM rounds it from {self.checkpoint} to {self.target} at load; its "
                          f"{self.checkpoint} words cannot be read back from the live ones (the engine keeps them)")


def _signed(word: Any) -> Any:
    return {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[np.dtype(word).itemsize]


_CASTS: dict[tuple[str, str], Cast] = {
    ("bfloat16", "float32"): Widening("bfloat16", "float32", np.uint16, np.uint32, 16),
    ("float32", "bfloat16"): Rounding("float32", "bfloat16", np.uint32, np.uint16),
    ("float32", "float16"): Rounding("float32", "float16", np.uint32, np.uint16),
    ("bfloat16", "float16"): Rounding("bfloat16", "float16", np.uint16, np.uint16),
    ("float16", "bfloat16"): Rounding("float16", "bfloat16", np.uint16, np.uint16),
}


def dtype_name(dtype: Any) -> str:
    """torch's name of ``dtype`` without its module (``torch.float32`` -> ``float32``)."""
    return str(dtype).removeprefix("torch.")


def cast_for(name: str, checkpoint: Any, live: Any) -> Cast | None:
    """The conversion vLLM's load makes from a ``checkpoint`` tensor ``name`` into a ``live``
    parameter (dtypes, torch's or their names): None when they are the same; raises
    :class:`LayoutError` naming the tensor for a pair this module does not place (module doc)."""
    a, b = dtype_name(checkpoint), dtype_name(live)
    if a == b:
        return None
    cast = _CASTS.get((a, b))
    if cast is None:
        how = "narrows" if _width(b) < _width(a) else "converts"
        raise LayoutError(f"{name}: vLLM's loader {how} it from {a} to {b}; only {sorted(_CASTS)} "
                          "(float conversions torch's copy_ makes) are placed")
    return cast


def _width(name: str) -> int:
    import torch

    dt = getattr(torch, name, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else 0
