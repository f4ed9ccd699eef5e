"""Benchmark: applying one trainer step to a live vLLM engine, p2psync vs vLLM's dense and sparse loads.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_vllm_apply.py --out /tmp/bench_vllm
    PYTHONPATH=$PWD .venv/bin/python tools/bench_vllm_apply.py --link-mbit 1000 --out /tmp/bench_vllm
    PYTHONPATH=$PWD .venv/bin/python tools/bench_vllm_apply.py --model moe --experts 64 --out /tmp/bench_moe
    PYTHONPATH=$PWD .venv/bin/python tools/bench_vllm_apply.py --tp 2 --chunk-mib 1 --out /tmp/bench_tp2

``--tp N``: the engine at tensor parallel size ``N``; the result adds each rank's
bytes fetched, share of the artifact (``fetch_fraction``) and seconds for the
first and the repeated update (``ranks_first``, ``ranks``; from the backend's
status) and ``tp_fetch_fraction`` (the largest share), and stops after the
repeated update.

``--model moe``: a Qwen3-MoE shape instead (every layer's MLP is ``--experts``
experts of ``--moe-mlp`` rows, top-8 routing, per-expert checkpoint tensors as
``save_pretrained`` writes them); vLLM's CPU kernel repacks the experts, so
every expert is written through a placement derived from vLLM's loaders. The
result also gives the seconds the backend took to derive the placement at bind
time (``derive_s``, to compare with vLLM's own ``load_weights``: ``dense.s``, and
with the engine's whole start: ``vllm_build_s``). Run it with
``P2PSYNC_PLACEMENT_CACHE=off`` to time a derivation rather than a read of the
placement cache.
vLLM's dense ``load_weights`` into a running CPU MoE engine does not give the
checkpoint's weights back (it writes the loader's layout into experts repacked
at start), so with ``--model moe`` the sparse patch runs right after the first
p2psync update, on version 1 (writing version 1's words at the changed
positions, the same work; ``bit_exact``: the engine still audits as version 1),
then the dense ``load_weights``, and the paths after it are skipped.

A random-init Qwen3-shaped model (default ~0.53 B parameters: hidden 1024, 24
layers, MLP 3072, 16 q / 8 kv heads of 128, vocabulary 151,936, tied
embeddings) is saved as version 0 and loaded by vLLM (bf16, the p2psync
backend). Version 1 is one AdamW step (lr 1e-6, random normal gradients) on the
fp32 master weights, cast to bf16. In one run, on the same engine:

- ``p2psync``: ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` + prefix-cache reset, timed at the caller: fetch of
  the signed delta from a ``p2psync node`` over HTTP, chunk and signature
  checks, decode against the live words, fingerprint check, scatter with undo
  log (``fetch_s``, ``decode_s``, ``commit_s``: the backend's own split);
  ``p2psync_again``: the same once more, after the dense reload below.
- ``dense``: vLLM's ``model.load_weights`` of the full v0 checkpoint, timed
  inside the worker without and with getting the safetensors file first (from
  the page cache; with ``--link-mbit``, over HTTP from a file server behind
  the capped link: ``s_with_transfer``). It puts the engine back on version 0.
- ``dense_fetched``: the same ``load_weights``, the full checkpoint fetched the
  way the delta is (the node's signed snapshot of v0, same client, same link).
- ``sparse_patch``: vLLM's ``load_checkpoint_weight_patches`` with the changed
  positions and values of v0 -> v1 (already in the worker; timed inside it).

``--link-mbit R`` (root): the node and the file server run on one emulated
machine and the engine on another (network namespaces of
:mod:`p2psync.testbed`), every link capped at ``R`` Mbit/s with ``tc tbf``.
After the last path the p2psync backend audits every live word against the
version-1 fingerprint (so the sparse patch is checked to be bit-exact too).
Extra memory: the worker's peak resident set during the apply above its
resident set when the apply began (``/proc/self/clear_refs`` resets the peak);
the inputs of the vLLM paths are already resident then and not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchout import emit, loadavg
from vllm_workload import TOKEN, build_workload, node_argv, serving, wait_head


def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process in bytes."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            got[line[:5]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _rss()[0]


def rpc_mem_start(worker) -> int:
    return _reset_peak()


def rpc_mem_peak(worker) -> int:
    return _rss()[1]


def rpc_rusage(worker) -> tuple[int, float]:
    """(minor page faults, CPU seconds) of the worker process so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


