"""A quantized vLLM engine (FP8, INT8, ...) is refused at init with the reason and where to read
more, before vLLM starts: whether the engine asks vLLM to quantize or the checkpoint is quantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2psync.errors import ConfigError
from rollout.engines.base import EngineConfig
from rollout.engines.vllm.launch import checkpoint_quantization, llm_kwargs


def _folder(tmp_path: Path, **extra: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                      **extra}))
    return str(tmp_path)


@pytest.mark.parametrize("method", ["fp8_per_tensor", "fp8", "awq"])
def test_an_engine_asking_vllm_to_quantize_is_refused_with_the_reason(tmp_path: Path, method: str) -> None:
    model = _folder(tmp_path)
    with pytest.raises(ConfigError) as e:
        llm_kwargs(EngineConfig(engine="vllm", model_path=model, vllm={"quantization": method}), model)
    assert e.value.field == "vllm.quantization"
    assert method in str(e.value) and "bit-exact" in str(e.value) and "docs/ROLLOUT.md" in str(e.value)


def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path: Path) -> None:
    # The layout of an FP8 block-quantized checkpoint's config (DeepSeek-V3, Qwen3-FP8).
    model = _folder(tmp_path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                   "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError) as e:
        llm_kwargs(EngineConfig(engine="vllm", model_path=model), model)
    assert e.value.field == "model_path" and "(fp8)" in str(e.value) and "docs/ROLLOUT.md" in str(e.value)
    (tmp_path / "ct").mkdir()  # compressed-tensors' older key
    assert checkpoint_quantization(_folder(tmp_path / "ct", compression_config={"format": "float-quantized"})) \
        == "float-quantized"


def test_an_unquantized_checkpoint_and_a_hub_id_pass(tmp_path: Path) -> None:
    model = _folder(tmp_path)
    kw = llm_kwargs(EngineConfig(engine="vllm", model_path=model), model)
    assert kw["model"] == model and "quantization" not in kw
    assert checkpoint_quantization("Qwen/Qwen3-0.6B") is None  # not a local folder: vLLM resolves it


def test_a_config_that_is_not_json_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        checkpoint_quantization(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(600)  # importing vLLM's quantization layers: 20 s idle, minutes on a loaded machine
def test_the_placement_names_a_quantized_layer_with_the_same_reason() -> None:
    """On CUDA vLLM loads an FP8 checkpoint given by hub id; the backend's binding then refuses its
    quantized layers, naming the layer and its method."""
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from rollout.engines.vllm.placement.repack import QUANTIZED_WHY, transformed_reason

    model = torch.nn.Module()
    model.add_module("proj", torch.nn.Module())
    model.proj.register_parameter("weight", torch.nn.Parameter(torch.zeros(2, 2)))
    model.proj.quant_method = UnquantizedLinearMethod()
    assert transformed_reason(model, "proj.weight") is None
    model.proj.quant_method = Fp8LinearMethod.__new__(Fp8LinearMethod)  # the class is what is checked
    why = transformed_reason(model, "proj.weight")
    assert why is not None and "layer proj is quantized (Fp8LinearMethod)" in why and QUANTIZED_WHY in why
