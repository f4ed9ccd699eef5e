"""Codec benchmark: payload ratio, throughput and memory on a real training workload.

Workload: a Qwen3-shaped model from a transformers config (random init,
~101M parameters with the ``bench`` preset), fp32 master weights, AdamW, a
next-token loss, published as bf16 casts. For each learning rate: ``--warmup``
steps, then ``--measure`` steps whose deltas are measured.

Reported per learning rate: changed fraction; payload bytes and ratio to full
bf16 for p2psync and two references (COO int32 indices + raw values, as
SparseRL-Sync ships; zstd-3 of the full bf16 tensors); encode and
decode+apply throughput in GB/s of model weights with 1 and 2 threads; the same
for the fast mode (``context_buckets=1``: context-free positions); this
machine's memcpy GB/s measured in the same run; peak extra memory while
encoding as a fraction of the model size.

    .venv/bin/python tools/bench_codec.py --json docs/benchmarks/codec.json

``--latency`` reports milliseconds per delta on one thread instead (small models, where the
fixed cost per segment matters):

    .venv/bin/python tools/bench_codec.py --latency --preset tiny --lrs 1e-2,1e-3 --warmup 3 --repeats 40
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2psync import artifact  # noqa: E402
from p2psync.codec.decode import Applier  # noqa: E402
from p2psync.codec.encode import CodecOptions, encode_delta, release_buffers  # noqa: E402
from p2psync.state import ModelState  # noqa: E402
from p2psync.presets import build_model  # noqa: E402
from trainer.workload import Workload  # noqa: E402


def median_time(fn, repeats: int) -> float:
    return median_times(fn, repeats)[0]


def median_times(fn, repeats: int) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds (all threads) of ``fn``. On a shared
    machine the CPU figure is the robust one: another job's load stretches wall time, not CPU."""
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / median_time(lambda: np.copyto(dst, src), repeats) / 1e9


def zstd_full(state: ModelState) -> int:
    c = zstandard.ZstdCompressor(level=3)
    return sum(len(c.compress(state.words(n).tobytes())) for n in state)


def encode_gbps(prev: ModelState, cur: ModelState, threads: int, repeats: int, buckets: int = 4) -> tuple[float, float]:
    """(GB/s of model weights, GB per CPU-second) of encoding."""
    opts = CodecOptions(threads=threads, context_buckets=buckets)
    prev.tensor_sums()  # steady state: the publisher keeps the fingerprint of the last version
    wall, cpu = median_times(lambda: encode_delta(prev, cur, opts), repeats)
    return prev.nbytes / wall / 1e9, prev.nbytes / cpu / 1e9


def decode_gbps(prev: ModelState, enc, threads: int, repeats: int) -> tuple[float, float]:
    """(GB/s of model weights, GB per CPU-second) of verifying, decoding and applying."""
    m = artifact.build_manifest(enc, model_id="bench", base_version=0, target_version=1, chunk_size=4 << 20)
    walls, cpus = [], []
    for _ in range(repeats):
        # The last round's state (a model-sized copy) is freed here, not inside the timed region:
        # the applier held it, so rebinding ``ap`` below freed it there (up to ~12 ms of unmapping).
        ap = target = None
        target = prev.clone()
        target.tensor_sums()  # steady state: the receiver keeps the fingerprint of what it holds
        c0, t0 = time.process_time(), time.perf_counter()
        ap = Applier(target, kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                     target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)

        def verified():
            for i, c in enumerate(enc.chunks):
                artifact.verify_chunk(m, i, c)
                yield i, c

        ap.add_chunks(verified(), threads)
        ap.commit()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return prev.nbytes / statistics.median(walls) / 1e9, prev.nbytes / statistics.median(cpus) / 1e9


