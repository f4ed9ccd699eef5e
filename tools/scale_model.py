"""A cost model of one update, fitted to measured points, projected to 8B, 70B and 1T-parameter models.

Pure (no I/O, no clock): ``tools/bench_scale.py`` measures, this module fits and projects.

One update of one engine rank, from the trainer's announcement until the rank serves it::

    T = hops * chunk / link                      cut-through tree: one chunk time per hop
      + artifact_bytes / link                    the whole artifact crosses the regional link once
      + rank_bytes / fetch_rate                  the rank's fetch from its machine's node
      + changes_rank / (decode_rate * S(threads))  decode + checks on the rank's threads
      + changes_rank / write_rate                scatter into the live weights + check
      + fixed                                    plan, manifest, RPCs, fingerprint fold

``S(n) = 1 / (f + (1 - f) / n)`` (Amdahl) with ``f`` from the measured 2-thread speedup. The
link time and the apply are added, not overlapped (an upper bound: a rank could decode chunks
as they arrive). Fitted: ``decode_rate`` and a decode intercept by least squares over every
measured decode (inside the engine and outside it), ``write_rate`` and ``fetch_rate`` as
total work over total seconds, ``fixed`` as the median of what the three parts leave of each
measured update; the fit error is each measured update's and decode's predicted time against
its measured time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

LINKS_GBIT = (1.0, 10.0, 100.0)
RANKS = (8, 16, 32, 64)
RANKS_PER_MACHINE = 8
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Rates:
    decode_changes_per_s: float
    """Changes decoded (and checked) per second on one thread."""
    decode_intercept_s: float
    """Fixed seconds of one decode (segment set-up, thread start)."""
    serial_fraction: float
    """Amdahl's serial fraction of the decode, from the measured 2-thread speedup."""
    write_changes_per_s: float
    """Changes scattered into the live weights (and the written words checked) per second."""
    fetch_bytes_per_s: float
    """A rank's fetch from a node on its own machine (loopback), bytes per second."""
    fixed_s: float
    """Per update: plan, manifest and signature, collective RPCs, fingerprint fold."""
    bytes_per_change: float
    """Compressed artifact bytes per changed element, measured at ``changed_fraction``."""
    changed_fraction: float
    """The changed fraction of the measured delta."""

    def speedup(self, threads: int) -> float:
        return 1.0 / (self.serial_fraction + (1.0 - self.serial_fraction) / max(1, threads))

    def bytes_per_change_at(self, fraction: float) -> float:
        """Bytes per change at another changed fraction: gaps between changes cost about
        log2(1 / fraction) bits, so positions grow by log2(measured / fraction) bits."""
        return max(0.1, self.bytes_per_change + math.log2(self.changed_fraction / fraction) / 8.0)

    def decode_s(self, changes: float, threads: int) -> float:
        return self.decode_intercept_s + changes / (self.decode_changes_per_s * self.speedup(threads))

    def update_s(self, changes: float, nbytes: float, threads: int) -> float:
        """One measured-kind update of a rank (no link): fetch + decode + write + fixed."""
        return (self.fixed_s + nbytes / self.fetch_bytes_per_s + self.decode_s(changes, threads)
                + changes / self.write_changes_per_s)


