"""A cost model of one update, fitted to measured points, projected to 8B, 70B and 1T-parameter models.

    PYTHONPATH=$PWD .venv/bin/python tools/scale_model.py --points points.json [more.json ...] [--threads 16]

``fit`` and ``project`` are pure (no I/O, no clock): ``tools/bench_rank_rates.py`` and
``tools/bench_scale.py`` measure, this module fits and projects; ``--points`` reads their JSON.

What one update costs, from the trainer's announcement until an engine rank serves it, as the
code does it today::

    T = hops * chunk / link               the cut-through tree: one chunk time per hop
      + max(artifact_bytes / link,        the whole artifact crosses the regional link once,
            fetch_fixed                   the rank's fetch from its machine's node, chunk by chunk as
            + machine_bytes / fetch_rate    the node receives them (the node serves its machine's
            + machine_chunks * per_chunk,   ranks at one measured rate in all),
            decode(changes_rank, threads))  decode + checks on the rank's threads as chunks arrive
      + decode(chunk_changes, 1)          then the last chunk's decode on one thread
      + write(changes_rank, threads)      scatter into the live weights + undo log + fingerprint lanes
      + fixed                             plan, manifest, signature, RPCs, fingerprint fold

The rollout worker has the engine stage an artifact as soon as its node lists it, while the node
still receives it (``rollout/engine_sync.py``, ``rollout/engines/vllm/worker/stage.py``): each rank
fetches every chunk from its node once the node has it and decodes it as it arrives
(``rollout/engines/vllm/apply/stream.py``), so the link, the rank's fetch and its decode overlap and add
as their maximum. ``s_after_node_holds`` is the same update started once the node holds the whole
artifact (link, then the larger of fetch and decode), for comparison. The ranges tensor-parallel ranks rebuild together
(row-parallel weights) decode after the fetch; the model counts them as overlapped. Decode
and write: ``s = intercept + changes / (rate * S(threads))`` with ``S(n) = 1 / (f + (1 - f) / n)``
(Amdahl); ``rate`` and ``intercept`` from a least-squares line per thread count, ``f`` from the
lines' slopes at every measured thread count. Fetch: a least-squares line ``s = fetch_fixed +
bytes / fetch_rate + chunks * per_chunk`` over whole-artifact fetches of different sizes and
chunk sizes. A measured engine update's
fetch, decode and write seconds join those fits as points of their own. ``fixed``: the median of
what fetch, decode and write leave of each measured whole update (0 without one). The fit error
is every point's predicted time against its measured time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass

import numpy as np

LINKS_GBIT = (1.0, 10.0, 100.0)
RANKS = (8, 16, 32, 64)
RANKS_PER_MACHINE = 8
CHUNK_BYTES = 4 << 20
THREADS = 16
"""Update threads per rank assumed by the projection: cores per GPU of a typical 8-GPU host (96-192
cores: 12-24 per GPU)."""


@dataclass(frozen=True)
class Line:
    """``s = intercept + n / (rate * S(threads))``, Amdahl's ``S`` with serial fraction ``serial``."""
    rate: float
    """Items per second on one thread."""
    intercept: float
    serial: float

    def speedup(self, threads: int) -> float:
        return 1.0 / (self.serial + (1.0 - self.serial) / max(1, threads))

    def s(self, n: float, threads: int = 1) -> float:
        return self.intercept + n / (self.rate * self.speedup(threads))


@dataclass(frozen=True)
class Fetch:
    """``s = intercept + bytes / rate + chunks * per_chunk_s``: a whole fetch from a node."""
    rate: float
    per_chunk_s: float
    intercept: float

    def s(self, nbytes: float, chunks: float) -> float:
        return self.intercept + nbytes / self.rate + chunks * self.per_chunk_s


