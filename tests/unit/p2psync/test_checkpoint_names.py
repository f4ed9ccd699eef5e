"""Checkpoint names: the table equals what ``save_pretrained`` writes, name for name and bit for bit,
and a tensor split out of a fused parameter is that parameter's memory, not a copy."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from p2psync.checkpoint_names import View, _check_cover, checkpoint_tensors, checkpoint_views, unique_tensors
from p2psync.errors import CheckpointLayoutError
from p2psync.presets import MOE_FAMILIES, build_model, build_moe

pytestmark = pytest.mark.timeout(300)


def _saved(model: torch.nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_table_is_what_save_pretrained_writes_and_views_the_fused_experts(family, tmp_path):
    model = build_moe(family, seed=1)
    disk = _saved(model, tmp_path)
    named = checkpoint_tensors(model)
    assert sorted(named) == sorted(disk)
    for name, t in disk.items():
        assert named[name].shape == t.shape, name
        assert torch.equal(_bits(named[name]), _bits(t)), name
    fused = {n: p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert fused, "the family holds its experts fused in memory"
    for n, p in fused.items():
        # The expert tensors split out of it lie in its memory (no copies) and together are all of it.
        kids = [t for t in named.values() if t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()]
        assert len(kids) == 4 * (2 if n.endswith("gate_up_proj") else 1), n
        assert sum(t.numel() for t in kids) == p.numel()
        assert not any(k in named for k in fused)
    # A write through a checkpoint name is a write into the model.
    gate_up = next(p for n, p in fused.items() if n.endswith("gate_up_proj"))
    kid = next(t for t in named.values() if t.data_ptr() > gate_up.data_ptr()
               and t.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr())
    with torch.no_grad():
        kid[0, 0] = 7.0
    assert int((gate_up == 7.0).sum()) == 1


def test_dense_model_keeps_its_state_dict_table(tmp_path):
    model = build_model("tiny", seed=2)  # tied embeddings: the head is listed once
    views = checkpoint_views(model)
    assert [v.name for v in views] == list(unique_tensors(model))
    assert all(v.whole and v.name == v.source for v in views)
    assert "lm_head.weight" not in unique_tensors(model)
    disk = _saved(model, tmp_path)
    assert sorted(disk) == sorted(v.name for v in views)
    # The tied head still answers to its name, as the same memory.
    named = checkpoint_tensors(model)
    assert named["lm_head.weight"].data_ptr() == named["model.embed_tokens.weight"].data_ptr()


def test_table_order_follows_the_model_with_experts_in_natural_order():
    model = build_moe("qwen3_moe", num_experts=12)
    names = [v.name for v in checkpoint_views(model)]
    gates = [n for n in names if n.startswith("model.layers.0.mlp.experts.") and n.endswith("gate_proj.weight")]
    assert gates == [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(12)]
    assert names.index("model.layers.0.self_attn.o_proj.weight") < names.index(gates[0])
    assert names.index(gates[-1]) < names.index("model.layers.1.self_attn.q_proj.weight")


def test_views_that_miss_or_repeat_elements_are_refused_naming_the_tensor():
    def view(name: str, offset: int) -> View:
        return View(name, "fused", (2, 4), (4, 1), offset, (4, 4))

    with pytest.raises(CheckpointLayoutError) as e:
        _check_cover("fused", [view("a", 0), view("b", 4)])  # rows 0-1 and 1-2: row 1 twice
    assert e.value.name == "b"
    with pytest.raises(CheckpointLayoutError, match="leave"):
        _check_cover("fused", [view("a", 0)])
    with pytest.raises(CheckpointLayoutError, match="outside"):
        _check_cover("fused", [view("a", 0), view("b", 12)])
    strided = [View("even", "fused", (4, 2), (4, 2), 0, (4, 4)), View("odd", "fused", (4, 2), (4, 2), 0, (4, 4))]
    with pytest.raises(CheckpointLayoutError):
        _check_cover("fused", strided)  # both hold the even columns, neither the odd ones
    _check_cover("fused", [View("even", "fused", (4, 2), (4, 2), 0, (4, 4)),
                           View("odd", "fused", (4, 2), (4, 2), 1, (4, 4))])


def test_a_conversion_that_copies_keeps_the_in_memory_names(caplog):
    """HRM-text saves q/k/v/gate fused (``attn.gqkv_proj``: a concatenation, not a view of one
    parameter): those keep their in-memory names, with a warning; renamed tensors take the new name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("hrm_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_layers_per_stack=1, num_attention_heads=2, head_dim=16, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg)
    tensors = unique_tensors(model)
    with caplog.at_level("WARNING", logger="p2psync.checkpoint_names"):
        views = checkpoint_views(model)
    names = [v.name for v in views]
    assert "model.L_module.layers.0.self_attn.q_proj.weight" in names  # kept: its checkpoint tensor is a copy
    assert "model.L_module.layers.0.attn.o_proj.weight" in names  # renamed on save: a view (the tensor itself)
    assert "gqkv_proj" in caplog.text and "q_proj" in caplog.text
    assert all(v.whole for v in views) and sorted(v.source for v in views) == sorted(tensors)
