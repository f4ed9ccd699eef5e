"""The engine registry: names map to backends, imported only when chosen."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2psync.errors import ConfigError, P2PSyncError
from rollout.engines import ENGINES, build_engine, engine_class
from rollout.engines.base import EngineConfig
from rollout.options import WorkerOptions


def test_unknown_engine_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        build_engine(EngineConfig(engine="tensorrt"))
    assert err.value.field == "engine"
    for name in ENGINES:
        assert name in str(err.value)
    with pytest.raises(ConfigError, match="choose from hf, vllm"):
        WorkerOptions(engine="sglang")


def test_hf_engine_class_by_name() -> None:
    assert engine_class("hf").__name__ == "HFEngine"


@pytest.mark.parametrize("name", ["vllm", "vllm-lora"])
def test_a_vllm_engine_without_vllm_installed_says_how_to_install_it(name: str, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    with pytest.raises(P2PSyncError, match=rf"engine '{name}' needs vLLM installed \(pip install 'p2psync\[vllm\]'\)"):
        build_engine(EngineConfig(engine=name, model_path="/nonexistent"))


def test_importing_the_registry_imports_no_backend() -> None:
    code = ("import sys, rollout.engines, rollout.worker; "
            "print(sorted(m for m in ('transformers', 'vllm', 'rollout.engines.hf', 'rollout.engines.vllm.engine') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