def encode_extra_memory(prev: ModelState, cur: ModelState) -> int:
    release_buffers()  # count the per-thread scan buffers, which encoding keeps between calls
    tracemalloc.start()
    encode_delta(prev, cur, CodecOptions(threads=2))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def latency_ms(args: argparse.Namespace, lr: float) -> dict:
    """Milliseconds per delta on one thread, for small models where the fixed cost per segment
    matters (the demo's tiny model: 24 tensors, ~97 % of words change at lr 1e-2). Medians and
    minima of ``--repeats`` runs, wall and thread CPU time; each decode starts from its own copy
    of the base, as a node's does."""
    model = build_model(args.preset, seed=0)
    work = Workload(model, lr=lr, batch=args.batch, seq=args.seq)
    for _ in range(args.warmup):
        work.step()
    prev = ModelState(work.published())
    work.step()
    cur = ModelState(work.published())
    opts = CodecOptions(threads=1)
    prev.tensor_sums()
    enc = encode_delta(prev, cur, opts)
    bases = [prev.clone() for _ in range(args.repeats + 3)]
    for b in bases:
        b.tensor_sums()

    def timed(fn) -> dict:
        walls, cpus = [], []
        for i in range(args.repeats + 3):
            c0, t0 = time.thread_time(), time.perf_counter()
            fn(i)
            if i >= 3:  # warm-up runs
                walls.append(1e3 * (time.perf_counter() - t0))
                cpus.append(1e3 * (time.thread_time() - c0))
        return {"wall_median_ms": statistics.median(walls), "cpu_median_ms": statistics.median(cpus),
                "cpu_min_ms": min(cpus)}

    def decode(i: int) -> None:
        ap = Applier(bases[i], kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                     target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)
        ap.add_chunks(enumerate(enc.chunks), 1)
        ap.commit()

    out = {"lr": lr, "changed_fraction": sum(enc.changed) / sum(s.numel for s in enc.specs),
           "payload_bytes": sum(map(len, enc.chunks)),
           "decode_apply": timed(decode), "encode": timed(lambda i: encode_delta(prev, cur, opts))}
    print(f"  lr {lr:g}: {out['changed_fraction']:.2%} changed; decode+apply {out['decode_apply']['cpu_median_ms']:.2f} ms "
          f"CPU median ({out['decode_apply']['cpu_min_ms']:.2f} min), encode {out['encode']['cpu_median_ms']:.2f} ms "
          f"({out['encode']['cpu_min_ms']:.2f} min)", flush=True)
    return out


