"""End-to-end figures of ``p2psync demo`` on loopback: step time with and without weight sync, switch time.

Runs the demo twice in one go (weight sync on, then ``--no-sync``: step 0's
weights stay on the rollout nodes) with the same seed and options, and reads
each run's ``report/summary.json``. Prints and writes (``--json``):

- median trainer step time with sync / without, and the ratio (target <= 1.05);
- median weight switch on a rollout node (artifact complete -> serving the new
  version) against the median rollout batch time (target <= 5 %);
- fingerprint checks and reward first/last from the synced run.

    .venv/bin/python tools/bench_e2e.py --steps 12 --json docs/benchmarks/e2e.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "p2psync.cli", "demo", "--plain", "--out", str(out), *extra]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    summary = json.loads((out / "report" / "summary.json").read_text())
    summary["rc"] = rc
    return summary


def sync_latency(out: Path) -> dict | None:
    """Per version: publish called (the optimizer step had ended) -> the last rollout engine serving
    it. At k = 1 the next-but-one batch can only start after this, so a step waits whenever this
    latency plus one batch's generation exceeds a training step."""
    try:
        started = {}
        for line in (out / "versions.jsonl").read_text().splitlines():
            v = json.loads(line)
            if "started" in v and v["version"] > 1:  # version 1: codec and engine warm-up
                started[v["version"]] = v["started"]
        serving: dict[int, float] = {}
        for f in (out / "events").glob("*.jsonl"):
            for line in f.read_text().splitlines():
                e = json.loads(line)
                if e.get("event") == "switch" and e["version"] in started:
                    serving[e["version"]] = max(serving.get(e["version"], 0.0), e["time"])
    except (OSError, ValueError, KeyError):
        return None
    lat = sorted(serving[v] - started[v] for v in serving)
    if not lat:
        return None
    return {"median_s": round(statistics.median(lat), 4), "p90_s": round(lat[int(0.9 * (len(lat) - 1))], 4),
            "versions": len(lat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="/tmp/p2psync-bench-e2e")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate sync / no-sync runs this many times (load that comes and goes on a shared "
                         "machine then hits both); figures are from the last round, ratios per round too")
    ap.add_argument("demo_args", nargs="*", help="extra `p2psync demo` options (after --)")
    a = ap.parse_args()
    base = ["--steps", str(a.steps), *a.demo_args]
    ratios = []
    for k in range(a.rounds):
        tag = f"-{k}" if a.rounds > 1 else ""
        synced = run_once(Path(a.out) / f"sync{tag}", base)
        unsynced = run_once(Path(a.out) / f"nosync{tag}", [*base, "--no-sync"])
        if synced["median_step_s"] and unsynced["median_step_s"]:
            ratios.append(round(synced["median_step_s"] / unsynced["median_step_s"], 3))
    res = {
        "steps": a.steps, "demo_args": a.demo_args, "rounds": a.rounds, "step_ratio_per_round": ratios,
        "step_ratio_median": statistics.median(ratios) if ratios else None,
        "step_s_sync": synced["median_step_s"], "step_s_nosync": unsynced["median_step_s"],
        "step_ratio": (synced["median_step_s"] / unsynced["median_step_s"])
        if synced["median_step_s"] and unsynced["median_step_s"] else None,
        "switch_s": synced["median_switch_s"], "batch_s": synced["median_batch_s"],
        "sync_latency": sync_latency(Path(a.out) / f"sync-{a.rounds - 1}" if a.rounds > 1 else Path(a.out) / "sync"),
        "train_s_sync": synced.get("median_train_s"), "train_s_nosync": unsynced.get("median_train_s"),
        "wait_s_sync": synced.get("median_wait_s"), "wait_s_nosync": unsynced.get("median_wait_s"),
        "switch_fraction": (synced["median_switch_s"] / synced["median_batch_s"])
        if synced["median_switch_s"] is not None and synced["median_batch_s"] else None,
        "fingerprints_checked": synced["fingerprints_checked"], "mismatches": len(synced["mismatches"]),
        "reward_first": synced["reward_first"], "reward_last": synced["reward_last"],
        "median_region_s": synced["median_region_s"],
        "payload_bytes_total": synced["payload_bytes_total"], "full_bytes_total": synced["full_bytes_total"],
        # CPU seconds of the node processes over the whole run (start-up included, the same in both),
        # per role: the difference is what weight sync cost on this machine's shared cores.
        "cpu_s_by_role_sync": synced.get("cpu_s_by_role"), "cpu_s_by_role_nosync": unsynced.get("cpu_s_by_role"),
        "cpu_s_per_step_extra": {r: round((c - unsynced.get("cpu_s_by_role", {}).get(r, 0.0)) / a.steps, 3)
                                 for r, c in (synced.get("cpu_s_by_role") or {}).items()},
        "ok": synced["ok"] and unsynced["rc"] in (0, 1),
    }
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if synced["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
