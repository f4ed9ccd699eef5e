"""What per-rank slices cost: one training step's delta encoded whole, cut where it pays, and cut at every split.

Workload: a Qwen3-shaped model from a transformers config (random init; default 45.4 M
parameters: vocab 32,000, hidden 512, MLP 1,024, 13 layers, 8 heads of 64, 2 KV heads, tied
embeddings), fp32 master weights, AdamW (betas 0.9/0.99, weight decay 0.01) on the synthetic
next-token task of ``trainer.workload``: ``--warmup`` steps, then the delta of one more step at
``--lr``, published as bf16 casts. The same two versions are encoded three ways with the
``p2psync delta encode`` defaults (4 MiB chunks, 2 threads, zstd 3):

- ``whole``: no tensor cut at row blocks (``slices.MIN_SLICED`` out of reach): the layout before
  per-rank slices, byte for byte;
- ``sliced``: the encoder's rule (a split is kept where each piece holds >= 32,768 changes);
- ``every``: every split over 2..8 ranks kept (``slices.MIN_PIECE_CHANGES = 0``).

Reported per layout: payload bytes and ratio to ``whole``, chunks, segments, the manifest's bytes
(its segment index grows with the segments), bytes per stream (segment headers; Rice-coded
positions; residual tables; rANS streams; escapes; chunk and segment framing), the largest share
of the payload one rank of 2, 4 and 8 fetches (rows ``[r/t, (r+1)/t)`` of every cut tensor, all
of every other: the chunks whose index entries meet those), the MB of base words the ranks of a
vLLM engine rebuild together per update (an all-reduce: row-parallel weights, and segments that
span more than one rank's rows), and encode / decode+apply medians.

    .venv/bin/python tools/bench_slices.py --json docs/benchmarks/slices.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2psync import artifact  # noqa: E402
from p2psync.codec import rans, slices  # noqa: E402
from p2psync.codec.decode import Applier, split_chunk  # noqa: E402
from p2psync.codec.encode import CodecOptions, encode_delta  # noqa: E402
from p2psync.codec.segment import parse_segment  # noqa: E402
from p2psync.codec.wire import Reader  # noqa: E402
from p2psync.state import ModelState  # noqa: E402
from trainer.workload import Workload  # noqa: E402

LAYOUTS = {"whole": ("MIN_SLICED", 1 << 62), "sliced": None, "every": ("MIN_PIECE_CHANGES", 0)}


def versions(args: argparse.Namespace) -> tuple[ModelState, ModelState]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    work = Workload(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), lr=args.lr)
    for _ in range(args.warmup):
        work.step()
    prev = ModelState(work.published())
    work.step()
    return prev, ModelState(work.published())


def streams(chunks: list[bytes]) -> dict[str, int]:
    """Bytes per part of the payload (module doc)."""
    out = dict(headers=0, positions=0, residual_tables=0, rans=0, escapes=0, framing=0, segments=0)
    for c in chunks:
        segs = split_chunk(c)
        out["framing"] += 8 + 4 * len(segs)
        out["segments"] += len(segs)
        for s in segs:
            p = parse_segment(memoryview(s))
            out["headers"] += p.stats.header
            out["positions"] += p.stats.positions
            r = Reader(p.res, "residuals")
            nm = rans.read_models(r).shape[0]
            r.take(2 * (nm - 1))
            out["residual_tables"] += r.pos
            n = r.u32()
            r.take(n)
            out["rans"] += 4 + n
            out["escapes"] += len(p.res) - r.pos
    return out


def fetch_shares(m: artifact.Manifest) -> dict[str, float]:
    """Per rank count ``t``: the largest share of the payload one of its ranks fetches."""
    out = {}
    for t in (2, 4, 8):
        worst = 0
        for r in range(t):
            need = 0
            for ref, entry in zip(m.chunks, m.segments):
                for k in range(0, len(entry), 3):
                    spec, s, e = m.tensors[entry[k]], entry[k + 1], entry[k + 2]
                    lo, hi = 0, spec.numel
                    if slices.sliced(spec) and spec.shape[0] % t == 0:
                        lo, hi = r * spec.numel // t, (r + 1) * spec.numel // t
                    if s < hi and e > lo:
                        need += ref.size
                        break
            worst = max(worst, need)
        out[f"tp{t}"] = worst / m.payload_bytes
    return out


ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
"""vLLM splits these along dimension 1: every rank holds part of every row."""


def gathered_mb(m: artifact.Manifest) -> dict[str, float]:
    """Per rank count ``t``: MB of base words the ranks rebuild together per update (one all-reduce,
    ``rollout.engines.vllm.apply.ranks.gather_ranges``): every segment of a row-parallel weight, and
    every segment of a row-split tensor that spans more than one rank's rows."""
    out = {}
    for t in (2, 4, 8):
        total = 0
        for entry in m.segments:
            for k in range(0, len(entry), 3):
                spec, s, e = m.tensors[entry[k]], entry[k + 1], entry[k + 2]
                if len(spec.shape) < 2 or spec.shape[0] % t:
                    continue  # held whole by every rank here
                block = spec.numel // t
                if spec.name.endswith(ROW_PARALLEL) or s // block != (e - 1) // block:
                    total += (e - s) * 2
        out[f"tp{t}"] = total / 1e6
    return out


