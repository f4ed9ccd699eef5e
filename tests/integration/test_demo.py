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
        [sys.executable, "-m", "p2psync.cli", "demo", "--plain", "--steps", "4", "--regions", "2",
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
