"""The report written at the end of ``p2psync demo``: PNG figures and one HTML page that shows them.

Figures: reward per step, payload per step against the full bf16 size, per-region
dissemination time per version, and the topology picture of the tree the nodes
actually used (from each node's reported parent).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any


def _figure(width: float = 6.4, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def reward_png(steps: list[dict], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    xs = [s["step"] for s in steps]
    mean = [s.get("reward_mean", math.nan) for s in steps]
    std = [s.get("reward_std", 0.0) for s in steps]
    ax.plot(xs, mean, marker="o", ms=3, label="mean reward of the step's groups")
    ax.fill_between(xs, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title("GRPO reward")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def payload_png(steps: list[dict], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    xs = [s["step"] for s in steps]
    ax.bar(xs, [s.get("payload_bytes", 0) / 1e6 for s in steps], label="p2psync delta (MB)")
    if steps:
        ax.axhline(steps[-1].get("full_bytes", 0) / 1e6, color="tab:red", ls="--", label="full bf16 weights (MB)")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MB shipped per step (log)")
    ax.set_title("payload per step")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def dissemination_png(region_times: dict[int, dict[str, float]], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    regions = sorted({r for t in region_times.values() for r in t})
    versions = sorted(region_times)
    for r in regions:
        ax.plot(versions, [region_times[v].get(r, math.nan) for v in versions], marker=".", label=r)
    ax.set_xlabel("version")
    ax.set_ylabel("seconds to the region's last node")
    ax.set_title("dissemination time per region (status polled every 0.1 s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _edge_rates(nodes: dict[str, Any], parents: dict[str, str], snap: dict[str, Any]) -> dict[str, float]:
    """Median observed rate into each node (bits/s): a version's payload over the arrival gap to its parent.

    Arrivals are polled every 0.1 s, so this is a coarse figure (and a lower bound on small payloads).
    """
    payload = {int(s["version"]): int(s.get("payload_bytes") or 0) for s in snap["steps"] if "version" in s}
    rates: dict[str, float] = {}
    for child, parent in parents.items():
        samples = []
        for v, arr in snap["arrivals"].items():
            if v in payload and payload[v] and child in arr and parent in arr:
                samples.append(8 * payload[v] / max(0.1, arr[child] - arr[parent]))
        if samples:
            samples.sort()
            rates[child] = samples[len(samples) // 2]
    return rates


def topology_png(nodes: dict[str, Any], path: Path, snap: dict[str, Any] | None = None) -> Path | None:
    """The tree the nodes used, drawn with the ``p2psync viz`` code; edges labelled with observed rates."""
    from topology.tree import Plan
    from topology.viz import draw_plan

    roots = [n for n, v in nodes.items() if v.role == "trainer"]
    if not roots:
        return None
    root = roots[0]
    parents = {n: (v.parent if v.parent in nodes else root) for n, v in nodes.items() if n != root}
    rates = _edge_rates(nodes, parents, snap) if snap else {}
    plan = Plan(root=root, parents=parents, edge_bps={n: rates.get(n, 0.0) for n in parents}, eta_s={},
                est_completion_s=0.0,
                regions={n: v.region for n, v in nodes.items()}, roles={n: v.role for n, v in nodes.items()})
    return draw_plan(plan, path, title="tree used (parents reported by the nodes; edges: median observed "
                                       "delta rate, coarse)")


def write(out: Path, snap: dict[str, Any], region_times: dict[int, dict[str, float]], summary: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    figs = [reward_png(snap["steps"], out / "reward.png"), payload_png(snap["steps"], out / "payload.png"),
            dissemination_png(region_times, out / "dissemination.png")]
    try:
        topo = topology_png(snap["nodes"], out / "topology.png", snap)
        if topo:
            figs.append(topo)
    except Exception as exc:  # noqa: BLE001 - a picture must not sink the report
        summary.setdefault("notes", []).append(f"topology picture failed: {exc!r}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    rows = "".join(
        f"<tr><td>{s.get('step')}</td><td>{s.get('version')}</td><td>{s.get('reward_mean', math.nan):.3f}</td>"
        f"<td>{100 * s.get('changed_fraction', 0):.3f}</td><td>{s.get('payload_bytes', 0):,}</td>"
        f"<td>{s.get('full_bytes', 0) / max(1, s.get('payload_bytes', 1)):.0f}x</td>"
        f"<td>{s.get('step_s', math.nan):.2f}</td></tr>" for s in snap["steps"])
    ok = summary.get("ok")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>p2psync demo report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}img{{max-width:48%;margin:1%}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
.ok{{color:#080}}.bad{{color:#c00}}</style></head><body>
<h1>p2psync demo</h1>
<p class="{'ok' if ok else 'bad'}"><b>{html.escape(summary.get('verdict', ''))}</b></p>
<pre>{html.escape(json.dumps({k: v for k, v in summary.items() if k != 'mismatches'}, indent=1, default=str))}</pre>
{''.join(f'<img src="{f.name}" alt="{f.stem}">' for f in figs)}
<h2>steps</h2><table><tr><th>step</th><th>version</th><th>reward</th><th>changed %</th><th>payload bytes</th>
<th>smaller than full</th><th>step s</th></tr>{rows}</table>
</body></html>"""
    index = out / "index.html"
    index.write_text(page)
    return index
