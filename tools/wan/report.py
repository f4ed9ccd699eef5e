"""What ``tools/bench_wan.py`` makes of its runs: bounds, cost, medians and spreads, tables, targets, charts.

Every method runs ``--repeat`` times (interleaved); a row holds, per method and payload,
the median and the spread (min-max) over the runs of both times p2psync reports: "holds"
(the last machine holds every chunk, verified) and "applied" (the last machine decoded,
checked and wrote it: its engine serves the version), and the load average each run
started under.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def lower_bound(cfg, payload_bytes: int) -> float:
    """No scheme beats, for any machine, its payload over the path's tightest cap plus the one-way delay."""
    t = next(m for m in cfg.machines() if m.role == "trainer")
    worst = 0.0
    for m in cfg.machines():
        if m.role == "trainer":
            continue
        cap = cfg.path_mbit(t, m) * 1e6
        worst = max(worst, payload_bytes * 8 / cap + cfg.one_way_ms(t.region, m.region) / 1000)
    return worst


def tokens_per_dollar(cfg, sync_s: float, rollout_s: float) -> float:
    """A synchronous RL step: every rollout machine generates for ``rollout_s``, then waits ``sync_s`` for the
    new weights; every machine (trainer included) is paid for the whole step."""
    ms = cfg.machines()
    tokens = sum(cfg.tokens_per_s[m.node_class] * rollout_s for m in ms if m.role != "trainer")
    dollars = sum(cfg.prices[m.node_class] for m in ms) * (rollout_s + sync_s) / 3600
    return tokens / dollars


def spread(values: list[float | None]) -> dict:
    """Median, min, max and count of the runs that finished (None: a run that timed out)."""
    done = [v for v in values if v is not None]
    if not done:
        return {"median": None, "min": None, "max": None, "runs": 0, "failed": len(values)}
    return {"median": round(statistics.median(done), 3), "min": round(min(done), 3), "max": round(max(done), 3),
            "runs": len(done), "failed": len(values) - len(done)}


def _times(method: str, run: dict) -> tuple[float | None, float | None]:
    """(holds, applied) of one run of one payload; p2psync on the others' clock (the trainer's announcement)."""
    if method.startswith("p2psync"):
        return run.get("announced_to_received_s"), run.get("announced_to_applied_s")
    return run.get("seconds"), None


def rows_of(cfg, art: dict, results: dict[str, list[dict]], rollout_s: float) -> list[dict]:
    """One row per method and payload over its runs (``results[method]``: one dict per run, payload -> result)."""
    rows = []
    for method, runs in results.items():
        kinds = list(dict.fromkeys(k for r in runs for k in r if k not in ("snapshot-cold", "load", "rep")))
        for kind in kinds:
            per = [r[kind] for r in runs if kind in r]
            payload = per[0].get("payload_bytes") or art[f"{kind}_bytes"]
            lb = lower_bound(cfg, payload)
            holds = spread([_times(method, p)[0] for p in per])
            applied = spread([_times(method, p)[1] for p in per]) if method.startswith("p2psync") else None
            s = holds["median"]
            rows.append({"method": method, "payload": kind, "bytes": payload, "seconds": s, "holds": holds,
                         "applied_s": applied["median"] if applied else None, "applied": applied,
                         "loads": [r.get("load") for r in runs if kind in r],
                         "lower_bound_s": round(lb, 4), "x_lower_bound": None if s is None else round(s / lb, 2),
                         "tokens_per_dollar": None if s is None else round(tokens_per_dollar(cfg, s, rollout_s)),
                         "bit_exact": all(p.get("bit_exact", True) for p in per)})
    return rows


def _cell(sp: dict | None) -> str:
    if not sp or sp["median"] is None:
        return "-" if not sp else "timeout"
    fail = f", {sp['failed']} timed out" if sp["failed"] else ""
    return f"{sp['median']} ({sp['min']}-{sp['max']}{fail})" if sp["runs"] > 1 else f"{sp['median']}{fail}"


