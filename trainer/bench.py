"""Trainer-side measurements (results in docs/TRAINER.md).

``python -m trainer.bench publish --preset small --lr 1e-5 --steps 8 [--guard]``: training
step time with and without the publisher attached (AdamW on the synthetic workload,
an in-process trainer node), with per-version extract/encode/publish times and
payload vs full bytes.

``python -m trainer.bench grpo --steps 40``: a GRPO run with in-process
rollouts from the node's published weights; prints the reward of the first and
last three steps and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path


async def _node(root: Path):
    from p2psync import config, keys
    from p2psync.node import Node

    from p2psync.certs import Authority

    keys.write_pair(keys.generate(), root / "keys")
    Authority(root / "keys").node("trainer", "default", root / "t" / "tls")  # mutual TLS, as in production
    cfg = config.load(overrides={"id": "trainer", "role": "trainer", "data_dir": str(root / "t"),
                                 "cluster_token": "bench-token-0123",
                                 "trainer_public_key": str(root / "keys/trainer.pub"),
                                 "trainer_private_key": str(root / "keys/trainer.key"),
                                 "store": {"snapshot_interval": 0}})
    return await Node.create(cfg)


async def bench_publish(args: argparse.Namespace) -> dict:
    from trainer.publisher import Publisher
    from p2psync.presets import build_model
    from trainer.workload import Workload

    with tempfile.TemporaryDirectory() as d:
        node = await _node(Path(d))
        try:
            w = Workload(build_model(args.preset, seed=0), lr=args.lr, batch=args.batch, seq=args.seq)
            for _ in range(args.warmup):
                await asyncio.to_thread(w.step)
            plain = []
            for _ in range(args.steps):
                t = time.perf_counter()
                await asyncio.to_thread(w.step)
                plain.append(time.perf_counter() - t)
            pub = await Publisher.create(w.model, node, threads=args.threads,
                                         optimizer=w.opt if args.guard else None)
            synced = []
            for _ in range(args.steps):
                t = time.perf_counter()
                await asyncio.to_thread(w.step)
                await pub.publish()
                synced.append(time.perf_counter() - t)
            t = time.perf_counter()
            await pub.close()
            drain = time.perf_counter() - t
            recs = [r.to_json() for r in pub.records[1:]]
        finally:
            await node.close()
    med = statistics.median
    return {"preset": args.preset, "lr": args.lr, "steps": args.steps, "optimizer_guard": args.guard,
            "step_s_without_publisher": med(plain), "step_s_with_publisher": med(synced),
            "ratio": med(synced) / med(plain), "drain_after_last_s": drain,
            "extract_s": med(r["extract_s"] for r in recs), "encode_s": med(r["encode_s"] for r in recs),
            "publish_s": med(r["publish_s"] for r in recs),
            "changed_fraction": med(r["changed_fraction"] for r in recs),
            "payload_bytes": med(r["payload_bytes"] for r in recs), "full_bytes": recs[0]["full_bytes"]}


async def bench_grpo(args: argparse.Namespace) -> dict:
    from trainer.grpo import GRPOOptions, GRPORun

    opts = {"steps": args.steps, "rollouts": "local", "threads": args.threads, "task": args.task,
            "preset": args.preset, "lr": args.lr, "seed": args.seed}
    with tempfile.TemporaryDirectory() as d:
        node = await _node(Path(d))
        t0 = time.perf_counter()
        job = await GRPORun.create(node, GRPOOptions.from_dict(opts))
        try:
            await job.train()
        finally:
            await job.close()
            await node.close()
        wall = time.perf_counter() - t0
    rows = sorted(job.history, key=lambda r: r["step"])
    rew = [r["reward_mean"] for r in rows]
    acc = [r["accuracy"] for r in rows]
    return {"options": opts, "reward_first3": sum(rew[:3]) / 3, "reward_last3": sum(rew[-3:]) / 3,
            "accuracy_first3": sum(acc[:3]) / 3, "accuracy_last3": sum(acc[-3:]) / 3, "wall_s": wall,
            "median_step_s": statistics.median(r["step_s"] for r in rows),
            "median_changed_fraction": statistics.median(r["changed_fraction"] for r in rows),
            "median_payload_bytes": statistics.median(r["payload_bytes"] for r in rows),
            "full_bytes": rows[0]["full_bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("publish")
    a.add_argument("--preset", default="small")
    a.add_argument("--lr", type=float, default=1e-5)
    a.add_argument("--steps", type=int, default=8)
    a.add_argument("--warmup", type=int, default=3)
    a.add_argument("--batch", type=int, default=4)
    a.add_argument("--seq", type=int, default=64)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--guard", action="store_true", help="extract beside the next forward/backward (optimizer=)")
    g = sub.add_parser("grpo")
    g.add_argument("--preset", default="tiny")
    g.add_argument("--task", default="add_small")
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument("--steps", type=int, default=40)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    fn = bench_publish if args.what == "publish" else bench_grpo
    print(json.dumps(asyncio.run(fn(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
