"""What a version's housekeeping costs the next version: signed snapshot and checkpoint.

Every ``store.snapshot_interval`` versions the trainer node encodes, signs and writes a raw
snapshot of every weight (for joiners), and every ``store.checkpoint_interval`` versions every
node checkpoints its weights: each is an encode and a write of the whole model (tens of seconds
for 16 GB). This benchmark publishes a chain of sparse deltas (about 1 % of the bf16 words
changed per version, as at an RL learning rate) through an in-process trainer node to a relay
node (loopback HTTP), with ``--gap`` seconds between publishes (the training
step), and on to a rollout node below the relay, and reports per version:

- ``publish_s``: how long ``await node.publish(...)`` took, what a trainer that waits for each
  announcement (the GRPO loop at k <= 1) stalls for;
- ``relay_s`` / ``leaf_s``: publish called -> the relay / the rollout node holding that version
  (its dissemination time; the rollout node is what serves generation).

and at the end how many signed snapshots the relay rebuilt and which it holds (a late joiner's
cheapest start; retention keeps the newest).

Versions right after a housekeeping version show whether that housekeeping delayed them. Run it
in two trees to compare (cwd = the tree)::

    .venv/bin/python tools/bench_housekeeping.py --mb 320 --versions 8 --interval 3 --gap 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOKEN = "bench-housekeeping-token"


def _states(mb: int, versions: int, seed: int):
    import torch

    from p2psync.state import ModelState

    g = torch.Generator().manual_seed(seed)
    per = (mb << 20) // 2 // 8
    w = {f"layer{i}.weight": (torch.randn(per, generator=g) * 0.02).bfloat16() for i in range(8)}
    out = [ModelState({k: v.clone() for k, v in w.items()})]
    for _ in range(versions):
        for t in w.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)
            flat[idx] = (flat[idx].float() * 1.01).bfloat16()
        out.append(ModelState({k: v.clone() for k, v in w.items()}))
    return out


async def run(args: argparse.Namespace) -> list[dict]:
    from p2psync import config, keys
    from p2psync.artifact import build_manifest
    from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
    from p2psync.node import Node

    tmp = Path(tempfile.mkdtemp(prefix="bench-hk-", dir=args.dir))
    priv = keys.generate()
    keys.write_pair(priv, tmp / "keys")
    states = _states(args.mb, args.versions, args.seed)
    opts = CodecOptions(chunk_size=4 << 20, threads=2)
    enc = encode_snapshot(states[0], opts)
    arts = [(build_manifest(enc, model_id="m", target_version=0, chunk_size=4 << 20, private_key=priv), enc.chunks)]
    for v in range(1, len(states)):
        enc = encode_delta(states[v - 1], states[v], opts)
        arts.append((build_manifest(enc, model_id="m", target_version=v, base_version=v - 1,
                                    chunk_size=4 << 20, private_key=priv), enc.chunks))
    del states
    store = {"snapshot_interval": args.interval, "checkpoint_interval": args.interval}
    common = {"cluster_token": TOKEN, "trainer_public_key": str(tmp / "keys" / "trainer.pub"), "store": store}
    from p2psync.certs import Authority

    ca = Authority(tmp / "keys")  # mutual TLS, as in production: each node's certificate in <data_dir>/tls
    for name, sub in (("trainer", "t"), ("relay", "r"), ("rollout", "l")):
        ca.node(name, "default", tmp / sub / "tls")
    tr = await Node.create(config.load(overrides={
        **common, "id": "trainer", "role": "trainer", "data_dir": str(tmp / "t"),
        "trainer_private_key": str(tmp / "keys" / "trainer.key")}))
    fol = await Node.create(config.load(overrides={
        **common, "id": "relay", "role": "relay", "data_dir": str(tmp / "r"), "parents": [tr.address]}))
    leaf = await Node.create(config.load(overrides={
        **common, "id": "rollout", "role": "rollout", "data_dir": str(tmp / "l"), "parents": [fol.address]}))
    rows = []
    try:
        await tr.publish(*arts[0])
        await asyncio.wait_for(leaf.wait_version(0), 120)
        for v in range(1, len(arts)):
            await asyncio.sleep(args.gap)
            done: dict[str, float] = {}

            async def held(name: str, node: Node, v: int = v, done: dict[str, float] = done) -> None:
                await asyncio.wait_for(node.wait_version(v), 300)
                done[name] = time.perf_counter()
            waiters = [asyncio.create_task(held("relay", fol)), asyncio.create_task(held("leaf", leaf))]
            t0 = time.perf_counter()
            await tr.publish(*arts[v])
            t1 = time.perf_counter()
            await asyncio.gather(*waiters)
            row = {"version": v, "housekeeping": v % args.interval == 0, "after_housekeeping": (v - 1) % args.interval == 0
                   and v > 1, "publish_s": round(t1 - t0, 4), "relay_s": round(done["relay"] - t0, 4),
                   "leaf_s": round(done["leaf"] - t0, 4),
                   "payload_bytes": arts[v][0].payload_bytes}
            rows.append(row)
            print(json.dumps(row), flush=True)
        await fol.settle()
        rebuilt = sorted(a.manifest.target_version for a in fol.store.artifacts.values()
                         if a.manifest.kind == "snapshot" and a.complete and a.manifest.target_version > 0)
        rows.append({"relay_rebuilt_snapshots": rebuilt,
                     "relay_materialised": int(fol.metrics.total("p2psync_snapshots_materialised_total"))})
        print(json.dumps(rows[-1]), flush=True)
    finally:
        await leaf.close()
        await fol.close()
        await tr.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=320, help="model size in MB of bf16 weights")
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--interval", type=int, default=3, help="snapshot and checkpoint interval (versions)")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between publishes (the training step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the nodes' stores go (default: the system temp dir)")
    ap.add_argument("--json", default=None, help="append the rows here")
    args = ap.parse_args()
    rows = asyncio.run(run(args))
    end = rows.pop()

    def med(key: str, pred) -> float | None:
        xs = [r[key] for r in rows if pred(r)]
        return round(statistics.median(xs), 3) if xs else None

    summary = {k: {"housekeeping": med(k, lambda r: r["housekeeping"]),
                   "after": med(k, lambda r: r["after_housekeeping"]),
                   "other": med(k, lambda r: not r["housekeeping"] and not r["after_housekeeping"])}
               for k in ("publish_s", "relay_s", "leaf_s")}
    print(json.dumps({"summary": summary, **end, "mb": args.mb,
                      "interval": args.interval, "gap": args.gap}))
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps({**r, "mb": args.mb, "gap": args.gap}) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