def fit_fetch(points: list[dict]) -> Fetch:
    """:class:`Fetch` by least squares over ``points`` (``bytes``, ``chunks``, ``s``); the
    chunk term only where the points have more than one chunk size."""
    x = np.array([[1.0, float(p["bytes"]), float(p["chunks"])] for p in points])
    y = np.array([float(p["s"]) for p in points])
    sizes = {round(p["bytes"] / max(1, p["chunks"]), -3) for p in points}
    if len(sizes) > 1 and len(points) >= 3:
        (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    else:
        (a, b), *_ = np.linalg.lstsq(x[:, :2], y, rcond=None)
        c = 0.0
    if b <= 0:  # noise: through the origin, bytes only
        a, b, c = 0.0, float(y.sum() / x[:, 1].sum()), 0.0
    return Fetch(rate=1.0 / float(b), per_chunk_s=max(0.0, float(c)), intercept=max(0.0, float(a)))


@dataclass(frozen=True)
class Rates:
    fetch: Fetch
    """A rank's fetch of its chunks from the node on its machine (the node serves its machine's
    ranks at ``fetch.rate`` bytes/s in all)."""
    decode: Line
    """Changes decoded and checked."""
    write: Line
    """Changes written into the live weights with their undo log and fingerprint lanes."""
    fixed_s: float
    """Per update: plan, manifest and signature, collective RPCs, fingerprint fold."""
    bytes_per_change: float
    """Compressed artifact bytes per changed element, measured at ``changed_fraction``."""
    changed_fraction: float

    def bytes_per_change_at(self, fraction: float) -> float:
        """Bytes per change at another changed fraction: gaps between changes cost about
        log2(1 / fraction) bits, so positions grow by log2(measured / fraction) bits."""
        return max(0.1, self.bytes_per_change + math.log2(self.changed_fraction / fraction) / 8.0)

    def update_s(self, changes: float, nbytes: float, threads: int, chunks: float = 1) -> float:
        """One rank's update from a node on its own machine (no regional link), as measured."""
        return (self.fixed_s + self.fetch.s(nbytes, chunks) + self.decode.s(changes, threads)
                + self.write.s(changes, threads))


def fit_line(points: list[dict], key: str) -> Line:
    """:class:`Line` through ``points`` (each with ``key``, ``threads`` (default 1) and ``s``; the
    one-thread points give the rate, the others the serial fraction)."""
    by: dict[int, list[tuple[float, float]]] = {}
    for p in points:
        by.setdefault(int(p.get("threads", 1)), []).append((float(p[key]), float(p["s"])))
    if 1 not in by:
        raise ValueError(f"no measured points with {key!r} on one thread")
    slopes, icpts = {}, []
    for t, xy in by.items():
        x, y = np.array([a for a, _ in xy]), np.array([b for _, b in xy])
        slope, icpt = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, 0.0)
        if slope <= 0:  # one size, or noise: through the origin
            slope, icpt = float(y.sum() / x.sum()), 0.0
        slopes[t] = float(slope)
        icpts.append(max(0.0, float(icpt)))
    b1 = slopes[1]
    # Serial fraction: b_t = b1 * (f + (1 - f) / t), least squares over the other thread counts.
    num = sum((b - b1 / t) * b1 * (1 - 1 / t) for t, b in slopes.items() if t > 1)
    den = sum((b1 * (1 - 1 / t)) ** 2 for t in slopes if t > 1)
    f = min(1.0, max(0.0, num / den)) if den > 0 else 0.0
    return Line(rate=1.0 / b1, intercept=statistics.median(icpts), serial=f)


