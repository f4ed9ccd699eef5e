"""Benchmark: the backend's update per changed element, tensors stored as the checkpoint is vs held as
strided blocks (experts repacked like vLLM's CPU MoE kernel: 16-row blocks stored column by column),
in one process, without vLLM.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_strided_apply.py --experts 64 --rows 512 --cols 1024

Two parameters of the same size: ``dense`` holds ``E`` checkpoint tensors ``[rows, cols]`` one after
the other (each the fast in-place path), ``experts`` holds the same tensors blocked (each a strided
block: its ranges copied out by the compiled gather, written by the mapped compiled pass). One delta changes ``--changed``
of the elements (random positions, small integer steps of the bf16 words, as an AdamW step does); it is
applied to each, the two alternating (decode + check, write + check, best of ``--repeats``), and the
results audited.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.state import ModelState
from rollout.engines.vllm.placement.boxes import compress
from rollout.engines.vllm.apply.weights import LiveWeights


def _blocked(rows: int, cols: int) -> np.ndarray:
    r, c = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
    return (r // 16) * 16 * cols + c * 16 + r % 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--changed", type=float, default=0.04)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    e, r, c = args.experts, args.rows, args.cols
    g = torch.Generator().manual_seed(0)
    old = ModelState([(f"x.{k}", (torch.randn(r, c, generator=g) * 0.02).to(torch.bfloat16)) for k in range(e)])
    new = old.clone()
    rng = np.random.default_rng(1)
    for n in new:
        w = new.words(n)
        idx = rng.choice(w.shape[0], size=int(w.shape[0] * args.changed), replace=False)
        w[idx] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=idx.shape[0])
    new.invalidate()
    opts = CodecOptions(chunk_size=4 << 20)
    enc = encode_delta(old, new, opts)
    m = build_manifest(enc, model_id="b", base_version=0, target_version=1, chunk_size=opts.chunk_size,
                       private_key=None)
    changed = sum(int(np.count_nonzero(old.words(n) != new.words(n))) for n in old)
    block, out = r * c, {"n_experts": e, "rows": r, "cols": c, "changed": changed, "threads": args.threads}
    lives = {}
    for kind in ("dense", "experts"):
        layout = np.arange(block, dtype=np.int64) if kind == "dense" else _blocked(r, c)
        words = np.empty(e * block, dtype=np.uint16)
        places = {}
        for k in range(e):
            dst = k * block + layout
            words[dst] = old.words(f"x.{k}")
            places[f"x.{k}"] = compress(f"x.{k}", "w", (r, c), np.arange(block, dtype=np.int64), dst)
        module = torch.nn.Module()
        module.register_parameter("w", torch.nn.Parameter(
            torch.from_numpy(words.view(np.int16)).view(torch.bfloat16), requires_grad=False))
        lives[kind] = (module, LiveWeights(module, old.specs, threads=args.threads, places=places))
    back = {i: [(np.flatnonzero(old.words(n) != new.words(n)), old.words(n)[old.words(n) != new.words(n)])]
            for i, n in enumerate(old)}
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):  # the two kinds alternate: both see the same load on a shared machine
        for kind, (_, live) in lives.items():
            live.apply_delta(m, enc.chunks)
            t = live.timing
            b = best.get(kind)
            if b is None or t["decode_s"] + t["commit_s"] < b["decode_s"] + b["commit_s"]:
                best[kind] = {"decode_s": t["decode_s"], "commit_s": t["commit_s"]}
            live.commit(back, old.fingerprint)  # back to version 0 through the same binding
    for kind, (_, live) in lives.items():
        assert live.audit() == old.fingerprint
        b = best[kind]
        b["ns_per_changed"] = round(1e9 * (b["decode_s"] + b["commit_s"]) / changed, 1)
        out[kind] = b
    out["experts_over_dense"] = round(out["experts"]["ns_per_changed"] / out["dense"]["ns_per_changed"], 3)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