def fit(updates: list[dict], decodes: list[dict], speedup_2: float, bytes_per_change: float,
        changed_fraction: float, checks: list[dict] = ()) -> tuple[Rates, dict]:
    """Rates from measured points, and the fit error on them.

    ``updates``: one rank's update each: ``changes`` (decoded by it), ``bytes`` (fetched),
    ``threads``, ``fetch_s``, ``decode_s``, ``commit_s`` and ``s`` (the whole update).
    ``decodes``: decodes alone: ``changes``, ``threads``, ``s``. ``speedup_2``: measured
    decode time on one thread over two. ``checks``: updates (same fields) whose error is reported
    but that the fit does not use (tensor-parallel ranks: their exchange is not in the model)."""
    if not updates:
        raise ValueError("updates: at least one measured update")
    f = min(1.0, max(0.0, 2.0 / speedup_2 - 1.0)) if speedup_2 > 0 else 1.0

    def s_of(n: int) -> float:
        return 1.0 / (f + (1.0 - f) / max(1, n))

    pts = [(u["changes"], u["threads"], u["decode_s"]) for u in updates]
    pts += [(d["changes"], d["threads"], d["s"]) for d in decodes]
    a = np.array([[1.0, c / s_of(t)] for c, t, _ in pts])
    y = np.array([s for _, _, s in pts])
    (icpt, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
    if slope <= 0:  # one point, or noise: through the origin
        icpt, slope = 0.0, float(y.sum() / a[:, 1].sum())
    icpt = max(0.0, float(icpt))
    rates = Rates(
        decode_changes_per_s=1.0 / float(slope), decode_intercept_s=icpt, serial_fraction=f,
        write_changes_per_s=sum(u["changes"] for u in updates) / max(1e-9, sum(u["commit_s"] for u in updates)),
        fetch_bytes_per_s=sum(u["bytes"] for u in updates) / max(1e-9, sum(u["fetch_s"] for u in updates)),
        fixed_s=max(0.0, statistics.median(u["s"] - u["fetch_s"] - u["decode_s"] - u["commit_s"] for u in updates)),
        bytes_per_change=bytes_per_change, changed_fraction=changed_fraction)
    rows = [{"kind": "update", "measured_s": u["s"], "predicted_s": rates.update_s(u["changes"], u["bytes"], u["threads"])}
            for u in updates]
    rows += [{"kind": "check (not fitted)", "measured_s": u["s"],
              "predicted_s": rates.update_s(u["changes"], u["bytes"], u["threads"])} for u in checks]
    rows += [{"kind": "decode", "measured_s": d["s"], "predicted_s": rates.decode_s(d["changes"], d["threads"])}
             for d in decodes]
    for r in rows:
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
    parts = {"link_s": total_bytes / link, "tree_s": h * CHUNK_BYTES / link,
             "rank_fetch_s": rank_bytes / rates.fetch_bytes_per_s, "decode_s": rates.decode_s(changes, threads),
             "write_s": changes / rates.write_changes_per_s, "fixed_s": rates.fixed_s}
    return {"model": shape.name, "link_gbit": link_gbit, "ranks": ranks, "slices": slices,
            "artifact_gb": round(total_bytes / 1e9, 3), "rank_changes": round(changes), "hops": h,
            **{k: round(v, 3) for k, v in parts.items()}, "s": round(sum(parts.values()), 2)}


def project(rates: Rates, fraction: float = 0.02, threads: int = 8, machines: int = 64,
            shapes: tuple[Shape, ...] = SHAPES, links: tuple[float, ...] = LINKS_GBIT,
            ranks: tuple[int, ...] = RANKS) -> dict:
    """Announce -> every engine serving for each shape, link rate, TP/EP size, with and without
    per-rank slices, beside the published anchors."""
    rows = [project_one(rates, s, link, n, sl, fraction, threads, machines)
            for s in shapes for link in links for n in ranks for sl in (True, False)]
    return {"assumptions": {
        "changed_fraction": fraction, "bytes_per_change": round(rates.bytes_per_change_at(fraction), 4),
        "dtype": "bf16", "decode_threads_per_rank": threads, "ranks_per_machine": RANKS_PER_MACHINE,
        "machines_per_region": machines, "tree_fanout": 4, "chunk_bytes": CHUNK_BYTES,
        "slices": "with slices each rank fetches and decodes its 1/N of the sharded tensors plus what it "
                  "holds whole; without, every rank fetches and decodes the whole artifact",
        "overlap": "none: link time, fetch and apply are added (upper bound)",
        "shapes": [asdict(s) for s in shapes]},
        "rates": asdict(rates), "anchors": list(ANCHORS), "rows": rows}


def lookup(projection: dict, model: str, link_gbit: float, ranks: int, slices: bool = True) -> float:
    for r in projection["rows"]:
        if (r["model"], r["link_gbit"], r["ranks"], r["slices"]) == (model, link_gbit, ranks, slices):
            return float(r["s"])
    raise KeyError(f"no projection row for {model!r} at {link_gbit} Gbit/s, {ranks} ranks")
