"""The GRPO job inside a real ``p2psync node --role trainer --job trainer.grpo:run`` process."""

from __future__ import annotations

import json

import pytest
from nodeproc import Cluster, at_version, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_grpo_job_publishes_every_step_and_a_follower_gets_the_last_version(cluster: Cluster):
    root = cluster.root
    cfg = root / "grpo.json"
    cfg.write_text(json.dumps({"steps": 6, "rollouts": "local", "threads": 1, "publish_threads": 1,
                               "metrics_path": str(root / "metrics.jsonl"),
                               "versions_path": str(root / "versions.jsonl")}))
    tr = cluster.start("trainer", "trainer", extra=["--job", "trainer.grpo:run", "--job-config", str(cfg)])
    assert tr.popen.wait(200) == 0, tr.log.read_text()[-3000:]
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    versions = [json.loads(x) for x in (root / "versions.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, 7))
    assert [v["version"] for v in versions] == list(range(7))
    # The published chain is in the trainer's store: serve it again and let a rollout node follow.
    cluster.procs.remove(tr)
    again = cluster.start("trainer", "trainer", data_dir=tr.data_dir)
    fol = cluster.start("rollout", "rollout", [again.url])
    s = wait_for(lambda: at_version(fol, 6), 60, "the follower at version 6")
    assert s["fingerprint"] == versions[-1]["fingerprint"] == rows[-1]["fingerprint"]
