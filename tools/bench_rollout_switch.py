"""Benchmark: weight switch on a rollout engine vs. the time of a rollout batch.

    .venv/bin/python tools/bench_rollout_switch.py --preset small --lr 1e-5 --steps 3 --batch 8 --tokens 64

Trains the preset with AdamW (fp32 master weights, bf16 published) for
``--steps`` steps, encodes each step as a real delta, and on the transformers
engine measures per version: ``prepare_s`` (decode against the current
weights; the worker runs it beside generation), ``commit_s`` (fingerprint check
and writes in place: the only pause generation sees), ``audit_s`` (fingerprint
recomputed from every weight; beside generation too), and the time of one
rollout batch (``--batch`` responses of ``--tokens`` tokens). Target: the
switch <= 5 % of a batch. Prints one JSON line per version and a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from p2psync.artifact import build_manifest
    from p2psync.codec.encode import CodecOptions, encode_delta
    from p2psync.state import ModelState
    from rollout.engines import build_engine
    from rollout.engines.base import EngineConfig, SeqRequest
    from p2psync.presets import build_model
    from trainer.workload import Workload

    torch.set_num_threads(args.threads)
    model = build_model(args.preset)
    w = Workload(model, lr=args.lr)
    prev = ModelState(w.published())
    eng = build_engine(EngineConfig(preset=args.preset, threads=args.threads))
    eng.load(prev, 0)
    opts = CodecOptions(chunk_size=1 << 20, threads=args.threads)
    reqs = [SeqRequest(list(range(1 + i, 1 + i + args.prompt)), args.tokens, temperature=1.0, seed=i)
            for i in range(args.batch)]
    eng.generate(reqs[:1])  # warm-up (first-call allocations)
    rows = []
    for v in range(1, args.steps + 1):
        w.step()
        new = ModelState(w.published())
        enc = encode_delta(prev, new, opts)
        m = build_manifest(enc, model_id=args.preset, base_version=v - 1, target_version=v,
                           chunk_size=opts.chunk_size)
        t0 = time.perf_counter()
        prepared = eng.prepare(m, enc.chunks, args.threads)  # the worker runs this beside generation
        tp = time.perf_counter()
        eng.commit(prepared)  # the only part that pauses generation (at a safe point)
        t1 = time.perf_counter()
        fp = eng.audit(args.threads)
        t2 = time.perf_counter()
        assert fp == new.fingerprint, "engine diverged"
        seqs = eng.generate(reqs)
        t3 = time.perf_counter()
        changed = sum(m.changed) / sum(s.numel for s in new.specs)
        row = {"version": v, "changed": round(changed, 5), "payload_bytes": m.payload_bytes,
               "prepare_s": round(tp - t0, 4), "commit_s": round(t1 - tp, 4), "audit_s": round(t2 - t1, 4),
               "batch_s": round(t3 - t2, 4), "tokens": sum(len(s.tokens) for s in seqs)}
        # The pause generation sees (commit), and the whole switch done serially (prepare+commit+audit).
        row["stall_over_batch"] = round(row["commit_s"] / row["batch_s"], 4)
        row["serial_over_batch"] = round((row["prepare_s"] + row["commit_s"] + row["audit_s"]) / row["batch_s"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        prev = new
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("prepare_s", "commit_s", "audit_s", "batch_s", "stall_over_batch", "serial_over_batch")}
    print(json.dumps({"summary": True, "preset": args.preset, "lr": args.lr, "batch": args.batch,
                      "tokens": args.tokens, "threads": args.threads, "params": sum(s.numel for s in prev.specs),
                      **{f"median_{k}": v for k, v in med.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
