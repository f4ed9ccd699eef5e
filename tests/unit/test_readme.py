"""The README's Python quickstart runs as written (so the README cannot drift from the API)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from p2psync import keys
from p2psync.state import ModelState

README = Path(__file__).resolve().parents[2] / "README.md"


def _first_python_block(text: str) -> str:
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def test_readme_publishing_snippet_publishes_every_step_bit_exact(tmp_path, monkeypatch, capsys):
    code = _first_python_block(README.read_text())
    monkeypatch.chdir(tmp_path)
    keys.write_pair(keys.generate(), tmp_path / "keys")  # what `p2psync keygen -o keys` writes
    torch.manual_seed(0)
    scope: dict = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), scope)
    pub, model = scope["pub"], scope["model"]
    # Version 0 (the snapshot) and one delta per optimizer step, the last one carrying exactly
    # the model's final weights as the rollout engines receive them (bf16).
    assert [r.version for r in pub.records] == list(range(11))
    final = ModelState({n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()})
    assert pub.fingerprints[10] == final.fingerprint
    assert "rollout nodes: --parents https://127.0.0.1:" in capsys.readouterr().out
