"""Benchmark: the rates one engine rank's update is made of, as points for the cost model (tools/scale_model.py).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_rank_rates.py --json points.json
    PYTHONPATH=$PWD .venv/bin/python tools/scale_model.py --points points.json     # the projection from them

It builds the workload of ``tools/bench_vllm_apply.py`` at ``--layers``/``--hidden``/``--vocab``
(default: 4 layers, hidden 1024, vocabulary 32,768: 96 M parameters, one AdamW step at lr 1e-6,
about 4 M changed elements) with ``--chunk-mib`` chunks, starts a trainer node on loopback serving
its version-0 snapshot and version-1 delta, and measures on this machine:

- ``fetch``: a rank's fetch of a whole artifact from the node, as the vLLM backend does it
  (:func:`p2psync.transport.leaf.fetch_artifact`: mutual TLS, 4 streams, every chunk's hash
  checked against the signed manifest), for the snapshot (hundreds of MB, many chunks) and the
  delta (a few MB): two sizes, so that the fit separates the fixed cost from the rate;
- ``decode``: the delta's segments decoded against the base words on 1 and 2 threads, all of them
  and the largest ones holding 25 and 50 % of the changes (``bench_decode_threads.measure``);
- ``write``: the delta's changes scattered into the live words with their undo log and fingerprint
  lanes, the host-memory write of the vLLM backend (:func:`p2psync.wordops.scatter_logged`,
  parts on ``workers.run_ordered``), on 1 and 2 threads, the same three fractions.

Every point is the fastest of ``--reps`` (the least disturbed by other processes on a shared
machine). The JSON names the machine, date and load; ``scale_model.py --points`` takes one or
more such files (for instance this one and the same run on a many-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import bench_decode_threads
import vllm_workload
from benchout import emit, loadavg


def machine() -> str:
    return (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs "
            f"({len(os.sched_getaffinity(0))} usable), "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")


def fetch_points(ctx: dict, url: str, reps: int) -> list[dict]:
    """Each artifact the node holds, fetched whole by the vLLM backend's client ``reps`` times."""
    from p2psync.transport.leaf import Parent, fetch_artifact, fetch_plan

    parent = Parent.create(url, vllm_workload.TOKEN, str(Path(ctx["keydir"]) / "trainer.pub"), "bench",
                           ctx["tls_dir"], 60.0)
    plan: list = []
    for _ in range(600):  # the node ingests its publish folder after it starts
        try:
            plan = asyncio.run(fetch_plan(parent, None, 1))
            break
        except Exception:  # noqa: BLE001 - not there yet
            time.sleep(0.5)
    if not plan:
        raise SystemExit(f"the node at {url} did not come to hold version 1")
    out = []
    for art in plan:
        times, nbytes, chunks = [], 0, 0
        for _ in range(reps):
            t = time.perf_counter()
            m, got = asyncio.run(fetch_artifact(parent, art.id))
            times.append(time.perf_counter() - t)
            nbytes, chunks = sum(len(c) for c in got), len(got)
            del got
        out.append({"artifact": m.kind, "bytes": nbytes, "chunks": chunks, "s": round(min(times), 4),
                    "s_all": [round(x, 4) for x in times], "parallel_streams": 4, "tls": True})
    return out


def write_points(src: Path, reps: int, fractions: tuple[float, ...]) -> list[dict]:
    """The delta's changes written into the version-0 words (:func:`wordops.scatter_logged` per tensor,
    largest first, on 1 and 2 threads), each write taken back before the next."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from p2psync import wordops
    from p2psync.codec import precompile
    from p2psync.state import tensor_seed
    from p2psync.workers import run_ordered

    precompile.warm(("BF16",))
    raw = load_file(str(src / "dense_v0.safetensors"))
    sparse = load_file(str(src / "sparse.safetensors"))
    names = sorted(n[: -len(".indices")] for n in sparse if n.endswith(".indices"))
    words = {n: raw[n].contiguous().view(torch.int16).reshape(-1).numpy().view(np.uint16).copy() for n in names}
    del raw
    parts = [(n, sparse[n + ".indices"].numpy().astype(np.int64),
              sparse[n + ".values"].contiguous().view(torch.int16).numpy().view(np.uint16).copy()) for n in names]
    parts.sort(key=lambda p: -p[1].shape[0])
    seeds = {n: np.uint64(tensor_seed(n)) for n in names}
    cpus = os.sched_getaffinity(0)
    total = sum(p[1].shape[0] for p in parts)
    out = []
    for frac in fractions:
        ks, got = [], 0
        for k, p in enumerate(parts):
            if got >= frac * total:
                break
            ks.append(k)
            got += p[1].shape[0]
        for threads in (1, 2):
            best = float("inf")
            for _ in range(reps):
                undo = [np.empty_like(parts[k][2]) for k in range(len(parts))]

                def one(k: int) -> None:
                    n, pos, new = parts[k]
                    wordops.scatter_logged(words[n], pos, new, undo[k], seeds[n])

                t = time.perf_counter()
                _, _, err = run_ordered(len(parts), ks, one, threads, cpus)
                best = min(best, time.perf_counter() - t)
                if err is not None:
                    raise err
                for k in ks:  # back to version 0
                    wordops.scatter(words[parts[k][0]], parts[k][1], undo[k])
            out.append({"changes": got, "parts": len(ks), "threads": threads, "s": round(best, 4)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the points to this file (one JSON object)")
    ap.add_argument("--out", default=None, help="the workload folder (default: a new temporary one)")
    ap.add_argument("--reuse", action="store_true", help="reuse the workload already in --out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tools = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")]))
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-rank-rates-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": " ".join(["tools/bench_rank_rates.py", *sys.argv[1:]]), "machine": machine(),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "loadavg_start": loadavg()}
    if args.reuse and (out / "context.json").exists():
        ctx = json.loads((out / "context.json").read_text())
    else:
        ns = argparse.Namespace(layers=args.layers, hidden=args.hidden, mlp=3 * args.hidden, heads=args.hidden // 64,
                                kv_heads=max(1, args.hidden // 128), vocab=args.vocab, lr=1e-6, model="dense",
                                experts=0, moe_mlp=0, link_mbit=0, repeats=1, json=None, tp=1,
                                chunk_mib=args.chunk_mib)
        ctx = vllm_workload.build_workload(ns, out)
    res["workload"] = {k: ctx[k] for k in ("params", "changed", "delta_bytes")}
    with vllm_workload.serving(ctx) as url:
        res["fetch"] = fetch_points(ctx, url, args.reps)
    fractions = (0.25, 0.5, 1.0)
    dec = bench_decode_threads.measure(out, args.reps, fractions=fractions)
    res["decode"] = dec["points"]
    res["write"] = write_points(out, args.reps, fractions)
    res["loadavg_end"] = loadavg()
    Path(args.json).write_text(json.dumps(res, indent=1))
    emit({k: res[k] for k in ("machine", "loadavg_start", "loadavg_end", "fetch", "decode", "write")}, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
