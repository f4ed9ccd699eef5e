"""Benchmark: vLLM's trainer-side API on p2psync with 1, 2 and 4 trainer ranks (gloo, CPU).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_trainer_api.py --preset quick --json out.json  # minutes
    PYTHONPATH=$PWD .venv/bin/python tools/bench_trainer_api.py --preset 533m --ranks 1,2 --json out.json

The model is the dense Qwen3 shape of the vLLM benchmarks (``tools/vllm_workload.py``: ``533m`` is
its 533 M-parameter default, 24 layers, hidden 1024, vocabulary 151,936, tied embeddings; ``quick``
is ``bench_scale --quick``'s 4 layers, hidden 256, vocabulary 32,768; ``--layers`` / ``--hidden`` /
``--vocab`` override), fp32 master weights, one AdamW step per version (random gradients, lr
``--lr``; AdamW is per element, so a shard steps as the whole tensor would). At ``N`` ranks every
parameter is an FSDP2-style ``Shard(0)`` DTensor of an ``N``-rank mesh (each rank builds only its
own shard) and the source is a plain ``ModuleSource``: every rank runs the engine's ``Sharded``
extraction, reading its shards in place; at 1 rank the same model of plain tensors runs today's
``WholeModel``. The engine is built by ``WeightTransferTrainerFactory.trainer_init`` with a client
that records the calls (no vLLM: the trainer side only).

Per step and rank: ``send_s`` (``send_weights``: extraction, encode, the exchange, rank 0's sign and
publish, until the node holds the version), ``extract_s`` (the cast and compare of its share);
rank 0's ``PublishRecord``: ``payload_bytes`` (the delta), ``exchanged_bytes`` (what rank 0 received
from the other ranks), changed elements. Per rank, against its share in the rollout dtype
(``share_bytes``, its elements x 2): ``copy_bytes``, what the engine allocated to keep the previous
version (the publisher's CPU copy); ``extra_bytes``, the peak resident memory beyond what it held
before ``trainer_init``, over init and every step (the training's gradients and AdamW moments
exist by then: a warm-up step precedes it), and ``after_init_bytes`` once init returned;
``codec_bytes``, what loading the codec's compiled kernels added, measured before that baseline
(a cost per process, the same whatever the model's size, so not part of ``extra_bytes``). Freed
heap pages are given back before the baseline, as the engine does after version 0. The
optimizer is AdamW with ``foreach=False`` (its temporaries are one tensor's, so the 533 M run fits
beside other work), and the peak is not sampled during its steps: their temporaries are the
training's, not the engine's.
Rank 0 also holds the trainer node's copy of the whole model (its store), reported apart.

What vLLM's own backends would send for the same step (computed, not run; vLLM 0.32's trainer
engines):

- ``sparse_nccl`` (``SparseNCCLTrainerWeightTransferEngine``): one broadcast of int32 ``indices``
  and ``values`` in the wire dtype per changed tensor: ``changed x (4 + 2)`` bytes for bf16,
  from rank 0 only (a sharded trainer must first bring every rank's patches to rank 0, at least
  as many bytes again between ranks; the engine has no path for it).
- ``nccl_m2n`` (``M2NTrainerWeightTransferEngine``): every round reshards every parameter the
  source yields, changed or not: ``elements x itemsize`` per inference replica, where the itemsize
  is the source's dtype (``DTensorModuleSource`` yields the local shards as they are: fp32 master
  weights, 4 bytes; 2 if cast to bf16); every trainer rank sends its own shard, none crosses
  between trainer ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PRESETS = {
    "533m": dict(layers=24, hidden=1024, mlp=3072, heads=16, kv_heads=8, vocab=151936),
    "quick": dict(layers=4, hidden=256, mlp=768, heads=2, kv_heads=1, vocab=32768),
}


def shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The dense Qwen3 tensors of ``tools/vllm_workload.build_versions`` (tied embeddings, head_dim 128)."""
    h, q, kv = c["hidden"], c["heads"] * 128, c["kv_heads"] * 128
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab"], h))]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (128,)), (p + "self_attn.k_norm.weight", (128,)),
                (p + "mlp.gate_proj.weight", (c["mlp"], h)), (p + "mlp.up_proj.weight", (c["mlp"], h)),
                (p + "mlp.down_proj.weight", (h, c["mlp"]))]
    out.append(("model.norm.weight", (h,)))
    return out


