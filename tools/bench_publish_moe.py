"""Publishing a mixture-of-experts model: time and memory of the trainer's publisher.

    python tools/bench_publish_moe.py [--experts 64] [--layers 4] [--steps 4] [--lr 1e-5]

A random-init Qwen3-MoE (fp32 master weights, experts fused in memory as transformers holds
them), AdamW steps on the synthetic workload, an in-process trainer node. Prints one JSON
object: the table (tensors, and how many are views of a fused parameter), version 0's time,
the per-version extract/encode/publish medians, and the process's resident memory before the
publisher, after version 0 and after the last version, next to the size of the publisher's CPU
copy (the published version in bf16, which it keeps by design): anything above that copy is
extra memory. Uses only the Publisher API, so it runs against any version of the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from p2psync import config, keys
    from p2psync.node import Node
    from trainer.publisher import Publisher
    from trainer.workload import Workload

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=4096, hidden_size=args.hidden, intermediate_size=1024,
                               moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
                               num_experts_per_tok=4, num_hidden_layers=args.layers, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                               tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    w = Workload(model, lr=args.lr, batch=2, seq=64)
    w.step()  # AdamW's state exists before the publisher is measured
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        keys.write_pair(keys.generate(), root / "keys")
        node = await Node.create(config.load(overrides={
            "id": "trainer", "role": "trainer", "data_dir": str(root / "t"), "cluster_token": "bench-token-0123",
            "trainer_public_key": str(root / "keys/trainer.pub"), "trainer_private_key": str(root / "keys/trainer.key"),
            "store": {"snapshot_interval": 0}}))
        try:
            rss0 = _rss_mib()
            t = time.perf_counter()
            pub = await Publisher.create(model, node, threads=args.threads)
            v0_s = time.perf_counter() - t
            rss1 = _rss_mib()
            for _ in range(args.steps):
                await asyncio.to_thread(w.step)
                await pub.publish()
            await pub.close()
            rss2 = _rss_mib()
            specs = list(pub._specs)
            copy_mib = sum(s.nbytes for s in specs) / 2**20
            views = sum(1 for p in pub._pieces if p.numel != p.source.numel())
            recs = [r.to_json() for r in pub.records[1:]]
        finally:
            await node.close()
    med = statistics.median
    return {"experts": args.experts, "layers": args.layers, "parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(specs), "expert_views": views, "version0_s": round(v0_s, 3),
            "extract_s": med(r["extract_s"] for r in recs), "encode_s": med(r["encode_s"] for r in recs),
            "publish_s": med(r["publish_s"] for r in recs), "changed_fraction": med(r["changed_fraction"] for r in recs),
            "rss_before_mib": round(rss0), "rss_after_v0_mib": round(rss1), "rss_after_last_mib": round(rss2),
            "cpu_copy_mib": round(copy_mib), "extra_after_v0_mib": round(rss1 - rss0 - copy_mib),
            "load_average": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
