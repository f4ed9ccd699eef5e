"""``p2psync demo`` end to end: real trainer, relay and rollout processes; a GRPO run; the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_demo_runs_and_every_engine_holds_the_trainers_bits(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "p2psync.cli", "demo", "--quick", "--plain", "--steps", "4", "--regions", "2",
         "--rollouts-per-region", "1", "--out", str(out), "--timeout", "400", "--capture", str(tmp_path / "wire")],
        capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["ok"] and summary["mismatches"] == []
    assert summary["steps"] == 4 and summary["versions"] == 5  # snapshot v0 + one delta per step
    # Every version was checked on both rollout nodes' own stores and engines, plus relays' stores.
    assert summary["fingerprints_checked"] >= 5 * 2
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    for name in ("index.html", "reward.png", "payload.png", "dissemination.png", "topology.png"):
        assert (out / "report" / name).stat().st_size > 0, name
    assert "OK: every rollout node and engine held exactly the trainer's bits" in proc.stdout
    # The planned tree: each region entered once, through its relay; every node pulled from its planned parent.
    tree = summary["tree"]
    assert tree["entries_planned"] == {"r1": ["r1-relay1"]}
    assert tree["entries_used"] == {"r1": ["r1-relay1"]}, tree
    assert tree["plan"]["r0-rollout1"] == "r0-relay1" and tree["plan"]["r1-rollout1"] == "r1-relay1"
    # Timings are the nodes' own: every region has a time for every delta, not a polled zero.
    assert set(summary["median_region_s"]) == {"r0", "r1"}
    assert all(s > 0 for s in summary["median_region_s"].values())
    assert summary["node_delays_s"]["r1-rollout1"]["held"]["n"] == 4  # every delta

    _nothing_readable_crossed_the_wire(out / "cluster", tmp_path / "wire")


def _nothing_readable_crossed_the_wire(cluster: Path, wire: Path) -> None:
    """Every byte between the nodes was recorded (a relay in front of each node): it holds TLS records,
    and neither the cluster token nor any piece of any chunk the trainer published."""
    from p2psync import keys
    from p2psync.store import VersionStore

    captured = b"".join(f.read_bytes() for f in sorted(wire.glob("*.bin")))
    token = (cluster / "cluster.token").read_text().strip().encode()
    store = VersionStore.open(cluster / "nodes" / "trainer", keys.load_public(cluster / "keys" / "trainer.pub"))
    needles, payload = [], 0
    for aid, art in store.artifacts.items():
        for i in range(len(art.manifest.chunks)):
            chunk = bytes(store.read_chunk(aid, i))
            payload += len(chunk)
            if len(chunk) >= 256:
                needles += [chunk[k * len(chunk) // 4:k * len(chunk) // 4 + 48] for k in (1, 2, 3)]
    assert len(needles) >= 3 * 5 and payload > 0
    assert len(captured) > payload  # every version crossed the relays (several times over)
    assert captured.count(b"\x17\x03\x03") > 100  # TLS application-data records
    assert token not in captured
    assert not [n for n in needles if n in captured]
    assert b"Bearer" not in captured and b"HTTP/1.1" not in captured