def markdown(rows: list[dict], cfg, rollout_s: float) -> str:
    tree = {r["payload"]: r["seconds"] for r in rows if r["method"] == "p2psync-tree"}
    ideal = tokens_per_dollar(cfg, 0.0, rollout_s)
    out = ["| method | payload | MB | runs | last machine holds it (s): median (min-max) | p2psync: last machine "
           "applied (s) | lower bound (s) | x bound | x p2psync tree | rollout tokens per $ "
           f"(no-sync ideal {ideal:,.0f}) | load average at the runs' start |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s = r["seconds"]
        ref = tree.get("snapshot") if r["method"] == "gloo" else tree.get(r["payload"])
        ratio = f"{s / ref:.2f}x" if s and ref else "-"
        loads = [x for x in r["loads"] if x is not None]
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
        out.append(f"| {r['method']} | {r['payload']} | {r['bytes'] / 1e6:.2f} | {r['holds']['runs']} | "
                   f"{_cell(r['holds'])} | {_cell(r['applied'])} | {r['lower_bound_s']} | {r['x_lower_bound'] or '-'} | "
                   f"{ratio} | {'-' if r['tokens_per_dollar'] is None else format(r['tokens_per_dollar'], ',')} | "
                   f"{load} |")
    return "\n".join(out)


def targets(rows: list[dict]) -> list[dict]:
    """The targets for the default options, each as measured (medians) / required."""
    get = {(r["method"], r["payload"]): r for r in rows}

    def med(m: str, k: str, what: str = "holds") -> float | None:
        r = get.get((m, k))
        return r[what]["median"] if r and r.get(what) else None

    out = []
    d, star = med("p2psync-tree", "delta"), med("p2psync-star", "delta")
    if d:
        lb = get[("p2psync-tree", "delta")]["lower_bound_s"]
        out.append({"target": "delta to the last machine within 1.5x of the lower bound", "measured": round(d / lb, 2),
                    "required": "<= 1.5", "met": d / lb <= 1.5})
        if star:
            out.append({"target": "tree within 0.6x of the star (delta, holds)", "measured": round(d / star, 2),
                        "required": "<= 0.6", "met": d / star <= 0.6})
        for m, k, need, what in (("http-unicast", "snapshot", 50, ">= 50x faster than full-weight unicast"),
                                 ("shardcast", "delta", 3, ">= 3x faster than shardcast on the delta file")):
            o = med(m, k)
            if o:
                out.append({"target": what, "measured": round(o / d, 2), "required": f">= {need}",
                            "met": o / d >= need})
    da, sa = med("p2psync-tree", "delta", "applied"), med("p2psync-star", "delta", "applied")
    if d and da:
        out.append({"target": "tree: last machine applied within 2x of the last machine holding it (delta)",
                    "measured": round(da / d, 2), "required": "<= 2", "met": da / d <= 2})
    if da and sa:
        out.append({"target": "tree applied no later than the star applied (delta)", "measured": round(da / sa, 2),
                    "required": "<= 1", "met": da <= sa})
    s, o = med("p2psync-tree", "snapshot"), med("shardcast", "snapshot")
    if s and o:
        out.append({"target": ">= 1.5x faster than shardcast on the full snapshot", "measured": round(o / s, 2),
                    "required": ">= 1.5", "met": o / s >= 1.5})
    return out


def chart(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.38
    for k, (kind, colour) in enumerate((("delta", "#1f77b4"), ("snapshot", "#ff7f0e"))):
        xs, ys, lo, hi, lbs = [], [], [], [], []
        for i, m in enumerate(methods):
            r = next((r for r in rows if r["method"] == m and r["payload"] == kind and r["seconds"]), None)
            if r:
                xs.append(i + (k - 0.5) * width)
                ys.append(r["seconds"])
                lo.append(r["seconds"] - r["holds"]["min"])
                hi.append(r["holds"]["max"] - r["seconds"])
                lbs.append(r["lower_bound_s"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{kind} payload (median, min-max)", color=colour)
        ax.scatter(xs, lbs, marker="_", s=400, color="black", zorder=3,
                   label="lower bound" if k == 0 else None)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_yscale("log")
    ax.set_ylabel("time to last machine (s, log)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_chart(points: list[dict], path: Path, art: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("delta", "snapshot")):
        for regions, style in ((2, "-"), (3, "-."), (4, "--")):
            ps = sorted((p for p in points if p["regions"] == regions), key=lambda p: p["machines"])
            if not ps:
                continue
            xs = [p["machines"] for p in ps]
            for key, colour in (("tree", "#1f77b4"), ("star", "#d62728")):
                ax.plot(xs, [p[f"{key}_{kind}_s"] or float("nan") for p in ps], style, marker="o", color=colour,
                        label=f"{key}, {regions} regions")
            ax.plot(xs, [p[f"{kind}_lower_bound_s"] for p in ps], style, color="grey",
                    label=f"lower bound, {regions} regions")
        ax.set_xlabel("receiving machines")
        ax.set_ylabel("time to last machine (s)")
        ax.set_title(f"{kind} ({art[f'{kind}_bytes'] / 1e6:.1f} MB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
