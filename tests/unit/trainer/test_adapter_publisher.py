"""AdapterPublisher: a LoRA adapter's versions reach a following node bit-exact, with their signed
config, on a stream named by the adapter, and no version costs more than the adapter's raw bf16 words."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync import adapter, dtypes
from p2psync.errors import CodecError, ConfigError
from tests.unit.trainer.test_publisher import _configs, _follower
from p2psync.node import Node
from trainer.adapter import AdapterPublisher

pytestmark = pytest.mark.timeout(120)
BASE_FP = "0123456789abcdef0123456789abcdef"


class _Lora(torch.nn.Module):
    """Parameters named as a PEFT model names them in memory (adapter "default")."""

    def __init__(self, r: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for layer in range(2):
            for mod, (i, o) in {"q_proj": (64, 64), "v_proj": (64, 32)}.items():
                a = torch.nn.Parameter(torch.randn(r, i, generator=g) * 0.05)
                b = torch.nn.Parameter(torch.zeros(o, r))  # PEFT's init: the adapter starts as a no-op
                path = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
                adapter_param(self, f"{path}.lora_A.default.weight", a)
                adapter_param(self, f"{path}.lora_B.default.weight", b)
        self.register_parameter("frozen_base", torch.nn.Parameter(torch.ones(3), requires_grad=False))


def adapter_param(root: torch.nn.Module, name: str, p: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, torch.nn.Module())
        owner = owner._modules[part]
    owner.register_parameter(leaf, p)


def _step(model: torch.nn.Module, seed: int) -> None:
    """An Adam-like step: every adapter element moves by about lr."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g).sign() * 1e-3)


def _expected(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: dtypes.words_of(t.detach().to(torch.bfloat16).contiguous()).copy()
            for n, t in adapter.peft_names(dict(model.named_parameters())).items()}


def test_adapter_versions_reach_a_follower_bit_exact_with_their_config(tmp_path):
    priv, tr_cfg, common = _configs(tmp_path)
    model = _Lora()

    async def go():
        tr = await Node.create(tr_cfg)
        fol = await _follower(tmp_path, common, tr.address)
        try:
            pub = await AdapterPublisher.create(model, tr, name="policy", base_fingerprint=BASE_FP, r=4,
                                                lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                chunk_size=64 << 10)
            assert pub.model_id == "lora:policy"
            for v in range(0, 3):
                if v:
                    _step(model, v)
                    assert await pub.publish() == v
                    await pub.flush()
                await fol.wait_version(v)
                config, words = adapter.split_state(fol.state)
                assert config == pub.adapter and config.base_fingerprint == BASE_FP and config.r == 4
                exp = _expected(model)
                assert sorted(words) == sorted(exp) and "frozen_base" not in str(sorted(words))
                for n in exp:
                    assert np.array_equal(words[n], exp[n]), n
                assert fol.state.audit() == fol.fingerprint == tr.fingerprint
            raw = sum(w.nbytes for w in _expected(model).values())
            for r in pub.records[1:]:
                assert r.kind == "delta" and r.changed > 0.9 * raw / 2
                assert r.payload_bytes < raw  # every element changed, and still under the raw words
            await pub.close()
        finally:
            await fol.close()
            await tr.close()

    asyncio.run(go())


def test_adapter_that_does_not_match_its_config_is_refused():
    with pytest.raises(ConfigError, match="rank-8"):
        AdapterPublisher(_Lora(r=4), name="policy", base_fingerprint=BASE_FP, r=8, lora_alpha=8,
                         target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="target modules"):
        AdapterPublisher(_Lora(), name="policy", base_fingerprint=BASE_FP, r=4, lora_alpha=8,
                         target_modules=["q_proj"])
    with pytest.raises(ConfigError, match="no LoRA tensors"):
        AdapterPublisher(torch.nn.Linear(2, 2), name="x", base_fingerprint=BASE_FP, r=4, lora_alpha=8,
                         target_modules=["q_proj"])


def test_peft_folder_round_trip_and_a_state_that_is_not_an_adapter(tmp_path):
    model = _Lora()
    cfg = adapter.AdapterConfig("policy", 4, 8.0, ("v_proj", "q_proj"), BASE_FP, "tiny")
    tensors = {n: t.detach().to(torch.bfloat16) for n, t in adapter.peft_names(dict(model.named_parameters())).items()}
    adapter.write_peft_folder(tmp_path / "a", tensors, cfg)
    back, cfg2 = adapter.read_peft_folder(tmp_path / "a", name="policy", base_fingerprint=BASE_FP)
    assert cfg2 == cfg and cfg.target_modules == ("q_proj", "v_proj")
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)
    state = adapter.adapter_state(back, cfg2)
    assert adapter.split_state(state)[0] == cfg
    from p2psync.state import ModelState

    with pytest.raises(CodecError, match="not an adapter state"):
        adapter.split_state(ModelState({"w": torch.zeros(3)}))