class _Client:
    """vLLM's client, recording the calls (the trainer side alone is measured)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, info: Any) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The peak resident memory, sampled every 20 ms except while :meth:`paused` (the training's step)."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._on = threading.Event()
        self._on.set()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._on.wait()
            self.peak = max(self.peak, _rss())

    @contextlib.contextmanager
    def paused(self) -> Any:
        self.peak = max(self.peak, _rss())
        self._on.clear()
        try:
            yield
        finally:
            self._on.set()

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, _rss())


def _model(c: dict, rank: int, world: int):
    """The model of this rank: plain fp32 tensors (1 rank) or ``Shard(0)`` DTensors of a 1-D mesh, each
    rank generating only its own shard."""
    import torch

    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    root = torch.nn.Module()
    locals_: list[torch.Tensor] = []
    for k, (name, shape) in enumerate(shapes(c)):
        rows = shape[0]
        size = -(-rows // world)
        a, b = min(rows, rank * size), min(rows, (rank + 1) * size)
        g = torch.Generator().manual_seed(1000 * k + rank)
        local = (torch.ones((b - a, *shape[1:])) if len(shape) == 1 else
                 torch.randn((b - a, *shape[1:]), generator=g) * 0.02)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
            t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
        else:
            t = local
        p = torch.nn.Parameter(t)
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, torch.nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        owner.register_parameter(leaf, p)
        locals_.append(p.to_local() if mesh is not None else p)
    return root, locals_


def _rank(rank: int, world: int, root: str, c: dict) -> None:
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from p2psync import config
    from p2psync.certs import Authority
    from trainer.vllm import P2PSyncTrainerInitInfo

    torch.set_num_threads(1)
    rootp = Path(root)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=world)
    try:
        model, locals_ = _model(c, rank, world)
        with torch.no_grad():
            leaves = [t.detach() for t in locals_]
        for t in leaves:
            t.requires_grad_(True)
        opt = torch.optim.AdamW(leaves, lr=c["lr"], foreach=False)  # per tensor: one tensor's temporaries
        g = torch.Generator().manual_seed(7 + rank)
        for t in leaves:  # the training's own memory (gradients, AdamW's moments) before the baseline
            t.grad = torch.empty_like(t).normal_(generator=g)
        opt.step()
        cfg = None
        if rank == 0:
            Authority(rootp / "keys").node("trainer", "default", rootp / "t" / "tls")
            cfg = config.load(overrides={
                "cluster_token": "bench-trainer-api-0123", "trainer_public_key": str(rootp / "keys" / "trainer.pub"),
                "store": {"snapshot_interval": 0}, "id": "trainer", "role": "trainer", "data_dir": str(rootp / "t"),
                "trainer_private_key": str(rootp / "keys" / "trainer.key")})
        info = P2PSyncTrainerInitInfo(node_config=cfg, rank=rank, worker_init_info={"tls_dir": str(rootp)},
                                      publisher_options={"threads": 1})
        from p2psync.codec import precompile

        from trainer.publisher import _release_freed_memory

        _release_freed_memory()  # as the engine does after version 0: both sides of the baseline alike
        r0 = _rss()
        precompile.warm(("BF16",))  # the codec's kernels: a cost per process, whatever the model's size
        codec = _rss() - r0
        _release_freed_memory()
        before = _rss()
        peak = _Peak()
        t0 = time.perf_counter()
        engine = WeightTransferTrainerFactory.trainer_init(info, client=_Client(), source=ModuleSource(model))
        init_s = time.perf_counter() - t0
        pub = engine.extraction.publisher
        share = sum(t.numel() for t in locals_) * 2  # this rank's elements in the rollout dtype (bf16)
        copy = sum(b.numel() * b.element_size() for b in pub._base)  # what it keeps of the previous version
        after_init = _rss() - before
        extracts: list[float] = []
        orig = pub._extract

        def timed() -> Any:
            out = orig()
            extracts.append(out[1])
            return out

        pub._extract = timed
        steps = []
        for _ in range(c["steps"]):
            with peak.paused():  # the training's step: its temporaries are not the engine's
                for t in leaves:
                    t.grad.normal_(generator=g)  # in place: no new memory
                opt.step()
            t0 = time.perf_counter()
            engine.send_weights()
            steps.append({"send_s": time.perf_counter() - t0, "extract_s": extracts[-1]})
        extra = peak.stop() - before
        node_bytes = 0
        records = []
        if rank == 0:
            node_bytes = sum(s.numel * 2 for s in pub._specs)
            records = [r.to_json() for r in pub.records]
        mine = {"rank": rank, "init_s": init_s, "steps": steps, "share_bytes": share, "copy_bytes": copy,
                "extra_bytes": extra, "after_init_bytes": after_init, "codec_bytes": codec,
                "node_model_bytes": node_bytes}
        everyone: list[Any] = [mine]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
        engine.shutdown()
        if rank == 0:
            (rootp / "result.json").write_text(json.dumps({"ranks": everyone, "records": records}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(c: dict, world: int) -> dict:
    import torch.multiprocessing as mp

    from p2psync import keys

    with tempfile.TemporaryDirectory(prefix="bench-trainer-api-") as d:
        keys.write_pair(keys.generate(), Path(d) / "keys")
        t0 = time.perf_counter()
        mp.spawn(_rank, args=(world, d, c), nprocs=world, join=True)
        got = json.loads((Path(d) / "result.json").read_text())
    wall = time.perf_counter() - t0
    steps = []
    for s, rec in enumerate(got["records"][1:]):
        per = [r["steps"][s] for r in got["ranks"]]
        changed, elements, payload = rec["changed"], rec["elements"], rec["payload_bytes"]
        steps.append({
            "version": rec["version"], "changed": changed, "elements": elements, "payload_bytes": payload,
            "exchanged_bytes": rec["exchanged_bytes"],
            "exchanged_over_payload": rec["exchanged_bytes"] / payload if payload else None,
            "send_s": [p["send_s"] for p in per], "extract_s": [p["extract_s"] for p in per],
            "rank0": {k: rec[k] for k in ("extract_s", "encode_s", "publish_s", "total_s")},
            "sparse_nccl_bytes": changed * (4 + 2), "nccl_m2n_bytes_fp32": elements * 4,
            "nccl_m2n_bytes_bf16": elements * 2})
    ranks = [{"rank": r["rank"], "init_s": r["init_s"], "share_bytes": r["share_bytes"],
              "copy_bytes": r["copy_bytes"], "copy_over_share": r["copy_bytes"] / r["share_bytes"],
              "extra_bytes": r["extra_bytes"], "after_init_bytes": r["after_init_bytes"],
              "codec_bytes": r["codec_bytes"], "node_model_bytes": r["node_model_bytes"],
              "extra_over_share": (r["extra_bytes"] - r["node_model_bytes"]) / r["share_bytes"],
              "with_codec_over_share": (r["extra_bytes"] + r["codec_bytes"] - r["node_model_bytes"])
              / r["share_bytes"]}
             for r in got["ranks"]]
    worst = max(s["exchanged_over_payload"] or 0 for s in steps) if steps else None
    return {"world": world, "wall_s": wall, "steps": steps, "ranks": ranks,
            "targets": {"exchanged_le_1.1x_payload": None if world == 1 else worst <= 1.1,
                        "previous_version_copy_le_share": all(r["copy_over_share"] <= 1.0 for r in ranks),
                        "peak_extra_le_share": all(r["extra_over_share"] <= 1.0 for r in ranks[1:])
                        if world > 1 else None}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated trainer rank counts")
    ap.add_argument("--steps", type=int, default=2, help="versions after version 0")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (the workload's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    c = dict(PRESETS[args.preset])
    for k in ("layers", "hidden", "vocab"):
        if getattr(args, k) is not None:
            c[k] = getattr(args, k)
    c.update(steps=args.steps, lr=args.lr)
    params = sum(int(__import__("math").prod(s)) for _, s in shapes(c))
    print(f"model: {args.preset} {c}, {params / 1e6:.1f} M parameters", flush=True)
    runs: list[dict] = []
    out = {"bench": "trainer_api", "preset": args.preset, "model": c, "params": params, "runs": runs,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
           "date": datetime.date.today().isoformat(),
           "command": "tools/bench_trainer_api.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for world in [int(x) for x in args.ranks.split(",")]:
        r = measure(c, world)
        runs.append(r)
        if args.json:  # after each rank count: a later one that fails (out of memory) keeps these
            Path(args.json).write_text(json.dumps(out, indent=1))
        for s in r["steps"]:
            print(f"ranks {world} v{s['version']}: send {max(s['send_s']):.2f} s (extract max "
                  f"{max(s['extract_s']):.2f} s), payload {s['payload_bytes']:,} B, exchanged "
                  f"{s['exchanged_bytes']:,} B, sparse_nccl {s['sparse_nccl_bytes']:,} B, nccl_m2n "
                  f"{s['nccl_m2n_bytes_bf16']:,} B (bf16)", flush=True)
        for q in r["ranks"]:
            print(f"  rank {q['rank']}: share {q['share_bytes']:,} B, previous-version copy {q['copy_bytes']:,} B "
                  f"({q['copy_over_share']:.2f}x), peak extra {q['extra_bytes']:,} B ({q['extra_over_share']:.2f}x "
                  f"share, node copy excluded; after init {q['after_init_bytes']:,} B), codec kernels "
                  f"{q['codec_bytes']:,} B per process ({q['with_codec_over_share']:.2f}x with them)", flush=True)


if __name__ == "__main__":
    main()