def fit(points: dict, bytes_per_change: float, changed_fraction: float) -> tuple[Rates, dict]:
    """Rates from measured points, and the fit error on them.

    ``points``: ``fetch`` (``bytes``, ``s``: whole-artifact fetches from a node on loopback),
    ``decode`` and ``write`` (``changes``, ``threads``, ``s``; one thread among them), optional
    ``update`` (one rank's measured vLLM update: ``bytes``, ``changes``, ``threads``, ``fetch_s``,
    ``decode_s``, ``commit_s``, ``s``: its remainder is ``fixed``) and ``check`` (updates whose
    error is reported but not fitted, such as tensor-parallel ranks, whose exchange is not in it)."""
    for k in ("fetch", "decode", "write"):
        if not points.get(k):
            raise ValueError(f"points: no {k!r} points")
    updates = points.get("update") or []
    # A measured update's parts are points too: the decode and write inside the engine, its fetch;
    # not the fetch and decode of an update that decoded its chunks as they arrived (``overlapped``:
    # its fetch_s holds most of its decode, its decode_s only what was left after the last chunk).
    apart = [u for u in updates if not u.get("overlapped")]
    inside = {"fetch": [{"bytes": u["bytes"], "chunks": u.get("chunks", 1), "s": u["fetch_s"]} for u in apart],
              "decode": [{"changes": u["changes"], "threads": u["threads"], "s": u["decode_s"]} for u in apart],
              "write": [{"changes": u["changes"], "threads": u["threads"], "s": u["commit_s"]} for u in updates]}
    rates = Rates(fetch=fit_fetch(points["fetch"] + inside["fetch"]),
                  decode=fit_line(points["decode"] + inside["decode"], "changes"),
                  write=fit_line(points["write"] + inside["write"], "changes"),
                  fixed_s=max(0.0, statistics.median(u["s"] - u["fetch_s"] - u["decode_s"] - u["commit_s"]
                                                     for u in updates)) if updates else 0.0,
                  bytes_per_change=bytes_per_change, changed_fraction=changed_fraction)
    rows = [{"kind": "fetch" + tag, "measured_s": p["s"], "predicted_s": rates.fetch.s(p["bytes"], p.get("chunks", 1))}
            for src, tag in ((points, ""), (inside, " in an update")) for p in src["fetch"]]
    for k in ("decode", "write"):
        line = getattr(rates, k)
        rows += [{"kind": f"{k} ({p['threads']} thr){tag}", "measured_s": p["s"],
                  "predicted_s": line.s(p["changes"], p["threads"])}
                 for src, tag in ((points, ""), (inside, " in an update")) for p in src[k]]
    for k, label in (("update", "update"), ("check", "check (not fitted)")):
        rows += [{"kind": label, "measured_s": u["s"], "predicted_s": rates.update_s(u["changes"], u["bytes"],
                                                                                     u["threads"], u.get("chunks", 1))}
                 for u in points.get(k) or []]
    for r in rows:
        r["predicted_s"] = round(r["predicted_s"], 4)
        r["rel_error"] = round((r["predicted_s"] - r["measured_s"]) / r["measured_s"], 4) if r["measured_s"] else None
    errs = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None and not r["kind"].startswith("check")]
    return rates, {"points": rows, "mean_abs_rel_error": round(statistics.mean(errs), 4) if errs else None,
                   "max_abs_rel_error": round(max(errs), 4) if errs else None}


@dataclass(frozen=True)
class Shape:
    name: str
    params: float
    sharded: float
    """Parameters split 1/N over the N ranks (TP rows/columns, EP experts)."""
    tp_limit: int
    """The rest is split at most this many ways (attention at TP 8) and held whole beyond it."""
    note: str


SHAPES = (
    Shape("8B dense", 8.03e9, 8.03e9 * 0.999, 1, "Llama-3-8B: 32 layers, hidden 4096; norms (0.1 %) held whole"),
    Shape("70B dense", 70.6e9, 70.6e9 * 0.999, 1, "Llama-3-70B: 80 layers, hidden 8192; norms (0.1 %) held whole"),
    Shape("30B-A3B MoE", 30.5e9, 29.0e9, 8,
          "Qwen3-30B-A3B: 48 layers x 128 experts (2048 x 768), 1.5 B non-expert split at most 8 ways"),
    Shape("1T MoE (Kimi-K2 shape)", 1.04e12, 1.015e12, 8,
          "61 layers (60 MoE) x 384 experts (7168 x 2048) = 1.015 T expert parameters split over EP N; "
          "25 B non-expert (MLA attention, shared experts, embeddings) split at most 8 ways"),
)

