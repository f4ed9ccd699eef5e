"""Benchmark: a fresh trainer process's first publish against its later ones (compile and load off the path).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_first_use.py --json out.jsonl
    PYTHONPATH=$PWD .venv/bin/python tools/bench_first_use.py --cold --json out.jsonl   # empty kernel cache

Each run starts a new Python process (nothing imported, nothing warm) that does
what a training script does: starts the trainer node in process, builds the model
(the ``--preset`` Qwen3 shape, fp32 master weights, AdamW at ``--lr``), publishes
version 0 (``Publisher.create``), then ``--steps`` times one optimizer step and
``publish_sync`` + ``flush_sync``. Reported per delta: the publisher's own
``total_s`` (from the call until the node accepted it), and the codec kernels that
the publish had to load or compile itself (``first_use``), while the node's and
the publisher's warm-up threads (:mod:`p2psync.codec.precompile`) loaded the rest.
``first_over_later``: the first delta's ``total_s`` over the median of the later ones.

``--cold`` points ``NUMBA_CACHE_DIR`` at an empty folder (a machine where
``p2psync warm`` never ran): the kernels compile in the warm-up threads, and the
first publish waits for the ones it needs. The vLLM side (a fresh engine's first
update against a repeated one) is measured by ``tools/bench_vllm_apply.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchout import emit, loadavg


def child(args: argparse.Namespace) -> dict:
    import asyncio

    t_start = time.perf_counter()

    async def go() -> dict:
        import torch

        from p2psync.codec import precompile
        from trainer.bench import _node
        from trainer.publisher import Publisher
        from trainer.workload import Workload, build_model

        with tempfile.TemporaryDirectory() as d:
            node = await _node(Path(d))
            try:
                torch.manual_seed(0)
                w = Workload(build_model(args.preset, seed=0), lr=args.lr, batch=2, seq=32)
                pub = await Publisher.create(w.model, node, threads=2)
                t_ready = time.perf_counter() - t_start
                rows = []
                for _ in range(args.steps):
                    await asyncio.to_thread(w.step)
                    with precompile.first_use() as loaded:
                        await asyncio.to_thread(pub.publish_sync)
                        await asyncio.to_thread(pub.flush_sync)
                    rec = pub.records[-1]
                    rows.append({"version": rec.version, "total_s": round(rec.total_s, 4),
                                 "extract_s": round(rec.extract_s, 4), "encode_s": round(rec.encode_s, 4),
                                 "publish_s": round(rec.publish_s, 4), "changed": rec.changed,
                                 "kernels_loaded": sorted(set(loaded))})
                await pub.close()
                hits, misses = precompile.cache_stats()
                compiled = sorted(f"{d.py_func.__module__}.{d.py_func.__name__}" for d in precompile.dispatchers()
                                  if sum(d.stats.cache_misses.values()))
            finally:
                await node.close()
        later = [r["total_s"] for r in rows[1:]]
        return {"preset": args.preset, "lr": args.lr, "cold": args.cold, "v0_published_after_s": round(t_ready, 2),
                "first_s": rows[0]["total_s"], "later_median_s": statistics.median(later),
                "first_over_later": round(rows[0]["total_s"] / statistics.median(later), 3),
                "kernels_compiled": misses, "compiled": compiled, "kernels_from_cache": hits, "deltas": rows}

    return asyncio.run(go())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cold", action="store_true", help="start from an empty kernel cache")
    ap.add_argument("--json", default=None, help="append the result line to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps: at least 2 (a first publish and a later one)")
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    emit(measure(args.preset, args.lr, args.steps, args.cold), args.json)
    return 0


def measure(preset: str = "small", lr: float = 1e-5, steps: int = 6, cold: bool = False) -> dict:
    """One fresh trainer process's publishes (see module doc); ``cold``: from an empty kernel cache."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="bench-first-use-") as cache:
        if cold:
            env["NUMBA_CACHE_DIR"] = cache
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--preset", preset,
                "--lr", str(lr), "--steps", str(steps)] + (["--cold"] if cold else [])
        t = time.perf_counter()
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
        wall = time.perf_counter() - t
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = round(wall, 1)
    res["loadavg"] = loadavg()
    return res


if __name__ == "__main__":
    sys.exit(main())
