"""Finding changed words with torch, on whatever device the weights live (CPU or CUDA).

Comparison is on raw bit patterns (``torch_bits``), never float subtraction. The
result feeds :func:`p2psync.codec.encode.encode_delta_sparse`, which produces
the same chunks as the CPU scan in :func:`p2psync.codec.encode.encode_delta`.
Only the changed positions and words cross to the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from p2psync import dtypes
from p2psync.errors import TensorTableMismatch

if TYPE_CHECKING:
    import torch


def extract_tensor(old: "torch.Tensor", new: "torch.Tensor") -> tuple[np.ndarray, np.ndarray]:
    """(sorted flat positions as int64, new words as unsigned) where the bits of ``new`` differ."""
    if old.shape != new.shape:
        raise TensorTableMismatch(reshaped=["<tensor>"])
    if old.dtype != new.dtype:
        raise TensorTableMismatch(retyped=["<tensor>"])
    a, b = dtypes.torch_bits(old.contiguous()), dtypes.torch_bits(new.contiguous())
    if a.device != b.device:
        a = a.to(b.device)
    pos = (a != b).nonzero().reshape(-1)
    vals = b[pos]
    word = dtypes.from_torch(new.dtype).word
    return pos.cpu().numpy().astype(np.int64, copy=False), vals.cpu().numpy().view(word)


def extract(old: Mapping[str, "torch.Tensor"], new: Mapping[str, "torch.Tensor"]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Changes of every tensor of ``new`` against ``old`` (same names, shapes and dtypes)."""
    unknown = [n for n in new if n not in old]
    missing = [n for n in old if n not in new]
    if unknown or missing:
        raise TensorTableMismatch(unknown=unknown, missing=missing)
    out = {}
    for name, t in new.items():
        try:
            out[name] = extract_tensor(old[name], t)
        except TensorTableMismatch as exc:
            raise TensorTableMismatch(reshaped=[name] if exc.reshaped else [], retyped=[name] if exc.retyped else []) \
                from None
    return out
