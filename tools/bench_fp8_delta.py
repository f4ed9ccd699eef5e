"""Benchmark: p2psync deltas of FP8 rollout weights, against the bf16 delta of the same step.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_fp8_delta.py --json docs/benchmarks/fp8_delta.json

Workloads (``--workloads``, default ``533m,moe``): the 533 M dense Qwen3 of the vLLM benchmarks
(24 layers, hidden 1024, vocabulary 151,936, tied embeddings) and the 248 M Qwen3-MoE (4 layers of
64 experts of MLP 256, hidden 1024, vocabulary 32,768), under their checkpoint names
(``tools/vllm_workload.checkpoint_shapes``); ``quick``: 4 dense layers, hidden 256, for trying the
tool. Each tensor has fp32 master weights (normal(0, 0.02); norms 1) and its own AdamW (lr
``--lr``, default 1e-6) fed a normal gradient per step, as the 533 M workload of the codec and
trainer benchmarks: ``--steps`` versions after version 0.

Each version is published three ways: bf16 (what p2psync ships today), and an FP8 checkpoint of
that bf16 version laid out as vLLM's FP8 checkpoints are (:mod:`trainer.fp8`): blockwise
(``float8_e4m3fn`` words, float32 ``weight_scale_inv`` per 128x128 block) and per tensor
(float32 ``weight_scale`` per checkpoint tensor), embeddings, norms and router gates kept in bf16.
Per step and layout: elements changed (FP8 words, scales, bf16-kept tensors), payload bytes (and
each part's share, from the segments' tensor indices), the full checkpoint over the payload, the
payload over the bf16 delta of the same step (and the FP8 part alone, words and scales, over its
own bytes and over the bf16 delta of the same linear weights), how many changed FP8 words lie in blocks whose scale
changed, the FP8 quantization time of a version, and encode / decode+apply speed (median of
``--repeats``, 2 threads; GB/s of that layout's full weights, wall and per CPU-second: the
decode verifies every chunk against a signed manifest and checks the target fingerprint).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_codec import decode_gbps, encode_gbps  # noqa: E402
from benchout import loadavg  # noqa: E402
from vllm_workload import checkpoint_shapes  # noqa: E402

from p2psync.codec.decode import split_chunk, warm_up  # noqa: E402
from p2psync.codec.encode import CodecOptions, encode_delta  # noqa: E402
from p2psync.codec.segindex import chunk_entries  # noqa: E402
from p2psync.state import ModelState  # noqa: E402
from trainer.fp8 import fp8_checkpoint, is_fp8_linear  # noqa: E402

WORKLOADS = {
    "533m": dict(model="dense", layers=24, hidden=1024, mlp=3072, heads=16, kv_heads=8, vocab=151936),
    "moe": dict(model="moe", layers=4, hidden=1024, mlp=3072, heads=8, kv_heads=4, vocab=32768, experts=64,
                moe_mlp=256),
    "quick": dict(model="dense", layers=4, hidden=256, mlp=768, heads=2, kv_heads=1, vocab=32768),
}
LAYOUTS = ("bf16", "block", "tensor")


def versions(shapes: list[tuple[str, tuple[int, ...]]], steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """bf16 versions 0..``steps``: each tensor's fp32 master and AdamW stepped alone (AdamW's
    per-element rule does not couple tensors), so only one tensor's optimizer state is alive."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(steps + 1)]
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes:
        master = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        p = torch.nn.Parameter(master)
        opt = torch.optim.AdamW([p], lr=lr)
        out[0][name] = p.detach().to(torch.bfloat16)
        for s in range(1, steps + 1):
            p.grad = torch.randn(shape, generator=g)
            opt.step()
            out[s][name] = p.detach().to(torch.bfloat16)
        del p, opt, master
    return out


def part(name: str, dtype: str, shape: tuple[int, ...], layout: str) -> str:
    """Which part of a layout a tensor is: ``words`` (FP8 or, in bf16, the linear weights FP8 would
    quantize), ``scales``, or ``kept`` (embeddings, norms, router gates: bf16 in every layout)."""
    if dtype == "F8_E4M3":
        return "words"
    if name.endswith(("_scale_inv", "_scale")) and dtype == "F32":
        return "scales"
    if layout == "bf16":
        return "words" if is_fp8_linear(name, shape) else "kept"
    return "kept"