def rpc_overlap(worker, on: bool) -> None:
    """Decode a delta's chunks as they arrive (on) or after the fetch (off: the sequential path)."""
    from rollout.engines.vllm.worker.rpc import backend as _backend

    _backend(worker).overlap = on


def rpc_dense(worker, source: str) -> dict:
    """vLLM's dense path: ``load_weights`` of every checkpoint tensor, read first from ``source``
    (a file, or an ``http://`` URL: the full checkpoint fetched over the link the delta takes)."""
    import urllib.request

    from safetensors.torch import load, load_file

    model = worker.model_runner.model
    t0 = time.perf_counter()
    if source.startswith("http://"):
        with urllib.request.urlopen(source, timeout=600) as r:
            tensors = load(r.read())
    else:
        tensors = load_file(source)
    got = time.perf_counter() - t0
    base = _reset_peak()
    t = time.perf_counter()
    model.load_weights(list(tensors.items()))
    dt = time.perf_counter() - t
    key = "s_with_transfer" if source.startswith("http://") else "s_with_file_read"
    return {"s": dt, key: time.perf_counter() - t0, "read_s": got, "extra_bytes": _rss()[1] - base}


def rpc_dense_fetched(worker, url: str, pub: str, tls_dir: str) -> dict:
    """vLLM's dense path with the full checkpoint fetched the way the delta is: the node's signed
    snapshot of version 0 over the same link with the same client (4 streams, every chunk's hash
    checked), decoded into tensors, then ``load_weights``."""
    from p2psync.codec.decode import decode_state
    from p2psync.transport.leaf import Fetcher, Parent, fetch_artifact, fetch_plan

    model = worker.model_runner.model
    t0 = time.perf_counter()
    f = Fetcher()
    parent = Parent.create(url, TOKEN, pub, "bench/dense", tls_dir, 600.0)
    try:
        (snap,) = f.run(parent, lambda c: fetch_plan(parent, None, 0, c))
        manifest, chunks = f.run(parent, lambda c: fetch_artifact(parent, snap.id, client=c))
    finally:
        f.close()
    t1 = time.perf_counter()
    state = decode_state(list(manifest.tensors), enumerate(chunks), len(manifest.chunks),
                         manifest.target_fingerprint)
    del chunks
    tensors = [(n, state.tensor(n)) for n in state]
    t2 = time.perf_counter()
    base = _reset_peak()
    t = time.perf_counter()
    model.load_weights(tensors)
    dt = time.perf_counter() - t
    return {"s": dt, "s_with_transfer": time.perf_counter() - t0, "fetch_s": t1 - t0, "decode_s": t2 - t1,
            "bytes": manifest.payload_bytes, "extra_bytes": _rss()[1] - base}


