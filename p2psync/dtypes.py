"""The dtypes a checkpoint can hold, as raw words.

The codec never does float arithmetic: every tensor is viewed as unsigned
integer words of its width. Names are the safetensors dtype codes, so a
manifest and a ``.safetensors`` header speak the same language.

``exp_shift``/``exp_mask`` select the exponent field of a float word. The codec
uses it as context: the chance that an element changes under a small update
grows as its magnitude (and so its ULP) shrinks, and the receiver already holds
the base value, so it can predict that chance without any bytes on the wire.
Integer and boolean tensors get a single context (mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from p2psync.errors import CodecError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    code: str
    """safetensors code, e.g. ``BF16``."""
    torch_name: str
    """attribute of the ``torch`` module, e.g. ``bfloat16``."""
    width: int
    """bytes per element."""
    exp_shift: int
    exp_mask: int

    @property
    def word(self) -> np.dtype:
        return np.dtype(f"<u{self.width}")

    @property
    def signed_word(self) -> np.dtype:
        return np.dtype(f"<i{self.width}")

    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.torch_name)


_TABLE = [
    DType("BOOL", "bool", 1, 0, 0),
    DType("U8", "uint8", 1, 0, 0),
    DType("I8", "int8", 1, 0, 0),
    DType("I16", "int16", 2, 0, 0),
    DType("U16", "uint16", 2, 0, 0),
    DType("I32", "int32", 4, 0, 0),
    DType("U32", "uint32", 4, 0, 0),
    DType("I64", "int64", 8, 0, 0),
    DType("U64", "uint64", 8, 0, 0),
    DType("F16", "float16", 2, 10, 0x1F),
    DType("BF16", "bfloat16", 2, 7, 0xFF),
    DType("F32", "float32", 4, 23, 0xFF),
    DType("F64", "float64", 8, 52, 0x7FF),
    DType("F8_E4M3", "float8_e4m3fn", 1, 3, 0xF),
    DType("F8_E5M2", "float8_e5m2", 1, 2, 0x1F),
    DType("F8_E4M3FNUZ", "float8_e4m3fnuz", 1, 3, 0xF),
    DType("F8_E5M2FNUZ", "float8_e5m2fnuz", 1, 2, 0x1F),
    DType("F8_E8M0", "float8_e8m0fnu", 1, 0, 0xFF),
]

BY_CODE: dict[str, DType] = {d.code: d for d in _TABLE}
_BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _TABLE}


def from_code(code: str) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise CodecError(f"unknown dtype {code!r}") from None


def from_torch(dtype: "torch.dtype") -> DType:
    name = str(dtype).removeprefix("torch.")
    try:
        return _BY_TORCH_NAME[name]
    except KeyError:
        raise CodecError(f"dtype {dtype} is not supported (supported: {', '.join(BY_CODE)})") from None


def words_of(tensor: "torch.Tensor") -> np.ndarray:
    """The flat unsigned-word view of a contiguous CPU tensor, sharing its memory."""
    import torch

    d = from_torch(tensor.dtype)
    if tensor.device.type != "cpu":
        raise ValueError(f"words_of needs a CPU tensor, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("words_of needs a contiguous tensor")
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[d.width]
    flat = tensor.reshape(-1)
    if flat.dtype != signed:
        flat = flat.view(signed)
    return flat.numpy().view(d.word)


def torch_bits(tensor: "torch.Tensor") -> "torch.Tensor":
    """The same tensor viewed as signed integers of its width (any device)."""
    import torch

    d = from_torch(tensor.dtype)
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[d.width]
    flat = tensor.reshape(-1)
    return flat if flat.dtype == signed else flat.view(signed)
