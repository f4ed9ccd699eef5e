"""Real ``p2psync node`` processes on loopback: dissemination, failover, corruption, catch-up, restart."""

from __future__ import annotations

import signal

import pytest
from nodeproc import Cluster, Workload, at_version, wait_for

pytestmark = pytest.mark.integration


def _all_at(procs, version: int, fingerprint: str) -> None:
    for p in procs:
        s = wait_for(lambda p=p: at_version(p, version), 60, f"{p.name} at version {version}")
        assert s["version"] == version, (p.name, s["version"])
        assert s["fingerprint"] == fingerprint, (p.name, version)


@pytest.mark.timeout(150)
def test_tree_of_seven_stays_bit_exact_for_twenty_versions(cluster: Cluster):
    w = Workload(cluster.priv)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    r1 = cluster.start("relay-1", "relay", [tr.url])
    r2 = cluster.start("relay-2", "relay", [tr.url])
    rollouts = [cluster.start(f"rollout-{i}", "rollout", [r.url, o.url, tr.url])
                for i, (r, o) in enumerate([(r1, r2), (r1, r2), (r2, r1), (r2, r1)])]
    nodes = [tr, r1, r2, *rollouts]
    _all_at(nodes, 0, w.fingerprints[0])
    for v in range(1, 21):
        w.step(cluster.publish_dir)
        _all_at(nodes, v, w.fingerprints[v])
    # The tree was used: each relay served its rollout children, not only the trainer.
    for r in (r1, r2):
        s = r.status()
        assert s["bytes_out"] > 0
        assert {c["id"] for c in s["children"]} & {p.name for p in rollouts}


@pytest.mark.timeout(120)
def test_children_fail_over_when_relay_is_killed_mid_transfer(cluster: Cluster):
    w = Workload(cluster.priv, numel=1_200_000, fraction=0.5)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    slow = cluster.start("relay-slow", "relay", [tr.url], extra=["--testing.serve_delay=0.15"])
    other = cluster.start("relay-2", "relay", [tr.url])
    kids = [cluster.start(f"rollout-{i}", "rollout", [slow.url, other.url, tr.url],
                          extra=["--limits.parallel_streams=2"]) for i in range(2)]
    _all_at([tr, slow, other, *kids], 0, w.fingerprints[0])
    before = kids[0].status()["bytes_in"]
    w.step(cluster.publish_dir)

    def mid_transfer():
        for t in kids[0].status()["transfers"].values():
            if 0 < t["chunks_held"] < t["chunks"]:
                return t
        return None

    t = wait_for(mid_transfer, 60, "a transfer in progress", interval=0.02)
    slow.kill(signal.SIGKILL)
    slow.popen.wait(10)
    _all_at([tr, other, *kids], 1, w.fingerprints[1])
    s = kids[0].status()
    # Chunks held before the kill were kept: the artifact was not fetched twice.
    assert s["bytes_in"] - before < 2 * t["bytes"], (s["bytes_in"] - before, t)
    w.step(cluster.publish_dir)
    _all_at([tr, other, *kids], 2, w.fingerprints[2])


@pytest.mark.timeout(120)
def test_corrupting_relay_is_detected_and_avoided(cluster: Cluster):
    w = Workload(cluster.priv)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    bad = cluster.start("relay-bad", "relay", [tr.url], extra=["--testing.corrupt_served_chunks=true"])
    good = cluster.start("relay-good", "relay", [tr.url])
    x = cluster.start("rollout-x", "rollout", [bad.url, good.url, tr.url])
    y = cluster.start("rollout-y", "rollout", [x.url])
    _all_at([tr, bad, good, x, y], 0, w.fingerprints[0])
    for v in range(1, 4):
        w.step(cluster.publish_dir)
        _all_at([tr, bad, good, x, y], v, w.fingerprints[v])
    sx = x.status()
    assert sx["bad_chunks"] > 0
    assert bad.url in sx["avoided"]
    assert f'p2psync_bad_chunks_total{{node="rollout-x",peer="{bad.url}"' in x.metrics()
    # Nothing corrupt was served on: x's child never saw a bad chunk.
    assert y.status()["bad_chunks"] == 0


@pytest.mark.timeout(150)
def test_late_joiner_catches_up_and_restarted_relay_resumes(cluster: Cluster):
    w = Workload(cluster.priv)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    relay = cluster.start("relay", "relay", [tr.url])
    for _ in range(12):
        w.step(cluster.publish_dir)
    _all_at([tr, relay], 12, w.fingerprints[12])

    joiner = cluster.start("joiner", "rollout", [relay.url, tr.url])
    _all_at([joiner], 12, w.fingerprints[12])
    held = {a["id"] for a in joiner.status()["versions"]}
    # Cheapest catch-up: the raw snapshot of version 10 the relay rebuilt, plus two deltas.
    assert any(a.startswith("snapshot-none-10-") for a in held), held

    restarted = cluster.restart(relay)
    s = wait_for(lambda: (st := restarted.status())["loaded"] and st, 60, "relay reloaded")
    assert s["version"] == 12 and s["fingerprint"] == w.fingerprints[12]
    for _ in range(2):
        w.step(cluster.publish_dir)
    _all_at([tr, restarted, joiner], 14, w.fingerprints[14])
    # It resumed from its store: only the two new deltas came over the wire.
    assert restarted.status()["bytes_in"] < w.state.nbytes // 4
