"""Benchmark: how long an update pauses generation, staged ahead or not (real vLLM, p2psync backend).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_stage.py --quick --json out.json       # small model, minutes
    PYTHONPATH=$PWD .venv/bin/python tools/bench_stage.py --out DIR --json out.json     # the 533 M workload

It builds the workload of ``tools/bench_scale.py`` (``--quick``: its small model; else the 533 M
one of ``tools/bench_vllm_apply.py``; ``--reuse``: the one already in ``--out``), serves it from a
trainer node on loopback, starts one vLLM engine (``--tp``) and alternates, ``--repeats`` times
each, after vLLM's dense reload of version 0 and an init at version 0:

- ``plain``: the update to version 1 (``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` and the prefix-cache reset): fetch, decode, check and write, all of it
  time a client pausing generation around the update waits;
- ``staged``: the same update staged first (``"stage": true``; the engine idle meanwhile) until
  every rank's stage ended, then the update, which commits what was staged: the pause.

Reports every update's seconds at the caller (``pause_s``), the backend's split of the slowest
rank (``fetch_s``, ``decode_s``, ``commit_s``; ``staged_s``: its stage), the medians, and
``staged_over_plain``: median staged pause / median plain update.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_scale
import vllm_workload
from benchout import loadavg


def _slowest(eng: Any) -> dict:
    """The slowest rank's split of the last update (the backend's status)."""
    ranks = [s["timing"] for s in eng.rank_status()]
    t = max(ranks, key=lambda r: sum(r.get(k, 0.0) for k in ("fetch_s", "decode_s", "commit_s")))
    return {k: t.get(k) for k in ("fetch_s", "decode_s", "commit_s", "staged_s", "staged", "fetched_bytes")}


def measure(ctx: dict, url: str, tp: int, repeats: int) -> dict:
    """Plain and staged updates alternating on one engine (see module doc)."""
    got: dict[str, list[dict]] = {"plain": [], "staged": []}
    with bench_scale.engine(ctx, url, tp) as (eng, parent):
        for k in range(2 * repeats):
            how = "plain" if k % 2 == 0 else "staged"
            if err := bench_scale.back_to_v0(ctx, eng, parent):
                raise SystemExit(err)
            if how == "staged":
                eng.stage(1)
                while not all((s["staging"] or {}).get("done") for s in eng.rank_status()):
                    time.sleep(0.01)
            t = time.perf_counter()
            if eng.reach(1) != ctx["target"]:
                raise SystemExit("the update did not reach the signed fingerprint")
            got[how].append({"pause_s": round(time.perf_counter() - t, 4), **_slowest(eng)})
    out: dict = {}
    for how, ups in got.items():
        out[how] = {"updates": ups, "median_pause_s": round(statistics.median(u["pause_s"] for u in ups), 4)}
    out["staged"]["median_staged_s"] = round(statistics.median(u["staged_s"] for u in got["staged"]), 4)
    out["staged_over_plain"] = round(out["staged"]["median_pause_s"] / out["plain"]["median_pause_s"], 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="the small model of bench_scale.py --quick")
    ap.add_argument("--out", default=None, help="workload folder (built unless --reuse finds one)")
    ap.add_argument("--reuse", action="store_true", help="the workload already in --out")
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    ap.add_argument("--repeats", type=int, default=5, help="updates of each kind")
    ap.add_argument("--chunk-mib", type=float, default=0, help="chunk size (default: 1/16 with --quick, 1 otherwise)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    tools = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")]))  # vLLM's workers
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-stage-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": " ".join(["tools/bench_stage.py", *sys.argv[1:]]),
                 "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs",
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "loadavg_start": loadavg(), "tp": args.tp}
    t0 = time.perf_counter()
    if args.reuse and (out / "context.json").exists():
        ctx = json.loads((out / "context.json").read_text())
    else:
        chunk_mib = args.chunk_mib or (1 / 16 if args.quick else 1.0)
        ns = argparse.Namespace(**(bench_scale.QUICK if args.quick else bench_scale.FULL), lr=1e-6, model="dense",
                                experts=0, moe_mlp=0, link_mbit=0, repeats=1, json=None, tp=1, chunk_mib=chunk_mib)
        ctx = vllm_workload.build_workload(ns, out)
    ctx.update(json=None)
    res["workload"] = {k: ctx[k] for k in ("params", "changed", "delta_bytes")}
    with vllm_workload.serving(ctx) as url:
        res.update(measure(ctx, url, args.tp, args.repeats))
    res["loadavg_end"] = loadavg()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("workload", "staged_over_plain", "loadavg_start", "loadavg_end")}))
    print(json.dumps({h: res[h]["median_pause_s"] for h in ("plain", "staged")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
