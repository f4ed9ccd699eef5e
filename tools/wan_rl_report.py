"""The report of ``tools/bench_wan_rl.py``: one row per mode, the target, the markdown table and the chart.

``write_outputs`` turns a run's document (header, testbed, per-mode results) into
``wan_rl<TAG>.json/.md/.png``; ``bench_wan_rl.py --render FILE`` calls it again on a
saved run's JSON.
"""

from __future__ import annotations

import json
from pathlib import Path


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _round(x: float | None, n: int = 3) -> float | None:
    return None if x is None else round(x, n)


def rows_of(results: dict[str, list[dict]], cfg, rollout_s: float) -> list[dict]:
    """One row per mode: the median over every measured step of every round; ratios to nosync (and per round,
    to the nosync run of the same round, since the host's load drifts between rounds)."""
    from bench_wan import tokens_per_dollar

    def pooled(rs: list[dict]) -> float | None:
        m = median([x for r in rs for x in r["step_s"]])
        return None if m is None else round(m, 3)

    base = results.get("nosync") or []
    base_step = pooled(base)
    base_tpd = median([r["tokens_per_dollar"] for r in base])
    rows = []
    for mode, rs in results.items():
        step = pooled(rs)
        tpd = median([r["tokens_per_dollar"] for r in rs])
        over = None if step is None or base_step is None else max(0.0, step - base_step)
        per_round = [None if not (b["median_step_s"] and r["median_step_s"]) else round(r["median_step_s"] / b["median_step_s"], 3)
                     for r, b in zip(rs, base)]
        rows.append({
            "mode": mode, "median_step_s": step,
            "x_nosync": None if step is None or not base_step else round(step / base_step, 3),
            "x_nosync_per_round": per_round,
            "median_sync_s": _round(median([r["median_sync_s"] for r in rs])),
            "tokens": sum(r["tokens"] for r in rs), "tokens_per_s": _round(median([r["tokens_per_s"] for r in rs]), 1),
            "payload_bytes_per_step": median([r["payload_bytes_per_step"] for r in rs]),
            "full_bytes": rs[0]["full_bytes"] if rs else None,
            "bytes_in_rollouts": median([r["bytes_in_rollouts"] for r in rs]),
            "tokens_per_dollar": _round(tpd, 1),
            "tokens_per_dollar_x_nosync": None if tpd is None or not base_tpd else round(tpd / base_tpd, 3),
            # The cost model at the config's token rates (bench_wan.py): a step of rollout_s of
            # generation plus this mode's measured overhead over nosync, every machine paid throughout.
            "tokens_per_dollar_config": None if over is None else round(tokens_per_dollar(cfg, over, rollout_s)),
            "bit_exact": all(r["bit_exact"] for r in rs), "ok": all(r["ok"] for r in rs),
        })
    return rows


def target(rows: list[dict]) -> dict | None:
    get = {r["mode"]: r for r in rows}
    if "p2psync" not in get or "nosync" not in get or get["p2psync"]["x_nosync"] is None:
        return None
    x = get["p2psync"]["x_nosync"]
    return {"target": "RL step time with p2psync within 5 % of the no-sync ideal", "measured": x,
            "required": "<= 1.05", "met": x <= 1.05}


def markdown(rows: list[dict], goal: dict | None) -> str:
    out = [("| mode | median step (s) | x no-sync (per round) | sync latency (s) | tokens | tokens/s | payload per step (MB) "
            "| into rollout nodes, whole run (MB) | tokens per $ (measured) | x no-sync | tokens per $ (config rates) "
            "| bit-exact |"),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(x, fmt="{}"):
        return "-" if x is None else fmt.format(x)

    for r in rows:
        rounds = ", ".join(f(x) for x in r["x_nosync_per_round"])
        out.append(f"| {r['mode']} | {f(r['median_step_s'])} | {f(r['x_nosync'])} ({rounds}) | {f(r['median_sync_s'])} | "
                   f"{r['tokens']:,} | {f(r['tokens_per_s'])} | {f(r['payload_bytes_per_step'] and r['payload_bytes_per_step'] / 1e6, '{:.3f}')} | "
                   f"{f(r['bytes_in_rollouts'] and r['bytes_in_rollouts'] / 1e6, '{:.1f}')} | "
                   f"{f(r['tokens_per_dollar'], '{:,.0f}')} | {f(r['tokens_per_dollar_x_nosync'])} | "
                   f"{f(r['tokens_per_dollar_config'], '{:,}')} | {'yes' if r['bit_exact'] else 'NO'} |")
    if goal:
        out.append("")
        out.append(f"- {goal['target']}: {goal['measured']} (needs {goal['required']}): "
                   f"{'met' if goal['met'] else 'MISSED'}")
    return "\n".join(out)


def chart(rows: list[dict], results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"nosync": "#2ca02c", "p2psync": "#1f77b4", "full": "#d62728"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, r in enumerate(rows):
        steps = [s for rr in results[r["mode"]] for s in rr["step_s"]]
        a.bar(i, r["median_step_s"] or 0, 0.6, color=colours.get(r["mode"], "grey"))
        a.scatter([i] * len(steps), steps, s=8, color="black", zorder=3)
        if r["x_nosync"]:
            a.text(i, (r["median_step_s"] or 0) * 1.02, f"{r['x_nosync']:.2f}x", ha="center", va="bottom")
        b.bar(i, (r["payload_bytes_per_step"] or 0) / 1e6, 0.6, color=colours.get(r["mode"], "grey"))
    names = [r["mode"] for r in rows]
    a.set_xticks(range(len(rows)), names)
    a.set_ylabel("GRPO step time (s): median, dots = steps")
    a.set_title("step time")
    b.set_xticks(range(len(rows)), names)
    b.set_ylabel("weight-sync payload per step (MB)")
    b.set_title("bytes per version")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(doc: dict, out: Path, tag: str) -> list[dict]:
    """Rows, target, JSON, markdown table and chart from a run's ``doc`` (header, testbed, results)."""
    from p2psync.testbed.config import from_dict

    cfg = from_dict(doc["testbed"])
    w = doc["workload"]
    rows = rows_of(doc["results"], cfg, doc.get("rollout_seconds", 60.0))
    goal = None if doc.get("concurrent") else target(rows)  # side by side, the modes shared the CPU
    doc.update(rows=rows, target=goal)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"wan_rl{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(rows, goal)
    if doc.get("concurrent"):
        table += "\n\n(--concurrent: the modes ran side by side; step times are not comparable)"
    (out / f"wan_rl{tag}.md").write_text(table + "\n")
    full = next((r["full_bytes"] for r in rows if r["full_bytes"]), 0)
    chart(rows, doc["results"], out / f"wan_rl{tag}.png",
          f"GRPO on {len(cfg.machines()) - 1} rollout machines in {', '.join(r.name for r in cfg.regions)} "
          f"({w['preset']}, {full / 1e6:.1f} MB bf16, lr {w['lr']:g}, k={w['max_staleness']}, {w['rounds']} round(s))")
    print(table)
    return rows