ANCHORS = (
    {"system": "checkpoint-engine (MoonshotAI)", "model": "1T MoE (Kimi-K2)", "s": [16.0, 20.0],
     "setting": "full bf16 weights, inside one RDMA datacenter"},
    {"system": "TransferEngine (Perplexity)", "model": "1T MoE (Kimi-K2)", "s": [1.3, 1.3],
     "setting": "full weights, trainer GPUs to inference GPUs over RDMA"},
    {"system": "SGLang (#30848)", "model": "30B-A3B MoE", "s": [55.0, 63.0],
     "setting": "per RL step into Qwen3-30B-A3B"},
)


def per_rank_params(shape: Shape, ranks: int, slices: bool) -> float:
    if not slices:
        return shape.params
    rest = shape.params - shape.sharded
    return shape.sharded / ranks + rest / min(ranks, shape.tp_limit)


def hops(machines: int, fanout: int = 4) -> int:
    """Depth of the tree: trainer -> the region's relay, then a fan-out tree over the machines."""
    return 1 + max(1, math.ceil(math.log(max(2, machines), fanout)))


def project_one(rates: Rates, shape: Shape, link_gbit: float, ranks: int, slices: bool, fraction: float,
                threads: int, machines: int) -> dict:
    bpc = rates.bytes_per_change_at(fraction)
    total_bytes = shape.params * fraction * bpc
    changes = per_rank_params(shape, ranks, slices) * fraction
    rank_bytes = changes * bpc
    link = link_gbit * 1e9 / 8
    h = hops(machines)
    parts = {"tree_s": h * CHUNK_BYTES / link, "link_s": total_bytes / link,
             "rank_fetch_s": rates.fetch.s(min(ranks, RANKS_PER_MACHINE) * rank_bytes,
                                           math.ceil(min(ranks, RANKS_PER_MACHINE) * rank_bytes / CHUNK_BYTES)),
             "decode_s": rates.decode.s(changes, threads), "write_s": rates.write.s(changes, threads),
             "fixed_s": rates.fixed_s}
    # Chunks decode as they arrive (one chunk on one thread): the rank's decode runs beside its
    # fetch, and what is left after the last chunk arrived is that chunk's decode.
    parts["decode_after_fetch_s"] = rates.decode.s(min(changes, CHUNK_BYTES / bpc), 1)
    after = parts["decode_after_fetch_s"] + parts["write_s"] + parts["fixed_s"]
    s = parts["tree_s"] + max(parts["link_s"], parts["rank_fetch_s"], parts["decode_s"]) + after
    held = parts["tree_s"] + parts["link_s"] + max(parts["rank_fetch_s"], parts["decode_s"]) + after
    return {"model": shape.name, "link_gbit": link_gbit, "ranks": ranks, "slices": slices,
            "artifact_gb": round(total_bytes / 1e9, 3), "rank_changes": round(changes), "hops": h,
            **{k: round(v, 3) for k, v in parts.items()}, "s": round(s, 2), "s_after_node_holds": round(held, 2)}


def project(rates: Rates, fraction: float = 0.02, threads: int = THREADS, machines: int = 64,
            shapes: tuple[Shape, ...] = SHAPES, links: tuple[float, ...] = LINKS_GBIT,
            ranks: tuple[int, ...] = RANKS) -> dict:
    """Announce -> every engine serving for each shape, link rate, TP/EP size, with and without
    per-rank slices, beside the published anchors."""
    rows = [project_one(rates, s, link, n, sl, fraction, threads, machines)
            for s in shapes for link in links for n in ranks for sl in (True, False)]
    return {"assumptions": {
        "changed_fraction": fraction, "bytes_per_change": round(rates.bytes_per_change_at(fraction), 4),
        "dtype": "bf16", "update_threads_per_rank": threads, "ranks_per_machine": RANKS_PER_MACHINE,
        "machines_per_region": machines, "tree_fanout": 4, "chunk_bytes": CHUNK_BYTES,
        "slices": "with slices each rank fetches and decodes its 1/N of the sharded tensors plus what it "
                  "holds whole; without, every rank fetches and decodes the whole artifact",
        "overlap": "the tree is cut-through; the ranks stage the artifact once their node lists it, fetching "
                   "each chunk once the node has it and decoding it as it arrives (max of the link, the fetch "
                   "and the decode, plus the last chunk's decode on one thread), their write once their decode "
                   "ends (as the code does); s_after_node_holds: the fetch started once the node holds it all",
        "node_serving": "a machine's node serves all its ranks' chunks at the measured fetch rate in all",
        "shapes": [asdict(s) for s in shapes]},
        "rates": asdict(rates), "anchors": list(ANCHORS), "rows": rows}


