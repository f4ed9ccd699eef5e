"""A real ``p2psync node --role rollout --job rollout.worker:run`` process following a real trainer node:
the engine inside the rollout process holds the trainer's bits at every version (the node itself keeps no
second copy of the weights once the engine has them), and SIGTERM ends it cleanly."""

from __future__ import annotations

import json
import signal

import pytest
from nodeproc import CHUNK, at_version, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def _publish_versions(cluster, steps: int) -> dict[int, str]:
    """Train a tiny model for ``steps`` AdamW steps; drop the snapshot and each delta into the publish dir."""
    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
    from p2psync.state import ModelState
    from p2psync.presets import build_model
    from trainer.workload import Workload

    model = build_model("tiny", seed=1)
    w = Workload(model, lr=1e-3, seed=1)
    opts = CodecOptions(chunk_size=CHUNK)
    prev = ModelState(w.published())
    fps = {0: prev.fingerprint}
    enc = encode_snapshot(prev, opts)
    m = build_manifest(enc, model_id="tiny", target_version=0, chunk_size=CHUNK, private_key=cluster.priv)
    write_file(cluster.publish_dir / "000000-snapshot.p2sa", m, enc.chunks)
    for v in range(1, steps + 1):
        w.step()
        new = ModelState(w.published())
        enc = encode_delta(prev, new, opts)
        m = build_manifest(enc, model_id="tiny", base_version=v - 1, target_version=v, chunk_size=CHUNK,
                           private_key=cluster.priv)
        write_file(cluster.publish_dir / f"{v:06d}-delta.p2sa", m, enc.chunks)
        fps[v] = new.fingerprint
        prev = new
    assert len(set(fps.values())) == steps + 1  # every step changed the weights: each version tells apart
    return fps


def test_rollout_engine_in_a_node_process_tracks_every_version(cluster, tmp_path):
    events = tmp_path / "events.jsonl"
    cfg = tmp_path / "rollout.json"
    cfg.write_text(json.dumps({"preset": "tiny", "threads": 1, "events_path": str(events)}))
    trainer = cluster.start("trainer", "trainer", publish=True)
    rollout = cluster.start("r1", "rollout", [trainer.url],
                            extra=["--job", "rollout.worker:run", "--job-config", str(cfg)])
    fps = _publish_versions(cluster, steps=4)
    wait_for(lambda: at_version(rollout, 4), 120, "rollout node at version 4")

    def engine_at_4():
        if not events.exists():
            return None
        rows = [json.loads(x) for x in events.read_text().splitlines()]
        sw = [r for r in rows if r["event"] == "switch"]
        return sw if sw and sw[-1]["version"] == 4 else None

    switches = wait_for(engine_at_4, 120, "engine serving version 4")
    status = rollout.status()
    assert status["fingerprint"] == fps[4]
    # The engine holds the weights: the node keeps the signed artifacts, not a second copy.
    assert status["holds_weights"] is False
    assert "weights dropped" in rollout.log.read_text()
    for s in switches:
        assert s["ok"] and s["fingerprint"] == s["expected"] == fps[s["version"]]
    assert [s["version"] for s in switches] == sorted(s["version"] for s in switches)
    rollout.kill(signal.SIGTERM)
    assert rollout.popen.wait(30) == 0
    log = rollout.log.read_text()
    assert "job failed" not in log and "Traceback" not in log
