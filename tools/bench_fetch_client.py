"""A vLLM rank's fetches of one update (plan, manifest, the delta's chunks) from a node on loopback:
a client opened per call, as the backend did, against the client it now keeps between updates.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_fetch_client.py --out DIR --reps 15 --json out.jsonl

``--out``: a workload folder of ``tools/bench_vllm_apply.py`` (built there, in its ``--quick`` shape
of ``tools/bench_scale.py``, when it holds none). The two ways alternate, one update each per repeat;
the first two repeats are not counted (imports, the node's first reads). Mutual TLS and signature
and hash checks as in the backend. Prints and writes medians in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_workload  # noqa: E402
from bench_scale import QUICK  # noqa: E402
from benchout import emit, loadavg  # noqa: E402


def _fresh(coro: Any) -> Any:
    """One call on a loop and thread of its own, its own client inside (the backend's former way)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def update(parent: Any, fetcher: Any) -> dict[str, float]:
    """One update's three fetches, each timed (seconds)."""
    from p2psync.transport.leaf import fetch_artifact, fetch_manifest, fetch_plan

    def run(make: Any, retry: bool = False) -> Any:
        if fetcher is None:
            return _fresh(make(None))
        return fetcher.run(parent, make, retry=retry)

    t0 = time.perf_counter()
    plan = run(lambda c: fetch_plan(parent, 0, 1, c), True)
    t1 = time.perf_counter()
    m = run(lambda c: fetch_manifest(parent, plan[0].id, c), True)
    t2 = time.perf_counter()
    _, chunks = run(lambda c: fetch_artifact(parent, plan[0].id, manifest=m, client=c))
    t3 = time.perf_counter()
    assert all(c is not None for c in chunks)
    return {"plan": t1 - t0, "manifest": t2 - t1, "artifact": t3 - t2, "update": t3 - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None, help="append the result line to this file")
    args = ap.parse_args()
    from p2psync.transport.leaf import Fetcher, Parent

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "context.json").exists():
        ctx = json.loads((out / "context.json").read_text())
    else:
        ns = argparse.Namespace(**QUICK, lr=1e-6, model="dense", experts=0, moe_mlp=0, link_mbit=0, repeats=1,
                                json=None, tp=1, chunk_mib=1 / 16)
        ctx = vllm_workload.build_workload(ns, out)
    times: dict[str, dict[str, list[float]]] = {"fresh": {}, "kept": {}}
    with vllm_workload.serving(ctx) as url:
        vllm_workload.wait_head(ctx, url)
        parent = Parent.create(url, vllm_workload.TOKEN, str(Path(ctx["keydir"]) / "trainer.pub"), "bench",
                               ctx["tls_dir"])
        fetcher = Fetcher()
        try:
            for rep in range(args.reps + 2):
                for way in ("fresh", "kept"):
                    got = update(parent, fetcher if way == "kept" else None)
                    if rep >= 2:
                        for k, v in got.items():
                            times[way].setdefault(k, []).append(v)
        finally:
            fetcher.close()
    res = {"command": " ".join(["tools/bench_fetch_client.py", *sys.argv[1:]]), "reps": args.reps,
           "delta_bytes": ctx["delta_bytes"], "loadavg": loadavg(),
           **{way: {k: round(1000 * statistics.median(v), 1) for k, v in t.items()} for way, t in times.items()}}
    res["update_ratio"] = round(res["kept"]["update"] / res["fresh"]["update"], 3)
    emit(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
