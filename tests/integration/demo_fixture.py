"""A finished demo run made up in memory: node log records, steps and a plan, through the real Timeline.

Used to render the report without starting a cluster (the browser test).
"""

from __future__ import annotations

from typing import Any

from demo.monitor import Mismatch, NodeView
from demo.timeline import Timeline

ROLES = {"trainer": "trainer", "r0-relay1": "relay", "r0-rollout1": "rollout", "r0-rollout2": "rollout",
         "r1-relay1": "relay", "r1-rollout1": "rollout", "r1-rollout2": "rollout"}
REGIONS = {n: ("r1" if n.startswith("r1") else "r0") for n in ROLES}
PLAN = {"r0-relay1": "trainer", "r0-rollout1": "r0-relay1", "r0-rollout2": "r0-relay1",
        "r1-relay1": "trainer", "r1-rollout1": "r1-relay1", "r1-rollout2": "r1-relay1"}
FULL = 38_000_000


def _rec(t: float, node: str, msg: str) -> dict[str, Any]:
    return {"t": t, "level": "INFO", "msg": f"[{node}@{REGIONS[node]}] {msg}", "node": node}


def fake_run(steps: int = 12, mismatch: bool = False, detour: bool = False) -> dict[str, Any]:
    """A monitor snapshot of a run of ``steps`` deltas; ``detour``: r1-rollout2 pulls from the trainer
    after its relay failed."""
    tl = Timeline(dict(ROLES), dict(REGIONS), {f"http://h/{n}": n for n in ROLES},
                  configured={c: p for c, p in PLAN.items()})
    rows, expected = [], {0: "f0" * 16}
    for v in range(1, steps + 1):
        t0 = 1000.0 + 5 * v
        aid = f"delta-{v - 1}-{v}-{v:016x}"
        expected[v] = f"{v:032x}"
        tl.feed("trainer", _rec(t0, "trainer", f"published {aid}"))
        if detour and v == 4:
            tl.feed("r1-rollout2", {"t": t0, "msg": "[r1-rollout2@r1] parent http://h/r1-relay1 failed: stream closed"})
            tl.feed("r1-rollout2", _rec(t0, "r1-rollout2", "parent is now http://h/trainer"))
        for i, n in enumerate(x for x in ROLES if x != "trainer"):
            depth = 1 if ROLES[n] == "relay" else 2
            held = t0 + 0.02 * depth + 0.004 * i + (0.1 if REGIONS[n] == "r1" else 0.0)
            tl.feed(n, _rec(held, n, f"holds {aid}: 1 chunks (1 held or pushed) 0.010 s after its manifest"))
            tl.feed(n, _rec(held + 0.03, n, f"applied {aid} (400000 bytes) -> version {v} fingerprint {expected[v]}"))
            if ROLES[n] == "rollout":
                tl.feed(n, _rec(held + 0.09, n, f"engine serving version {v} (node-decoded; generation paused 0.001 s)"))
        reward = 0.3 + 0.02 * v
        rows.append({"step": v, "version": v, "reward_mean": reward, "reward_std": 0.3, "accuracy": reward,
                     "changed_fraction": 0.02, "payload_bytes": 400_000, "full_bytes": FULL, "train_s": 1.5,
                     "step_s": 4.0})
    checked = 0
    for node, v, fp in tl.fingerprints:
        checked += fp == expected[v]
    mismatches = [Mismatch("r1-rollout1", 3, "ee" * 16, expected[3], "engine")] if mismatch else []
    deltas = tl.deltas()
    return {
        "nodes": {n: NodeView(n, r, REGIONS[n], steps, expected[steps], PLAN.get(n), True) for n, r in ROLES.items()},
        "steps": rows, "warm_start": {"event": "warm_start", "steps": 40, "loss_first": 6.4, "loss_last": 0.8,
                                      "seconds": 17.0},
        "expected": expected, "plans": [(1000.0, dict(PLAN))], "mismatches": mismatches, "checked": checked,
        "unchecked": 0, "switches": [], "batches": [],
        "timings": {"deltas": deltas, "delays": {v: tl.delays(v) for v in tl.announced},
                    "region_held": {v: tl.region_delays(v, "held") for v in deltas},
                    "region_engine": {v: tl.region_delays(v, "engine") for v in deltas},
                    "parents_used": {n: dict(c) for n, c in tl.parents_used().items()},
                    "parent_changes": [vars(c) for c in tl.parent_changes],
                    "roles": dict(ROLES), "regions": dict(REGIONS), "configured": dict(tl.configured)},
    }
