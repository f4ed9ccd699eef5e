"""The workload of the vLLM benchmarks: a Qwen3-shaped model's version 0 and 1, their signed
artifacts, and a trainer node that serves them (``tools/bench_vllm_apply.py`` documents the model
and the step; ``bench_scale``, ``bench_stage``, ``bench_rank_rates``, ``bench_fetch_client`` and
``bench_derive`` build and serve the same).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

TOKEN = "bench-cluster-token-0123456789"


def checkpoint_shapes(args) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors (name, shape) of the model of ``args`` (``--model dense`` or ``moe``), in
    checkpoint order: what :func:`build_versions` writes and ``tools/bench_fp8_delta.py`` quantizes."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (args.vocab, args.hidden))]
    q, kv = args.heads * 128, args.kv_heads * 128
    for i in range(args.layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (args.hidden,)), (p + "post_attention_layernorm.weight", (args.hidden,)),
                   (p + "self_attn.q_proj.weight", (q, args.hidden)), (p + "self_attn.k_proj.weight", (kv, args.hidden)),
                   (p + "self_attn.v_proj.weight", (kv, args.hidden)), (p + "self_attn.o_proj.weight", (args.hidden, q)),
                   (p + "self_attn.q_norm.weight", (128,)), (p + "self_attn.k_norm.weight", (128,))]
        if args.model == "moe":
            shapes.append((p + "mlp.gate.weight", (args.experts, args.hidden)))
            for e in range(args.experts):
                x = f"{p}mlp.experts.{e}."
                shapes += [(x + "gate_proj.weight", (args.moe_mlp, args.hidden)),
                           (x + "up_proj.weight", (args.moe_mlp, args.hidden)),
                           (x + "down_proj.weight", (args.hidden, args.moe_mlp))]
            continue
        shapes += [(p + "mlp.gate_proj.weight", (args.mlp, args.hidden)), (p + "mlp.up_proj.weight", (args.mlp, args.hidden)),
                   (p + "mlp.down_proj.weight", (args.hidden, args.mlp))]
    shapes.append(("model.norm.weight", (args.hidden,)))
    return shapes


def build_versions(args, out: Path):
    """Version 0 (checkpoint folder) and version 1 (one AdamW step), as ModelStates."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3MoeConfig

    from p2psync.state import ModelState

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=128, tie_word_embeddings=True, max_position_embeddings=512)
    if args.model == "moe":
        cfg = Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=8,
                             moe_intermediate_size=args.moe_mlp, architectures=["Qwen3MoeForCausalLM"])
    else:
        cfg = Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    g = torch.Generator().manual_seed(0)
    shapes = checkpoint_shapes(args)
    v0, v1 = {}, {}
    for name, shape in shapes:
        master = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        v0[name] = master.to(torch.bfloat16)
        # One AdamW step on this tensor alone (the optimizer's per-element rule does not couple tensors).
        p = torch.nn.Parameter(master)
        p.grad = torch.randn(shape, generator=g)
        torch.optim.AdamW([p], lr=args.lr).step()
        v1[name] = p.detach().to(torch.bfloat16)
        del p, master
    ck = out / "v0"
    ck.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(ck)
    save_file(v0, str(ck / "model.safetensors"))
    return ModelState(list(v0.items())), ModelState(list(v1.items())), ck


