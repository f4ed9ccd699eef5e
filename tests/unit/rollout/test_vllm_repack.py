"""Replaying an expert repacking on element ids (``rollout.engines.vllm.placement.repack``): the permutation it
makes is found exactly, also for ids wider than one 16-bit word, and a repacking that is not a
permutation (an element dropped for another's copy) is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.engines.vllm.placement.rules import LayoutError
from rollout.engines.vllm.placement.repack import _moe_perm, _per_expert

SHAPES = {"w13_weight": (2, 64, 1024), "w2_weight": (2, 1024, 32)}  # 131,072 ids: two 16-bit halves


class _Experts:
    """A stand-in for vLLM's CPU experts: its post-load step moves both parameters by ``move``."""

    def __init__(self, isa: str, move) -> None:
        self.isa, self.move = isa, move

    def process_weights_after_loading(self, layer) -> None:
        for name in SHAPES:
            p = getattr(layer, name)
            p.data = self.move(p.data).contiguous()


def test_a_per_expert_permutation_is_found_exactly():
    fe = _Experts("flip", lambda t: t.flip(-1))
    for name, shape in SHAPES.items():
        perm = _moe_perm(fe, torch.nn.Module(), name, SHAPES)
        e, r, c = np.unravel_index(np.arange(int(np.prod(shape))), shape)
        want = np.ravel_multi_index((e, r, shape[2] - 1 - c), shape)
        assert np.array_equal(perm, want), name
        one = _per_expert(fe, torch.nn.Module(), name, SHAPES)
        assert one is not None and np.array_equal(one, want[: one.shape[0]])


def test_a_repacking_that_is_not_a_permutation_is_refused():
    def dropped(t):
        t = t.clone()
        t.reshape(-1)[1] = t.reshape(-1)[60_000]  # one element's copy in another's place
        return t

    with pytest.raises(LayoutError, match="not a permutation"):
        _moe_perm(_Experts("dropped", dropped), torch.nn.Module(), "w13_weight", SHAPES)