def lookup(projection: dict, model: str, link_gbit: float, ranks: int, slices: bool = True) -> float:
    for r in projection["rows"]:
        if (r["model"], r["link_gbit"], r["ranks"], r["slices"]) == (model, link_gbit, ranks, slices):
            return float(r["s"])
    raise KeyError(f"no projection row for {model!r} at {link_gbit} Gbit/s, {ranks} ranks")


def headline(rates: Rates, fraction: float = 0.02, threads: int = THREADS, ranks: int = 32) -> dict:
    """The 1T MoE at 10 Gbit/s and EP ``ranks``: its parts, and its seconds at other thread counts."""
    shape = SHAPES[-1]
    row = project_one(rates, shape, 10.0, ranks, True, fraction, threads, 64)
    row["s_at_threads"] = {t: project_one(rates, shape, 10.0, ranks, True, fraction, t, 64)["s"]
                           for t in (2, 4, 8, 16, 24)}
    row["s_at_1pct"] = project_one(rates, shape, 10.0, ranks, True, 0.01, threads, 64)["s"]
    return row


def load_points(paths: list[str]) -> tuple[dict, list[str], float, float]:
    """The points of one or more ``bench_rank_rates.py`` / ``bench_scale.py`` JSON files, pooled;
    the machines they name; the measured delta's bytes per change and changed fraction."""
    pts: dict = {"fetch": [], "decode": [], "write": [], "update": [], "check": []}
    machines, bpc, frac = [], None, None
    for p in paths:
        d = json.load(open(p))
        src = d.get("points") or d
        for k in pts:
            pts[k] += src.get(k) or []
        machines.append(f"{d.get('machine')} ({d.get('date')}, load {d.get('loadavg_start')})")
        w = d.get("workload") or {}
        if w.get("changed") and bpc is None:
            bpc, frac = w["delta_bytes"] / w["changed"], w["changed"] / w["params"]
    if bpc is None or frac is None:
        raise SystemExit("--points: no file names its workload (params, changed, delta_bytes)")
    return pts, machines, bpc, frac


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", required=True, help="JSON files of measured points (module doc)")
    ap.add_argument("--threads", type=int, default=THREADS, help="update threads per rank assumed")
    ap.add_argument("--changed-fraction", type=float, default=0.02)
    ap.add_argument("--json", default=None, help="write the fit and projection here")
    args = ap.parse_args()
    pts, machines, bpc, frac = load_points(args.points)
    rates, err = fit(pts, bpc, frac)
    proj = project(rates, fraction=args.changed_fraction, threads=args.threads)
    proj["fit"], proj["machines"] = err, machines
    proj["headline"] = headline(rates, args.changed_fraction, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(proj, f, indent=1)
    print(json.dumps({"rates": proj["rates"], "fit": {k: err[k] for k in ("mean_abs_rel_error", "max_abs_rel_error")},
                      "headline": proj["headline"]}, indent=1))
    for r in proj["rows"]:
        if r["slices"]:
            print(f"{r['model']:24s} {r['ranks']:3d} ranks {r['link_gbit']:6g} Gbit/s: {r['s']:8.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
