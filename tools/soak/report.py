"""The chaos soak's result: what it counts, how each check is defined, and whether it passed."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from soak.schedule import ALL_KINDS

REPO = Path(__file__).resolve().parents[2]


def report(self: Any, final_s: float | None, final_why: dict, wall: float) -> dict:
    """The soak's JSON: fault counts, convergence, every zero-check and what it measures (``self``: the soak)."""
    led = self.ledger
    counts = {k: 0 for k in ALL_KINDS}
    for e in self.episodes:
        for f in e["faults"]:
            counts[f["kind"]] += 1
    conv = [e["converged_s"] for e in self.episodes if e["converged_s"] is not None]
    accepted: dict[str, int] = {}
    if self.results.exists():
        for line in self.results.read_text().splitlines():
            w = json.loads(line)["work_id"]
            accepted[w] = accepted.get(w, 0) + 1
    trainer_final = self.round["nodes"].get(self.tb.trainer.id, {}).get("version")  # type: ignore[union-attr]
    return {
        "mode": "short" if self.args.short else "default", "seed": self.args.seed,
        "nodes": len(self.cfg.machines()) - 1, "regions": len(self.cfg.regions),
        "wall_s": round(wall, 1), "versions_published": led.latest + 1,
        "faults": {k: v for k, v in counts.items()}, "faults_total": sum(counts.values()),
        "episodes": len(self.episodes),
        "converged_after_heal_s": max(conv) if conv else None,
        "converged_after_heal_median_s": sorted(conv)[len(conv) // 2] if conv else None,
        "bound_s": self.args.bound,
        "not_converged": sum(1 for e in self.episodes if e["converged_s"] is None) + (final_s is None),
        "final_converged_s": final_s, "final_laggards": final_why,
        "wrong_bits": len(led.wrong), "wrong_bits_detail": sorted(map(list, led.wrong))[:20],
        "bad_chunks": led.bad_chunks_total(),
        "revoked": led.revoked, "revoked_upto": led.revoked_upto,
        "revoked_received_after": len(led.revoked_seen),
        "leases_double_held": len(led.double_held), "lease_snapshots": led.lease_snapshots,
        "results_accepted": len(accepted),
        "results_accepted_twice": sum(1 for n in accepted.values() if n > 1),
        "versions_lost": led.versions_lost(trainer_final), "trainer_restarts": led.restarts,
        "unexpected_exits": self.unexpected_exits, "publish_errors": self.publish_errors[:10],
        "measured": {
            "wrong_bits": "distinct (node, version, fingerprint) in any node's /v1/status (polled every "
                          f"{self.args.poll} s from the core namespace) that differ from the fingerprint "
                          "computed from the checkpoint before it was published",
            "revoked_received_after": "distinct versions newer than the newest published before every live "
                                      "node refused the revoked id, that the revoked node applied, held or "
                                      "was fetching (its /v1/status version and catalogue)",
            "leases_double_held": "distinct work ids listed under two holders in one snapshot of the "
                                  "coordinator's lease table (GET /v1/control/status, each poll round); "
                                  "results_accepted_twice: work ids whose result the coordinator accepted "
                                  "twice (the trainer job's log). The lease table is not on disk: a restarted "
                                  "trainer starts an empty one and submits new work ids, and the old holders' "
                                  "calls are refused (404)",
            "bad_chunks": "chunks that failed verification against the signed manifest at their receiver "
                          "(every node's status; refused, never stored or served): what got through TCP and "
                          "TLS wrong would show here",
            "versions_lost": "versions the trainer held before a SIGKILL and not when it answered again "
                             "with its weights loaded, plus published versions it never reached",
            "converged_after_heal_s": "from the heal of an episode's faults until a status round shows every "
                                      "live, non-revoked node at the newest version published at the heal, "
                                      "bit-exact",
        },
        "episodes_detail": self.episodes,
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.platform()})",
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=False).stdout.strip(),
        "command": " ".join(["tools/chaos.py", *sys.argv[1:]]),
    }


def passed(r: dict) -> bool:
    return (r["wrong_bits"] == 0 and r["revoked_received_after"] == 0 and r["leases_double_held"] == 0
            and r["results_accepted_twice"] == 0 and r["versions_lost"] == 0 and r["not_converged"] == 0
            and not r["unexpected_exits"])