def rescaled_changes(prev: ModelState, cur: ModelState, layout: str) -> int:
    """Changed FP8 words that lie in a block (or tensor) whose scale changed too."""
    n = 0
    for spec in cur.specs:
        if spec.dtype != "F8_E4M3":
            continue
        sname = spec.name + ("_scale_inv" if layout == "block" else "_scale")
        moved = prev.words(sname) != cur.words(sname)
        if not moved.any():
            continue
        changed = (prev.words(spec.name) != cur.words(spec.name)).reshape(spec.shape)
        if layout == "tensor":
            n += int(changed.sum())
            continue
        rows, cols = spec.shape
        gr, gc = moved.reshape(-(-rows // 128), -(-cols // 128)).nonzero()
        n += sum(int(changed[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].sum()) for i, j in zip(gr, gc))
    return n


def measure_step(prev: ModelState, cur: ModelState, layout: str, repeats: int) -> dict:
    """One layout's delta from ``prev`` to ``cur``: changes and payload by part, and speed."""
    opts = CodecOptions(threads=2)
    enc = encode_delta(prev, cur, opts)
    parts = {s.name: part(s.name, s.dtype, s.shape, layout) for s in prev.specs}
    numel = {"words": 0, "scales": 0, "kept": 0}
    nbytes = dict(numel)
    changed = dict(numel)
    payload = dict(numel)
    width = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    for i, s in enumerate(prev.specs):
        p = parts[s.name]
        numel[p] += s.numel
        nbytes[p] += s.numel * width[s.dtype]
        changed[p] += enc.changed[i]
    for c in enc.chunks:
        entries = chunk_entries(c)
        for k, seg in enumerate(split_chunk(c)):
            payload[parts[prev.specs[entries[3 * k]].name]] += 4 + len(seg)
    total = sum(map(len, enc.chunks))
    full = sum(nbytes.values())
    enc_gbps, enc_cpu = encode_gbps(prev, cur, 2, repeats)
    dec_gbps, dec_cpu = decode_gbps(prev, enc, 2, repeats)
    row = {
        "layout": layout, "full_bytes": full, "payload_bytes": total, "full_over_payload": full / total,
        "changed": changed, "elements": numel, "changed_pct": {k: 100 * changed[k] / numel[k] if numel[k] else None
                                                                for k in numel},
        "part_bytes": nbytes, "part_payload_bytes": payload,
        "encode_gbps": enc_gbps, "encode_gb_per_cpu_s": enc_cpu, "decode_apply_gbps": dec_gbps,
        "decode_apply_gb_per_cpu_s": dec_cpu,
    }
    if layout != "bf16":
        row["fp8_changes_in_rescaled_blocks"] = rescaled_changes(prev, cur, layout)
    return row


def run_workload(key: str, args: argparse.Namespace) -> dict:
    shape_args = SimpleNamespace(**WORKLOADS[key])
    shapes = checkpoint_shapes(shape_args)
    load = loadavg()
    t0 = time.perf_counter()
    vs = versions(shapes, args.steps, args.lr)
    build_s = time.perf_counter() - t0
    params = sum(int(np.prod(s)) for _, s in shapes)
    kept = sorted({n.split(".")[-2] for n, s in shapes if not is_fp8_linear(n, s)})
    print(f"{key}: {params / 1e6:.0f} M parameters, {args.steps} steps built in {build_s:.0f} s; bf16 kept: "
          f"{', '.join(kept)}", flush=True)
    quant_s: dict[str, list[float]] = {"block": [], "tensor": []}
    quant_cpu_s: dict[str, list[float]] = {"block": [], "tensor": []}

    def state(layout: str, v: dict[str, torch.Tensor]) -> ModelState:
        if layout == "bf16":
            return ModelState(v)
        c, t = time.process_time(), time.perf_counter()
        table = fp8_checkpoint(v, layout)
        quant_s[layout].append(time.perf_counter() - t)
        quant_cpu_s[layout].append(time.process_time() - c)
        return ModelState(table)

    steps = []
    prev = {layout: state(layout, vs[0]) for layout in LAYOUTS}
    for s in range(1, args.steps + 1):
        cur = {layout: state(layout, vs[s]) for layout in LAYOUTS}
        rows = {layout: measure_step(prev[layout], cur[layout], layout, args.repeats) for layout in LAYOUTS}
        bf16_payload = rows["bf16"]["payload_bytes"]
        for layout in ("block", "tensor"):
            r = rows[layout]
            r["payload_over_bf16_delta"] = r["payload_bytes"] / bf16_payload
            # The FP8 part alone (words + scales): against its own bytes, and against the bf16 delta of
            # the same linear weights.
            fp8_pay = r["part_payload_bytes"]["words"] + r["part_payload_bytes"]["scales"]
            r["fp8_part_over_payload"] = (r["part_bytes"]["words"] + r["part_bytes"]["scales"]) / fp8_pay
            r["fp8_part_over_bf16_linear_delta"] = fp8_pay / rows["bf16"]["part_payload_bytes"]["words"]
        steps.append({"step": s, **rows})
        b, blk, ten = rows["bf16"], rows["block"], rows["tensor"]
        print(f"  step {s}: bf16 {b['changed_pct']['words']:.2f} % of linear words, {b['payload_bytes'] / 1e6:.2f} MB; "
              f"block {blk['changed_pct']['words']:.2f} % words / {blk['changed_pct']['scales']:.2f} % scales, "
              f"{blk['payload_bytes'] / 1e6:.2f} MB ({blk['payload_over_bf16_delta']:.2f}x bf16); "
              f"tensor {ten['changed_pct']['words']:.2f} % / {ten['changed_pct']['scales']:.2f} %, "
              f"{ten['payload_bytes'] / 1e6:.2f} MB ({ten['payload_over_bf16_delta']:.2f}x)", flush=True)
        prev = cur
        vs[s - 1] = {}
    return {"workload": key, "shape": WORKLOADS[key], "parameters": params, "kept_bf16": kept,
            "build_s": build_s, "quantize_s": {k: statistics.median(v) for k, v in quant_s.items()},
            "quantize_cpu_s": {k: statistics.median(v) for k, v in quant_cpu_s.items()},
            "loadavg_start": load, "loadavg_end": loadavg(), "steps": steps}


def table(res: dict) -> str:
    lines = ["| workload, step | layout | changed %: words / scales / kept | payload MB: all (words / scales / kept) "
             "| full / payload | / bf16 delta | encode GB/s | decode+apply GB/s |", "|---|---|---|---|---|---|---|---|"]
    for w in res["workloads"]:
        for st in w["steps"]:
            for layout in LAYOUTS:
                r = st[layout]
                pct, pp = r["changed_pct"], r["part_payload_bytes"]
                sc = "-" if pct["scales"] is None else f"{pct['scales']:.2f}"
                lines.append(f"| {w['workload']} {st['step']} | {layout} | {pct['words']:.2f} / {sc} / {pct['kept']:.2f} | "
                             f"{r['payload_bytes'] / 1e6:.2f} ({pp['words'] / 1e6:.2f} / {pp['scales'] / 1e6:.3f} / "
                             f"{pp['kept'] / 1e6:.2f}) | {r['full_over_payload']:.0f}x | "
                             f"{r.get('payload_over_bf16_delta', 1.0):.2f} | {r['encode_gbps']:.2f} | "
                             f"{r['decode_apply_gbps']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="533m,moe", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=3, help="measured versions after version 0")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=3, help="timed encodes and decodes per step (median)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    keys = args.workloads.split(",")
    bad = [k for k in keys if k not in WORKLOADS]
    if bad or args.steps < 1 or args.repeats < 1:
        ap.error(f"--workloads must name {', '.join(WORKLOADS)} (got {', '.join(bad)}); --steps, --repeats >= 1")
    torch.set_num_threads(2)
    warm_up(("BF16", "F32", "F8_E4M3"))  # numba's cached kernels load here, not in the first timed step
    res: dict = {"command": " ".join(["PYTHONPATH=$PWD .venv/bin/python", "tools/bench_fp8_delta.py", *sys.argv[1:]]),
                 "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
                 "date": datetime.date.today().isoformat(), "lr": args.lr, "loadavg_start": loadavg(),
                 "workloads": []}
    for k in keys:
        res["workloads"].append(run_workload(k, args))
    res["loadavg_end"] = loadavg()
    print(table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