def encode_with(layout: str, prev: ModelState, cur: ModelState, opts: CodecOptions, repeats: int) -> dict:
    patch = LAYOUTS[layout]
    keep = getattr(slices, patch[0]) if patch else None
    if patch:
        setattr(slices, patch[0], patch[1])
    try:
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            enc = encode_delta(prev, cur, opts)
            walls.append(time.perf_counter() - t0)
    finally:
        if patch:
            setattr(slices, patch[0], keep)
    m = artifact.build_manifest(enc, model_id="bench", base_version=0, target_version=1, chunk_size=opts.chunk_size)
    dec = []
    for _ in range(repeats):
        target = prev.clone()
        target.tensor_sums()
        t0 = time.perf_counter()
        ap = Applier.for_manifest(target, m)
        ap.add_chunks(enumerate(enc.chunks), opts.threads)
        ap.commit()
        dec.append(time.perf_counter() - t0)
        assert target.fingerprint == cur.fingerprint
    return {"payload_bytes": m.payload_bytes, "chunks": len(enc.chunks), "manifest_bytes": len(m.to_bytes()),
            "ratio_to_full": m.model_bytes / m.payload_bytes, **streams(enc.chunks),
            "max_rank_fetch_share": fetch_shares(m), "gathered_mb": gathered_mb(m), "encode_s": statistics.median(walls),
            "decode_apply_s": statistics.median(dec)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    load0 = os.getloadavg()
    prev, cur = versions(args)
    changed = sum(int(np.count_nonzero(prev.words(n) != cur.words(n))) for n in prev)
    numel = sum(s.numel for s in prev.specs)
    opts = CodecOptions()
    encode_delta(prev, cur, opts)  # kernels loaded, buffers kept
    res = {"command": " ".join([".venv/bin/python", "tools/bench_slices.py", *sys.argv[1:]]),
           "elements": numel, "changed": changed, "changed_fraction": changed / numel, "loadavg_start": load0,
           "layouts": {k: encode_with(k, prev, cur, opts, args.repeats) for k in LAYOUTS}}
    res["loadavg_end"] = os.getloadavg()
    whole = res["layouts"]["whole"]
    print(f"{numel:,} elements, {changed:,} changed ({100 * changed / numel:.2f} %), load {load0[0]:.1f}")
    print("| layout | payload | vs whole | wire (+ manifest) vs whole | chunks | segments | headers | tables "
          "| rANS | max rank share tp2 / tp4 / tp8 | gathered MB tp2 / tp8 | encode ms | decode+apply ms |")
    for k, r in res["layouts"].items():
        wire = (r["payload_bytes"] + r["manifest_bytes"]) / (whole["payload_bytes"] + whole["manifest_bytes"])
        sh = r["max_rank_fetch_share"]
        print(f"| {k} | {r['payload_bytes']:,} | {r['payload_bytes'] / whole['payload_bytes']:.4f} | {wire:.4f} | "
              f"{r['chunks']} | {r['segments']} | {r['headers']:,} | {r['residual_tables']:,} | {r['rans']:,} | "
              f"{sh['tp2']:.2f} / {sh['tp4']:.2f} / {sh['tp8']:.2f} | {r['gathered_mb']['tp2']:.1f} / "
              f"{r['gathered_mb']['tp8']:.1f} | {1e3 * r['encode_s']:.0f} | "
              f"{1e3 * r['decode_apply_s']:.0f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