def rpc_sparse(worker, path: str) -> dict:
    """vLLM's sparse checkpoint patches of the changed positions (read into memory first)."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    model = worker.model_runner.model
    raw = load_file(path)
    shapes = json.loads(Path(path + ".json").read_text())
    patches = [CheckpointWeightPatch(n, tuple(shapes[n]), torch.bfloat16, raw[n + ".values"], raw[n + ".indices"])
               for n in shapes]
    base = _reset_peak()
    t = time.perf_counter()
    load_checkpoint_weight_patches(model, patches)
    dt = time.perf_counter() - t
    return {"s": dt, "extra_bytes": _rss()[1] - base}


def rpc_derive_s(worker) -> float | None:
    """Seconds the backend's last placement derivation took in this worker."""
    from rollout.engines.vllm.placement import probe

    return probe.LAST_DERIVE_S


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--model", choices=["dense", "moe"], default="dense")
    ap.add_argument("--experts", type=int, default=64, help="--model moe: experts per layer")
    ap.add_argument("--moe-mlp", type=int, default=256, help="--model moe: rows of each expert's MLP")
    ap.add_argument("--out", default=None)
    ap.add_argument("--link-mbit", type=float, default=0,
                    help="cap the links between the node and the engine at this rate (needs root); 0: loopback")
    ap.add_argument("--json", default=None, help="append the result line to this file")
    ap.add_argument("--repeats", type=int, default=1, help="repeated p2psync updates (each after a dense reload)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the model, checkpoint and artifacts already in --out (built by an earlier run)")
    ap.add_argument("--tp", type=int, default=1,
                    help="vLLM tensor_parallel_size: with 2 or more, the per-rank bytes fetched and seconds of the "
                         "first and repeated update are reported (ranks, tp_fetch_fraction), and the paths after the "
                         "repeated update are skipped")
    ap.add_argument("--chunk-mib", type=float, default=4, help="chunk size of the artifacts (MiB)")
    ap.add_argument("--alternate", action="store_true",
                    help="repeated updates alternate between the sequential path (fetch every chunk, then decode) "
                         "and chunks decoded as they arrive; each path's medians are reported")
    ap.add_argument("--engine-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dense", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.engine_part:  # inside the engine's machine (see run_linked)
        run_engine(json.loads(Path(args.engine_part).read_text()), args.url, args.dense)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.reuse and (out / "context.json").exists():
        ctx = json.loads((out / "context.json").read_text())
        ctx.update(link_mbit=args.link_mbit, repeats=args.repeats, tp=args.tp, alternate=args.alternate,
                   json=str(Path(args.json).resolve()) if args.json else None)
        (out / "context.json").write_text(json.dumps(ctx))
        shutil.rmtree(out / "node", ignore_errors=True)
        res = serve_and_run(ctx, args.link_mbit)
        return res if isinstance(res, int) else 0

    ctx = build_workload(args, out)
    res = serve_and_run(ctx, args.link_mbit)
    return res if isinstance(res, int) else 0


def serve_and_run(ctx: dict, link_mbit: float) -> dict | int:
    """The engine's part against a trainer node serving ``ctx``: its summary (on loopback), or the
    return code of the engine's emulated machine (``link_mbit``, which prints its own)."""
    if link_mbit:
        return run_linked(ctx, node_argv(ctx), link_mbit)
    with serving(ctx) as url:
        return run_engine(ctx, url, str(Path(ctx["out"]) / "dense_v0.safetensors"))


def run_linked(ctx: dict, node_argv: list[str], mbit: float) -> int:
    """The node and a file server of the full checkpoint on one emulated machine, the engine on
    another, both machines' links capped at ``mbit`` (``tc tbf``, network namespaces; needs root)."""
    from p2psync.testbed import Testbed
    from p2psync.testbed.config import from_dict

    cfg = from_dict({"name": "p2vb", "subnet": "10.97.0.0/16", "trainer_region": "lan",
                     "trainer_uplink_mbit": mbit, "node_uplink_mbit": mbit, "node_downlink_mbit": mbit,
                     "regions": [{"name": "lan", "wan_mbit": 0, "nodes": 1}], "latency": []})
    out = Path(ctx["out"])
    with Testbed.up(cfg) as tb:
        src, dst = tb.trainer, tb.rollout_machines()[0]
        node = tb.spawn(src.id, [*node_argv, f"--listen.host={src.ip}"], stdout=subprocess.PIPE,
                        stderr=open(out / "node.log", "ab"), text=True)
        files = tb.spawn(src.id, [sys.executable, "-m", "http.server", "--bind", src.ip, "8000",
                                  "--directory", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = node.stdout.readline().strip()
            return tb.run(dst.id, [sys.executable, str(Path(__file__).resolve()), "--engine-part",
                                   str(out / "context.json"), "--url", url,
                                   "--dense", f"http://{src.ip}:8000/dense_v0.safetensors"]).returncode
        finally:
            tb.stop([node, files])


def run_engine(ctx: dict, url: str, dense: str) -> dict:
    from vllm import LLM

    from p2psync.transport.leaf import Parent
    from rollout.engines.base import EngineConfig
    from rollout.engines.vllm.engine import VLLMEngine
    from rollout.engines.vllm.launch import llm_kwargs

    ck, keydir, out, tls_dir = Path(ctx["ck"]), Path(ctx["keydir"]), Path(ctx["out"]), ctx["tls_dir"]
    wait_head(ctx, url)
    kw = llm_kwargs(EngineConfig(engine="vllm", model_path=str(ck)), str(ck))
    kw["max_model_len"] = 256
    tp = int(ctx.get("tp", 1))
    if tp > 1:
        kw["tensor_parallel_size"] = tp
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= tp:  # vLLM's CPU workers bind one core each ('auto' keeps one back for the front end)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cpus[:tp]))
    t = time.perf_counter()
    eng = VLLMEngine(LLM(**kw))
    ctx["vllm_build_s"] = time.perf_counter() - t
    print(f"vLLM built in {ctx['vllm_build_s']:.0f} s", flush=True)
    try:
        eng.attach(Parent.create(url, TOKEN, (keydir / "trainer.pub").read_text(), "bench", tls_dir), version=0)
        rpc = eng.llm.collective_rpc
        eng.audit()  # bind and hash once (the engine does this when it is attached in a node)
        res = {}
        rpc(rpc_mem_start)
        base = rpc(rpc_mem_start)[0]
        f0, c0 = rpc(rpc_rusage)[0]
        t = time.perf_counter()
        fp = eng.reach(1)
        res["p2psync"] = {"s": time.perf_counter() - t, "extra_bytes": rpc(rpc_mem_peak)[0] - base,
                          "derive_s": rpc(rpc_derive_s)[0], **eng.status()["timing"]}
        f1, c1 = rpc(rpc_rusage)[0]
        res["p2psync"].update(minflt=f1 - f0, cpu_s=c1 - c0)
        assert fp == ctx["target"]
        if tp > 1:
            res["ranks_first"] = _ranks(eng)
        if ctx.get("model") == "moe":
            # vLLM's dense load_weights does not give a running CPU MoE engine version 0 back (below), so
            # the sparse patch runs first, on version 1: it writes version 1's words at the changed
            # positions (the same work as from version 0); the audit after it says whether they landed
            # where the engine keeps them
            res["sparse_patch"] = _sparse(eng, rpc, out, ctx["v1"])
        res["dense"] = rpc(rpc_dense, args=(dense,))[0]
        res["dense"]["bit_exact"] = eng.audit() == ctx["v0"]
        if not res["dense"]["bit_exact"]:
            # e.g. MoE on CPU: load_weights writes the loader's layout into experts repacked at start
            print("vLLM's dense reload did not restore version 0; the paths after it are skipped", flush=True)
            return _report(ctx, res)
        # p2psync again from version 0 (told so: init checks it), then the dense reload fetched as the delta is
        eng.attach(Parent.create(url, TOKEN, (keydir / "trainer.pub").read_text(), "bench", tls_dir), version=0)
        f0, c0 = rpc(rpc_rusage)[0]
        t = time.perf_counter()
        assert eng.reach(1) == ctx["target"]
        res["p2psync_again"] = {"s": time.perf_counter() - t, **eng.status()["timing"]}
        f1, c1 = rpc(rpc_rusage)[0]
        res["p2psync_again"].update(minflt=f1 - f0, cpu_s=c1 - c0)
        if tp > 1:  # each rank's share of the repeated update, then stop (the paths below are rank 0's)
            res["ranks"] = _ranks(eng)
            ctx["extra"] = {"tp_fetch_fraction": max(r["fetch_fraction"] for r in res["ranks"]),
                            "again_over_dense": round(res["p2psync_again"]["s"] / res["dense"]["s"], 4)}
            return _report(ctx, res)
        again, dense_s = [res["p2psync_again"]], [res["dense"]["s"]]
        for k in range(int(ctx.get("repeats", 1)) - 1):  # more repeated updates: dense back to v0, then v1
            if ctx.get("alternate"):
                rpc(rpc_overlap, args=(k % 2 == 1,))  # the update above was overlapped: sequential first
            dense_s.append(rpc(rpc_dense, args=(dense,))[0]["s"])
            eng.attach(Parent.create(url, TOKEN, (keydir / "trainer.pub").read_text(), "bench", tls_dir), version=0)
            f0, c0 = rpc(rpc_rusage)[0]
            t = time.perf_counter()
            assert eng.reach(1) == ctx["target"]
            again.append({"s": time.perf_counter() - t, **eng.status()["timing"]})
            f1, c1 = rpc(rpc_rusage)[0]
            again[-1].update(minflt=f1 - f0, cpu_s=c1 - c0)
        res["p2psync_repeats"] = {"s": [round(a["s"], 4) for a in again],
                                  "decode_s": [a["decode_s"] for a in again],
                                  "commit_s": [a["commit_s"] for a in again],
                                  "cpu_s": [round(a["cpu_s"], 3) for a in again], "dense_s": dense_s,
                                  "fetch_s": [a["fetch_s"] for a in again],
                                  "overlapped": [bool(a.get("overlapped")) for a in again]}
        rpc(rpc_overlap, args=(True,))
        if ctx.get("alternate"):
            res["alternate"] = _by_path(again)
        res["dense_fetched"] = rpc(rpc_dense_fetched, args=(url, (keydir / "trainer.pub").read_text(), tls_dir))[0]
        if eng.audit() != ctx["v0"]:
            raise SystemExit("dense reload (fetched) did not restore version 0")
        res["sparse_patch"] = _sparse(eng, rpc, out, ctx["v1"])
        again_s, dense_med = statistics.median(a["s"] for a in again), statistics.median(dense_s)
        ctx["extra"] = {"first_over_again": round(res["p2psync"]["s"] / again_s, 4),
                        "again_over_dense": round(again_s / dense_med, 4)}
        return _report(ctx, res)
    finally:
        eng.close()


def _sparse(eng, rpc, out: Path, v1: str) -> dict:
    """vLLM's sparse patch of the changed positions, then whether the engine is on version 1."""
    try:
        res = rpc(rpc_sparse, args=(str(out / "sparse.safetensors"),))[0]
        res["bit_exact"] = eng.audit() == v1
        return res
    except Exception as exc:  # report why vLLM's sparse path is not usable here
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _by_path(updates: list[dict]) -> dict:
    """Median seconds (whole update, fetch, decode, commit) of the sequential and the overlapped updates."""
    out = {}
    for name, on in (("sequential", False), ("overlapped", True)):
        got = [u for u in updates if bool(u.get("overlapped")) == on]
        if got:
            out[name] = {"n": len(got), **{k: round(statistics.median(u[k] for u in got), 4)
                                           for k in ("s", "fetch_s", "decode_s", "commit_s")}}
    if len(out) == 2:
        out["overlapped_over_sequential"] = round(out["overlapped"]["s"] / out["sequential"]["s"], 4)
    return out


def _ranks(eng) -> list[dict]:
    """Each tensor-parallel rank's bytes fetched and seconds for the last update (the backend's status)."""
    out = []
    for st in eng.rank_status():
        t = st["timing"]
        out.append({"rank": st["rank"], "fetched_bytes": t["fetched_bytes"], "artifact_bytes": t["artifact_bytes"],
                    "fetch_fraction": round(t["fetched_bytes"] / t["artifact_bytes"], 4),
                    "fetched_chunks": t["fetched_chunks"], "artifact_chunks": t["artifact_chunks"],
                    "segments_decoded": t.get("segments_decoded"),
                    **{k: t[k] for k in ("fetch_s", "decode_s", "commit_s")}})
    return out


def _report(ctx: dict, res: dict) -> dict:
    """The summary of the paths that ran, printed (and appended to ``--json``)."""
    p = res["p2psync"]["s"]
    summary = {k: ctx.get(k) for k in ("model", "params", "changed", "delta_bytes", "link_mbit", "tp", "chunk_bytes")}
    summary.update({k: ({kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                        if isinstance(v, dict) else v) for k, v in res.items()})
    summary["loadavg"] = loadavg()
    summary["p2psync_over_dense"] = round(p / res["dense"]["s"], 4)
    summary.update(ctx.get("extra", {}))
    summary["p2psync_us_per_changed"] = round(1e6 * p / max(1, ctx["changed"]), 4)
    if res["p2psync"].get("derive_s") is not None:
        summary["derive_over_dense_load"] = round(res["p2psync"]["derive_s"] / res["dense"]["s"], 4)
        if ctx.get("vllm_build_s"):
            summary["vllm_build_s"] = round(ctx["vllm_build_s"], 2)
            summary["derive_over_vllm_build"] = round(res["p2psync"]["derive_s"] / ctx["vllm_build_s"], 4)
    if "s_with_transfer" in res["dense"]:
        summary["p2psync_over_dense_with_transfer"] = round(p / res["dense"]["s_with_transfer"], 4)
    if "dense_fetched" in res:
        summary["p2psync_over_dense_fetched"] = round(p / res["dense_fetched"]["s_with_transfer"], 4)
    if "s" in res.get("sparse_patch", {}):
        summary["p2psync_over_sparse_patch"] = round(p / res["sparse_patch"]["s"], 4)
    return emit(summary, ctx.get("json"))


if __name__ == "__main__":
    sys.exit(main())