def run_lr(args: argparse.Namespace, lr: float) -> dict:
    model = build_model(args.preset, seed=0)
    work = Workload(model, lr=lr, batch=args.batch, seq=args.seq)
    for _ in range(args.warmup):
        work.step()
    prev = ModelState(work.published())
    rows = []
    for k in range(args.measure):
        work.step()
        cur = ModelState(work.published())
        enc = encode_delta(prev, cur)
        fast = encode_delta(prev, cur, CodecOptions(context_buckets=1))
        changed = sum(enc.changed)
        numel = sum(s.numel for s in enc.specs)
        payload = sum(map(len, enc.chunks))
        row = {
            "step": args.warmup + k + 1,
            "changed_fraction": changed / numel,
            "payload_bytes": payload,
            "ratio": prev.nbytes / payload,
            "fast_payload_bytes": sum(map(len, fast.chunks)),
            "fast_ratio": prev.nbytes / sum(map(len, fast.chunks)),
            "coo_ratio": prev.nbytes / (changed * (4 + 2)),
            "position_bits_per_change": 8 * enc.stats.positions / max(1, changed),
            "residual_bits_per_change": 8 * enc.stats.residuals / max(1, changed),
        }
        if k == args.measure - 1:
            row["zstd_full_ratio"] = prev.nbytes / zstd_full(cur)
            for t in (1, 2):
                for key, (gbps, per_cpu) in (
                    ("encode", encode_gbps(prev, cur, t, args.repeats)),
                    ("decode_apply", decode_gbps(prev, enc, t, args.repeats)),
                    ("fast_encode", encode_gbps(prev, cur, t, args.repeats, buckets=1)),
                    ("fast_decode_apply", decode_gbps(prev, fast, t, args.repeats)),
                ):
                    row[f"{key}_gbps_{t}t"] = gbps
                    row[f"{key}_gb_per_cpu_s_{t}t"] = per_cpu
            row["encode_extra_memory_fraction"] = encode_extra_memory(prev, cur) / prev.nbytes
        rows.append(row)
        print(f"  lr {lr:g} step {row['step']}: {row['changed_fraction']:.4%} changed, ratio {row['ratio']:.1f}x",
              flush=True)
        prev = cur
    last = rows[-1]
    return {
        "lr": lr,
        "steps": rows,
        "mean_changed_fraction": statistics.mean(r["changed_fraction"] for r in rows),
        "mean_ratio": statistics.mean(r["ratio"] for r in rows),
        "mean_coo_ratio": statistics.mean(r["coo_ratio"] for r in rows),
        "mean_fast_ratio": statistics.mean(r["fast_ratio"] for r in rows),
        **{k: v for k, v in last.items() if k.endswith(("_1t", "_2t", "_fraction")) and k != "changed_fraction"
           or k == "zstd_full_ratio"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--measure", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--latency", action="store_true",
                    help="only milliseconds per delta on one thread (e.g. --preset tiny --lrs 1e-2,1e-3 --repeats 40)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.latency:
        results = {"command": " ".join([".venv/bin/python", "tools/bench_codec.py", *sys.argv[1:]]),
                   "preset": args.preset, "loadavg_start": os.getloadavg(),
                   "runs": [latency_ms(args, float(x)) for x in args.lrs.split(",")], "loadavg_end": os.getloadavg()}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    model_bytes = sum(p.numel() for p in build_model(args.preset).parameters()) * 2
    results = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
        "preset": args.preset,
        "model_bytes_bf16": model_bytes,
        "command": " ".join([".venv/bin/python", "tools/bench_codec.py", *sys.argv[1:]]),
        "loadavg_start": os.getloadavg(),
        "memcpy_gbps": memcpy_gbps(model_bytes, 5),
        "runs": [],
    }
    for lr in (float(x) for x in args.lrs.split(",")):
        results["runs"].append(run_lr(args, lr))
    results["memcpy_gbps_after"] = memcpy_gbps(model_bytes, 5)
    results["loadavg_end"] = os.getloadavg()
    mc = statistics.mean([results["memcpy_gbps"], results["memcpy_gbps_after"]])
    print(f"\nmemcpy {mc:.2f} GB/s (before {results['memcpy_gbps']:.2f}, after {results['memcpy_gbps_after']:.2f})")
    print("| lr | changed | p2psync ratio | COO int32+bf16 | zstd full bf16 | encode GB/s 1t / 2t (x memcpy) "
          "| decode+apply GB/s 1t / 2t (x memcpy) | extra memory encoding |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['lr']:g} | {100 * r['mean_changed_fraction']:.2f} % | {r['mean_ratio']:.0f}x | "
              f"{r['mean_coo_ratio']:.0f}x | {r['zstd_full_ratio']:.2f}x | "
              f"{r['encode_gbps_1t']:.2f} / {r['encode_gbps_2t']:.2f} ({r['encode_gbps_2t'] / mc:.2f}x) | "
              f"{r['decode_apply_gbps_1t']:.2f} / {r['decode_apply_gbps_2t']:.2f} "
              f"({r['decode_apply_gbps_2t'] / mc:.2f}x) | {100 * r['encode_extra_memory_fraction']:.1f} % |")
    print("\nFast mode (context_buckets=1):\n| lr | ratio | encode GB/s 1t / 2t (x memcpy) | decode+apply GB/s 1t / 2t (x memcpy) |")
    print("|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['lr']:g} | {r['mean_fast_ratio']:.0f}x | {r['fast_encode_gbps_1t']:.2f} / "
              f"{r['fast_encode_gbps_2t']:.2f} ({r['fast_encode_gbps_2t'] / mc:.2f}x) | "
              f"{r['fast_decode_apply_gbps_1t']:.2f} / {r['fast_decode_apply_gbps_2t']:.2f} "
              f"({r['fast_decode_apply_gbps_2t'] / mc:.2f}x) |")
    print("\nPer CPU-second (process CPU time of all threads; robust to other load on the machine):\n"
          "| lr | encode GB/CPU-s 1t / 2t | decode+apply GB/CPU-s 1t / 2t | fast encode 1t / 2t | fast decode+apply 1t / 2t |")
    print("|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['lr']:g} | {r['encode_gb_per_cpu_s_1t']:.2f} / {r['encode_gb_per_cpu_s_2t']:.2f} | "
              f"{r['decode_apply_gb_per_cpu_s_1t']:.2f} / {r['decode_apply_gb_per_cpu_s_2t']:.2f} | "
              f"{r['fast_encode_gb_per_cpu_s_1t']:.2f} / {r['fast_encode_gb_per_cpu_s_2t']:.2f} | "
              f"{r['fast_decode_apply_gb_per_cpu_s_1t']:.2f} / {r['fast_decode_apply_gb_per_cpu_s_2t']:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
