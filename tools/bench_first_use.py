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

Like for like (``--alternate``): an AdamW run's first delta changes about twice the
elements of its later ones (the bias-corrected first step is larger), so its ratio
mixes first-use costs with more work. With ``--alternate`` the first step is a real
optimizer step (weights W0 -> W1) and the later versions alternate W0, W1, W0, ...:
every delta then changes exactly the same elements, and ``first_over_later`` is the
first publish's cost of being first alone.

Beside each delta: ``cpu_s`` (the process's CPU seconds during the publish), ``gc_s``
(seconds of the collector's full collections inside it), ``warm_threads`` (warm-up
threads still running when it started); where the first publish's extra time goes.
``first_over_later_cpu``: the same ratio in CPU seconds, which a loaded machine's
changing CPU share leaves alone.

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
    import gc
    import threading

    t_start = time.perf_counter()
    gc_full: list[float] = []  # seconds of each full collection, in order
    gc_t0: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            gc_t0[threading.get_ident()] = time.perf_counter()
        elif threading.get_ident() in gc_t0:
            gc_full.append(time.perf_counter() - gc_t0.pop(threading.get_ident()))

    gc.callbacks.append(on_gc)

    async def go() -> dict:
        import torch

        from p2psync.codec import precompile
        from trainer.bench import _node
        from trainer.publisher import Publisher
        from p2psync.presets import build_model
        from trainer.workload import Workload

        with tempfile.TemporaryDirectory() as d:
            node = await _node(Path(d))
            try:
                torch.manual_seed(0)
                w = Workload(build_model(args.preset, seed=0), lr=args.lr, batch=2, seq=32)
                pub = await Publisher.create(w.model, node, threads=2)
                t_ready = time.perf_counter() - t_start
                rows = []
                params = list(w.model.parameters())
                states: list[list[torch.Tensor]] = []
                if args.alternate:
                    states.append([p.detach().clone() for p in params])  # W0
                for i in range(args.steps):
                    if not args.alternate or i == 0:
                        await asyncio.to_thread(w.step)
                        if args.alternate:
                            states.append([p.detach().clone() for p in params])  # W1
                    else:
                        with torch.no_grad():  # W0, W1, W0, ...: every delta changes the same elements
                            for p, v in zip(params, states[(i + 1) % 2]):
                                p.copy_(v)
                    warm = sorted(t.name for t in threading.enumerate() if "warm" in t.name)
                    n_gc, cpu = len(gc_full), time.process_time()
                    with precompile.first_use() as loaded:
                        await asyncio.to_thread(pub.publish_sync)
                        await asyncio.to_thread(pub.flush_sync)
                    rec = pub.records[-1]
                    rows.append({"version": rec.version, "total_s": round(rec.total_s, 4),
                                 "extract_s": round(rec.extract_s, 4), "encode_s": round(rec.encode_s, 4),
                                 "publish_s": round(rec.publish_s, 4), "changed": rec.changed,
                                 "cpu_s": round(time.process_time() - cpu, 4),
                                 "gc_s": round(sum(gc_full[n_gc:]), 4), "warm_threads": warm,
                                 "kernels_loaded": sorted(set(loaded))})
                await pub.close()
                hits, misses = precompile.cache_stats()
                compiled = sorted(f"{d.py_func.__module__}.{d.py_func.__name__}" for d in precompile.dispatchers()
                                  if sum(d.stats.cache_misses.values()))
            finally:
                await node.close()
        later = [r["total_s"] for r in rows[1:]]
        per = [r["total_s"] / r["changed"] for r in rows]
        return {"preset": args.preset, "lr": args.lr, "cold": args.cold, "alternate": args.alternate,
                "v0_published_after_s": round(t_ready, 2),
                "first_s": rows[0]["total_s"], "later_median_s": statistics.median(later),
                "first_over_later": round(rows[0]["total_s"] / statistics.median(later), 3),
                "first_over_later_per_change": round(per[0] / statistics.median(per[1:]), 3),
                "first_over_later_cpu": round(rows[0]["cpu_s"] / statistics.median(r["cpu_s"] for r in rows[1:]), 3),
                "kernels_compiled": misses, "compiled": compiled, "kernels_from_cache": hits, "deltas": rows}

    return asyncio.run(go())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cold", action="store_true", help="start from an empty kernel cache")
    ap.add_argument("--alternate", action="store_true",
                    help="like for like: one optimizer step, then alternate between the two weight sets (module doc)")
    ap.add_argument("--json", default=None, help="append the result line to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps: at least 2 (a first publish and a later one)")
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    emit(measure(args.preset, args.lr, args.steps, args.cold, args.alternate), args.json)
    return 0


def measure(preset: str = "small", lr: float = 1e-5, steps: int = 6, cold: bool = False,
            alternate: bool = False) -> dict:
    """One fresh trainer process's publishes (see module doc); ``cold``: from an empty kernel cache;
    ``alternate``: every delta changes the same elements (like for like)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="bench-first-use-") as cache:
        if cold:
            env["NUMBA_CACHE_DIR"] = cache
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--preset", preset,
                "--lr", str(lr), "--steps", str(steps)] + (["--cold"] if cold else []) + (["--alternate"] if alternate else [])
        t = time.perf_counter()
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
        wall = time.perf_counter() - t
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = round(wall, 1)
    res["loadavg"] = loadavg()
    return res


if __name__ == "__main__":
    sys.exit(main())
