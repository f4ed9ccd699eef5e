"""docs/INTEGRATIONS.md, section "verl": its Python block runs as written, and its config names
verl's own keys (so the page cannot drift from the API). Needs the verl venv (tools/verl_venv.sh), where ``bash tools/test.sh`` runs the tests marked ``verl``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch


from p2psync import keys  # noqa: E402
from p2psync.state import ModelState  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md"

pytestmark = [pytest.mark.verl, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True, scope="module")
def _verl_installed() -> None:
    """verl and vLLM import here (the verl venv), or the run fails under CI=true (skips elsewhere)."""
    import needs

    needs.module("vllm")
    needs.module("verl.checkpoint_engine", "bash tools/verl_venv.sh builds .venv-verl, where tools/test.sh runs it")


def _section() -> str:
    text = PAGE.read_text()
    m = re.search(r"^## verl\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/INTEGRATIONS.md has no '## verl' section"
    return m.group(1)


def _block(lang: str) -> str:
    m = re.search(rf"^```{lang}\n(.*?)^```", _section(), re.S | re.M)
    assert m, f"the verl section has no ```{lang} block"
    return m.group(1)


def test_verl_block_publishes_every_sync_bit_exact(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    keys.write_pair(keys.generate(), tmp_path / "keys")  # what `p2psync keygen -o keys` writes
    torch.manual_seed(0)
    scope: dict = {"__name__": "integrations"}
    exec(compile(_block("python"), str(PAGE), "exec"), scope)
    actor, model = scope["actor"], scope["model"]
    out = capsys.readouterr().out
    assert [int(v) for v in re.findall(r"-> version (\d+) at https://127\.0\.0\.1:\d+", out)] == [0, 1, 2]
    final = ModelState({n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()})
    assert re.findall(r"'checkpoint_engine/version': (\d+)\.0", out) == ["0", "1", "2"]
    assert actor.publisher is None  # closed by the block
    assert actor.fingerprints[2] == final.fingerprint  # the last version is the model's bf16 bits


def test_verl_config_block_names_verl_keys():
    from verl.workers.config.rollout import CheckpointEngineConfig

    block = _block("bash")
    fields = set(CheckpointEngineConfig.__dataclass_fields__)
    used = re.findall(r"actor_rollout_ref\.rollout\.checkpoint_engine\.(\w+)", block)
    assert used and set(used) <= fields, set(used) - fields
    assert "checkpoint_engine.backend=p2psync" in block
    assert "custom_backend_module=trainer.verl" in block
    assert "weight_transfer_config={backend: p2psync}" in block
