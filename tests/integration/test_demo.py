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
         "--rollouts-per-region", "1", "--out", str(out), "--timeout", "400"],
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
