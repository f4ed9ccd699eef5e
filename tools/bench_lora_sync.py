"""Benchmark: a LoRA adapter version from the trainer's ``publish()`` to a vLLM engine serving it.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_lora_sync.py --json out.json

A random-init Qwen3 (``--hidden``, ``--layers``; head_dim 64) served by vLLM (CPU build,
``enable_lora=True``); an adapter of rank ``--rank`` on every linear module (PEFT init: ``lora_A``
random, ``lora_B`` zero) trained by Adam-like steps (every element moves by ``--lr``: what an
adapter step does). Per version: ``AdapterPublisher.publish`` on a trainer node, a rollout node
following it on loopback, :func:`rollout.engines.vllm.lora.follow` loading it into the engine's
LoRA slots. Reports per version the payload against the adapter's raw bf16 bytes, the seconds
from ``publish()`` to the version being servable (``request()`` gives it), the part of it the
engine load took, and the target: ``1.2 x link time + 50 ms``, the link time being the payload
over loopback TCP's rate measured in the same run (a 64 MiB socket copy, median of 3). The nodes
talk plain HTTP (no TLS) on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchout import emit, loadavg  # noqa: E402


def loopback_rate(nbytes: int = 64 << 20) -> float:
    """Bytes per second of one TCP stream over loopback (median of 3)."""
    rates = []
    for _ in range(3):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        got = [0]

        def sink() -> None:
            conn, _ = srv.accept()
            while (b := conn.recv(1 << 20)):
                got[0] += len(b)
            conn.close()

        th = threading.Thread(target=sink)
        th.start()
        buf = b"\0" * (1 << 20)
        t = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as c:
            for _ in range(nbytes >> 20):
                c.sendall(buf)
        th.join()
        rates.append(nbytes / (time.perf_counter() - t))
        srv.close()
    return statistics.median(rates)


def _adapter(hidden: int, inter: int, kv: int, layers: int, rank: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    out = {}
    for layer in range(layers):
        for mod, (i, o) in dims.items():
            where = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{where}.{mod}"
            out[f"{p}.lora_A.weight"] = torch.randn(rank, i, generator=g) / i ** 0.5
            out[f"{p}.lora_B.weight"] = torch.zeros(o, rank)
    return out


async def run(args: argparse.Namespace, root: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from p2psync import checkpoint, keys
    from p2psync import config as p2pconfig
    from p2psync.node import Node
    from rollout.engines.base import EngineConfig
    from rollout.engines.vllm.engine import llm_kwargs, start_llm
    from rollout.engines.vllm.lora import AdapterSlots, follow
    from trainer.adapter import AdapterPublisher

    heads = args.hidden // 64
    kv_heads = max(1, heads // 2)
    inter = 3 * args.hidden
    cfg = AutoConfig.for_model("qwen3", vocab_size=4096, hidden_size=args.hidden, intermediate_size=inter,
                               num_hidden_layers=args.layers, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=512,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(root / "model")
    kw = llm_kwargs(EngineConfig(engine="vllm", model_path=str(root / "model"),
                                 vllm=dict(enable_lora=True, max_lora_rank=args.rank, max_loras=2,
                                           max_cpu_loras=4)), str(root / "model"))
    kw["max_model_len"] = 256
    llm = start_llm(kw)
    base_fp = checkpoint.load(root / "model").state.fingerprint
    priv = keys.generate()
    keys.write_pair(priv, root / "keys")
    slots = AdapterSlots(llm, base_fingerprint=base_fp, public_key=priv.public_key(), window=2)
    load_s: dict[int, float] = {}
    plain_load = slots.load

    def timed_load(name: str, state: Any, version: int) -> int:
        t = time.perf_counter()
        out = plain_load(name, state, version)
        load_s[version] = time.perf_counter() - t
        return out

    slots.load = timed_load  # type: ignore[method-assign]
    common = {"cluster_token": "bench-lora", "trainer_public_key": str(root / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 0.5, "sse_keepalive": 1.0, "retry_after": 0.2},
              "store": {"snapshot_interval": 0}, "tls": {"enabled": False}}  # plain HTTP on loopback
    tr = await Node.create(p2pconfig.load(overrides={
        **common, "id": "trainer", "role": "trainer", "data_dir": str(root / "t"),
        "trainer_private_key": str(root / "keys" / "trainer.key")}))
    fol = await Node.create(p2pconfig.load(overrides={
        **common, "id": "rollout", "role": "rollout", "data_dir": str(root / "r"), "parents": [tr.address]}))
    follower = asyncio.create_task(follow(fol, slots), name="follow-adapter")
    master = _adapter(args.hidden, inter, 64 * kv_heads, args.layers, args.rank)
    raw = sum(t.numel() * 2 for t in master.values())
    rows = []
    try:
        pub = await AdapterPublisher.create(master, tr, name="bench", base_fingerprint=base_fp, r=args.rank,
                                            lora_alpha=2 * args.rank, target_modules=[
                                                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"], chunk_size=1 << 20)
        while not slots.loaded("bench"):
            await asyncio.sleep(0.001)
        for v in range(1, args.versions + 1):
            g = torch.Generator().manual_seed(v)
            for t in master.values():
                t.add_(torch.randn(t.shape, generator=g).sign() * args.lr)
            t0 = time.perf_counter()
            await pub.publish()
            while not (slots.loaded("bench") and slots.loaded("bench")[-1] == v):
                if follower.done():
                    follower.result()
                await asyncio.sleep(0.001)
            served_s = time.perf_counter() - t0  # servable: request() names v from here on
            while v not in load_s or len(pub.records) <= v:  # the load's window eviction, the record
                await asyncio.sleep(0.001)
            rec = pub.records[v]
            rows.append({"version": v, "payload_bytes": rec.payload_bytes, "raw_bf16_bytes": raw,
                         "changed_fraction": rec.changed / rec.elements, "served_s": served_s,
                         "engine_load_s": load_s[v], "publish_total_s": rec.total_s})
        await pub.close()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await fol.close()
        await tr.close()
    return {"rows": rows, "raw_bf16_bytes": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--json", help="append the result (one JSON line) to this file")
    args = ap.parse_args()
    rate = loopback_rate()
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args, Path(d)))
    rows = res["rows"]
    for r in rows:
        r["link_s"] = r["payload_bytes"] / rate
        r["target_s"] = 1.2 * r["link_s"] + 0.05
        r["met"] = r["served_s"] <= r["target_s"]
        r["payload_over_raw"] = r["payload_bytes"] / r["raw_bf16_bytes"]
    emit({"bench": "lora_sync", "date": datetime.date.today().isoformat(), "load": loadavg(),
          "args": vars(args), "loopback_bytes_per_s": rate, "raw_bf16_bytes": res["raw_bf16_bytes"],
          "median_served_s": statistics.median(r["served_s"] for r in rows),
          "median_engine_load_s": statistics.median(r["engine_load_s"] for r in rows),
          "max_payload_over_raw": max(r["payload_over_raw"] for r in rows),
          "all_met": all(r["met"] for r in rows), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