def build_workload(args: argparse.Namespace, out: Path) -> dict:
    """Version 0 and 1 of the model of ``args`` in ``out``: the checkpoint, the dense and sparse inputs
    of vLLM's paths, the signed snapshot and delta; returns the run's context (``context.json``)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from p2psync import keys
    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot, position_buckets

    t = time.perf_counter()
    s0, s1, ck = build_versions(args, out)
    nparams = sum(s.numel for s in s0.specs)
    changed = {n: np.flatnonzero(s0.words(n) != s1.words(n)) for n in s0}
    nchanged = sum(len(v) for v in changed.values())
    print(f"model {nparams / 1e6:.0f} M params, {nchanged} changed ({100 * nchanged / nparams:.2f} %), "
          f"built in {time.perf_counter() - t:.0f} s", flush=True)
    # Inputs of the vLLM paths, read by the worker.
    save_file({n: s0.tensor(n) for n in s0}, str(out / "dense_v0.safetensors"))
    save_file({**{n + ".values": s1.tensor(n).reshape(-1)[torch.from_numpy(p)] for n, p in changed.items() if len(p)},
               **{n + ".indices": torch.from_numpy(p) for n, p in changed.items() if len(p)}},
              str(out / "sparse.safetensors"))
    (out / "sparse.safetensors.json").write_text(json.dumps({n: list(s0.tensor(n).shape)
                                                             for n, p in changed.items() if len(p)}))
    # Artifacts and a trainer node serving them.
    keydir, pub = out / "keys", out / "publish"
    pub.mkdir(exist_ok=True)
    priv = keys.generate()
    if not (keydir / "trainer.key").exists():
        keys.write_pair(priv, keydir)
    else:
        priv = keys.load_private(keydir / "trainer.key")
    coding = getattr(args, "position_coding", "ranked")
    opts = CodecOptions(chunk_size=int(args.chunk_mib * (1 << 20)), context_buckets=position_buckets(coding))
    enc = encode_snapshot(s0, opts)
    write_file(pub / "000000-snapshot.p2sa", build_manifest(enc, model_id="bench", target_version=0,
                                                             chunk_size=opts.chunk_size, private_key=priv), enc.chunks)
    enc = encode_delta(s0, s1, opts)
    dm = build_manifest(enc, model_id="bench", base_version=0, target_version=1, chunk_size=opts.chunk_size,
                        private_key=priv)
    write_file(pub / "000001-delta.p2sa", dm, enc.chunks)
    delta_bytes = sum(len(c) for c in enc.chunks)
    del enc
    ctx = {"model": args.model, "params": nparams, "changed": nchanged, "delta_bytes": delta_bytes, "v0": s0.fingerprint,
           "v1": s1.fingerprint, "target": dm.target_fingerprint, "ck": str(ck), "keydir": str(keydir),
           "out": str(out), "link_mbit": args.link_mbit, "repeats": args.repeats, "tp": args.tp,
           "alternate": getattr(args, "alternate", False), "chunk_bytes": opts.chunk_size, "position_coding": coding,
           "json": str(Path(args.json).resolve()) if args.json else None}
    (out / "context.json").write_text(json.dumps(ctx))
    return ctx


def node_argv(ctx: dict) -> list[str]:
    """The command of a trainer node serving the artifacts of ``ctx``, over mutual TLS as every node
    runs: certificates of a CA in the key folder, the node's and one for node id ``bench`` that the
    engine presents (its requests name it so; a client-only one would be refused; ``ctx["tls_dir"]``)."""
    from p2psync.certs import Authority

    out, keydir, pub = Path(ctx["out"]), Path(ctx["keydir"]), Path(ctx["out"]) / "publish"
    ca = Authority(keydir)
    ca.node("trainer", "default", out / "node" / "tls")
    ctx["tls_dir"] = str(ca.node("bench", "default", out / "bench-tls"))
    (out / "context.json").write_text(json.dumps(ctx))
    return [sys.executable, "-m", "p2psync.cli", "node", "--role", "trainer", "--id", "trainer",
            f"--data_dir={out / 'node'}", f"--cluster_token={TOKEN}",
            f"--trainer_public_key={keydir / 'trainer.pub'}", f"--trainer_private_key={keydir / 'trainer.key'}",
            f"--publish-dir={pub}", "--listen.port=0"]


@contextlib.contextmanager
def serving(ctx: dict) -> Iterator[str]:
    """The address of a trainer node on loopback serving the artifacts of ``ctx`` (ended on exit)."""
    out = Path(ctx["out"])
    shutil.rmtree(out / "node", ignore_errors=True)
    node = subprocess.Popen(node_argv(ctx), stdout=subprocess.PIPE, stderr=open(out / "node.log", "ab"), text=True)
    try:
        yield node.stdout.readline().strip()
    finally:
        node.terminate()
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:  # a loaded machine: it did not finish stopping in time
            node.kill()
            node.wait()


def wait_head(ctx: dict, url: str) -> None:
    """Return once the node at ``url`` holds version 1 (it imports the artifacts it is given)."""
    import urllib.request

    from p2psync.transport.tls import Tls

    for _ in range(600):
        try:
            req = urllib.request.Request(url + "/v1/head", headers={"Authorization": f"Bearer {TOKEN}"})
            if json.loads(Tls.for_client(ctx["tls_dir"]).urlopen(req, timeout=5).read()).get("head") == 1:
                return
        except OSError:
            pass
        time.sleep(1)
