"""Building states from raw words for codec tests."""

from __future__ import annotations

import numpy as np
import torch

from p2psync import dtypes
from p2psync.state import ModelState

ALL_CODES = list(dtypes.BY_CODE)


def tensor_from_words(code: str, words: np.ndarray, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    d = dtypes.from_code(code)
    t = torch.empty(words.shape[0] if shape is None else shape, dtype=d.torch_dtype())
    dtypes.words_of(t)[:] = words.astype(d.word, copy=False)
    return t


def state_from_words(items: dict[str, tuple[str, np.ndarray]]) -> ModelState:
    return ModelState({name: tensor_from_words(code, w) for name, (code, w) in items.items()})


def special_words(code: str) -> np.ndarray:
    """NaN payloads, +-0, +-inf, subnormals, extremes for a dtype (as raw words)."""
    d = dtypes.from_code(code)
    bits = d.width * 8
    top = (1 << bits) - 1
    sign = 1 << (bits - 1)
    vals = {0, 1, 2, top, top - 1, sign, sign + 1, sign - 1, 0x55 & top, 0xAA & top}
    if d.exp_mask:
        exp_all = d.exp_mask << d.exp_shift
        vals |= {exp_all, exp_all | 1, exp_all | sign, exp_all | sign | 1, exp_all | (1 << max(0, d.exp_shift - 1)),
                 1 << d.exp_shift, (1 << d.exp_shift) - 1, sign | ((1 << d.exp_shift) - 1)}
    return np.array(sorted(v & top for v in vals), dtype=np.uint64).astype(d.word)
