"""Real ``p2psync node`` processes on loopback: dissemination, failover, corruption, catch-up, restart."""

from __future__ import annotations

import signal
from pathlib import Path

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


def _checkpoint_version(p) -> int | None:
    from p2psync.artifact import ArtifactFile
    from p2psync.store import STATE_FILE

    path = p.data_dir / STATE_FILE
    if not path.exists():
        return None
    with ArtifactFile(path, None, allow_unsigned=True) as art:
        return art.manifest.target_version


@pytest.mark.timeout(150)
def test_stop_checkpoints_unless_told_not_to_and_both_restart_bit_exact(cluster: Cluster):
    """SIGTERM: the node exits 0 with its last log line written; by default it checkpoints the
    weights on the way out, with store.checkpoint_on_exit=false it does not, and a restart
    rebuilds the same version from the store's snapshot and deltas. A relay with no chunk
    cache (store.cache_bytes=0) serves its child from disk."""
    w = Workload(cluster.priv)
    w.snapshot(cluster.publish_dir)
    no_periodic = ["--store.checkpoint_interval=0"]
    tr = cluster.start("trainer", "trainer", publish=True)
    relay = cluster.start("relay", "relay", [tr.url], extra=[*no_periodic, "--store.cache_bytes=0"])
    leaf = cluster.start("leaf", "rollout", [relay.url],
                         extra=[*no_periodic, "--store.checkpoint_on_exit=false"])
    for _ in range(3):
        w.step(cluster.publish_dir)
    _all_at([tr, relay, leaf], 3, w.fingerprints[3])
    assert relay.status()["bytes_out"] > 0  # the leaf was served by the cache-less relay
    assert _checkpoint_version(relay) is None and _checkpoint_version(leaf) is None

    for p in (relay, leaf):
        assert p.stop() == 0, p.log.read_text()[-2000:]
        assert p.log.read_text().rstrip().endswith("stopped at version 3"), p.log.read_text()[-500:]
    assert _checkpoint_version(relay) == 3
    assert _checkpoint_version(leaf) is None

    for p in (relay, leaf):
        again = cluster.restart(p)
        s = wait_for(lambda a=again: (st := a.status())["loaded"] and st, 60, f"{p.name} reloaded")
        assert (s["version"], s["fingerprint"]) == (3, w.fingerprints[3]), p.name
        assert s["bytes_in"] == 0  # rebuilt from what it held, nothing fetched


@pytest.mark.timeout(90)
def test_node_exits_with_the_jobs_code_and_nothing_it_buffered_is_lost(cluster: Cluster, tmp_path):
    """The process leaves without the interpreter's teardown, but only after everything is out:
    the job's return code, output still in the stdout buffer (a pipe, not unbuffered), log lines."""
    import json
    import os
    import subprocess

    import tlsutil
    from nodeproc import CLI, TOKEN

    tlsutil.certify(tmp_path / "tr", "trainer")
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"lines": 2000, "code": 3}))
    args = ["node", "--role", "trainer", "--id", "trainer", "--listen.port=0", f"--data_dir={tmp_path / 'tr'}",
            f"--cluster_token={TOKEN}", f"--trainer_public_key={cluster.keydir / 'trainer.pub'}",
            f"--publish-dir={cluster.publish_dir}", "--job", "tests.integration.exit_job:run",
            "--job-config", str(job)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert p.returncode == 3, err[-2000:]
    lines = out.splitlines()
    assert lines[0].startswith("https://") and lines[1:] == [f"job line {i}" for i in range(2000)]
    assert "job done" in err and err.rstrip().endswith("stopped at version 0"), err[-1000:]


@pytest.mark.timeout(120)
def test_a_node_told_to_exit_with_its_starter_stops_when_the_starter_is_killed(cluster: Cluster, tmp_path):
    """`p2psync demo` starts its nodes with P2PSYNC_EXIT_WITH_PARENT: if the demo is killed
    outright (SIGKILL, no chance to stop them), every node shuts itself down."""
    import os
    import subprocess
    import sys
    import time

    import tlsutil
    from nodeproc import CLI, TOKEN

    tlsutil.certify(tmp_path / "n", "orphan")
    args = ["node", "--role", "relay", "--id", "orphan", "--listen.port=0", f"--data_dir={tmp_path / 'n'}",
            f"--cluster_token={TOKEN}", f"--trainer_public_key={cluster.keydir / 'trainer.pub'}",
            "--parents=https://127.0.0.1:9"]
    starter = subprocess.Popen(
        [sys.executable, "-c",
         "import os, subprocess, sys, time\n"
         "env = {**os.environ, 'P2PSYNC_EXIT_WITH_PARENT': str(os.getpid())}\n"
         "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True, env=env)\n"
         "print(p.pid, p.stdout.readline().strip(), flush=True)\n"
         "time.sleep(600)\n", *CLI, *args],
        stdout=subprocess.PIPE, text=True)
    try:
        pid, url = starter.stdout.readline().split()
        node = int(pid)
        assert url.startswith("https://")

        def alive() -> bool:
            try:
                state = Path(f"/proc/{node}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return False
            return state != "Z"

        time.sleep(1.0)
        assert alive()  # the node runs while its starter does
        starter.kill()
        starter.wait(10)
        deadline = time.monotonic() + 30
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(), "the node outlived the process that started it"
    finally:
        if starter.poll() is None:
            starter.kill()
        try:
            os.kill(node, 9)
        except (OSError, NameError, UnboundLocalError):
            pass
