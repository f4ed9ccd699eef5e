"""The README's Python quickstart runs as written (so the README cannot drift from the API)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tlsutil
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


_TRAINER_PROCESS = """
import re, sys
code = re.search(r"^```python\\n(.*?)^```", open(sys.argv[1]).read(), re.S | re.M).group(1)
exec(compile(code, sys.argv[1], "exec"), {"__name__": "readme"})
print("IMPORTED", *sorted(m for m in ("vllm", "transformers", "triton") if m in sys.modules))
"""

_PLAIN_TORCH = """
import sys, torch
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
print("IMPORTED", *sorted(m for m in ("vllm", "transformers", "triton") if m in sys.modules))
"""


def _imported(out: str) -> list[str]:
    line = [ln for ln in out.splitlines() if ln.startswith("IMPORTED")]
    assert line, out
    return line[-1].split()[1:]


@pytest.mark.timeout(600)
def test_readme_trainer_process_imports_no_engine_and_exits_quietly(tmp_path):
    """The README's trainer, run as its own process: it imports neither vLLM nor transformers, nothing
    of triton beyond what torch's optimizer imports by itself, and exits without a word on stderr
    about leaked objects (a frozen GC at exit made triton's bindings report ~30 lines)."""
    keys.write_pair(keys.generate(), tmp_path / "keys")
    tlsutil.certify(tmp_path / "run" / "trainer", "trainer")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(README.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _TRAINER_PROCESS, str(README)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rollout nodes: --parents https://127.0.0.1:" in run.stdout
    plain = subprocess.run([sys.executable, "-c", _PLAIN_TORCH], env=env, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # torch imports triton itself (when installed) as soon as an optimizer is built:
    # torch.optim -> torch._dynamo -> torch.utils._triton.has_triton_package.
    assert _imported(run.stdout) == [m for m in _imported(plain.stdout) if m == "triton"]
    assert "leaked" not in run.stderr, run.stderr[-3000:]
