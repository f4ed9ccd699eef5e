"""The report's pictures (PNG, matplotlib's object API on the Agg canvas: headless, no pyplot)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

ROLE_COLOURS = {"trainer": "#d62728", "relay": "#ff7f0e", "rollout": "#1f77b4"}


def _figure(width: float = 6.4, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    return path


def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def reward_png(steps: list[dict], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    xs = [s["step"] for s in steps]
    mean = [s.get("reward_mean", math.nan) for s in steps]
    acc = [s.get("accuracy", math.nan) for s in steps]
    ax.plot(xs, mean, marker="o", ms=3, label="mean reward of the step's groups")
    if any(abs(a - m) > 1e-9 for a, m in zip(acc, mean) if a == a and m == m):  # shaped reward: both differ
        ax.plot(xs, acc, marker=".", ms=3, ls=":", color="tab:green", label="share of exact answers")
    if len(mean) >= 3:
        k = 3
        smooth = [sum(mean[max(0, i - k + 1): i + 1]) / len(mean[max(0, i - k + 1): i + 1]) for i in range(len(mean))]
        ax.plot(xs, smooth, color="tab:blue", lw=2.2, alpha=0.5, label="reward, mean of 3 steps")
    _integer_x(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.02)
    ax.set_title("GRPO reward (the rollout nodes' samples, scored by the trainer)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def payload_png(steps: list[dict], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    xs = [s["step"] for s in steps]
    ax.bar(xs, [max(1, s.get("payload_bytes", 0)) / 1e6 for s in steps], color="tab:blue",
           label="p2psync delta of the step")
    full = max((s.get("full_bytes", 0) for s in steps), default=0)
    if full:
        ax.axhline(full / 1e6, color="tab:red", ls="--", label=f"full bf16 weights ({full / 1e6:.1f} MB)")
    ax.set_yscale("log")
    shipped = [s.get("payload_bytes", 0) for s in steps if s.get("payload_bytes")]
    if shipped and full:
        ax.set_ylim(min(shipped) / 1e6 / 4, full / 1e6 * 3)
    _integer_x(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MB per step (log scale)")
    ax.set_title("bytes shipped per step: delta vs full weights")
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(loc="center right", fontsize=8)
    return _save(fig, path)


def dissemination_png(timings: dict[str, Any], path: Path) -> Path:
    """Per delta version: each region's last node holding it (lines) and every node's engine serving
    it (dots), seconds after the trainer announced it; all times are the nodes' own."""
    fig = _figure(7.2, 3.8)
    ax = fig.add_subplot()
    regions = sorted({r for t in timings.get("region_held", {}).values() for r in t})
    colours = {r: f"C{i}" for i, r in enumerate(regions)}
    held = timings.get("region_held", {})
    versions = sorted(held)
    for r in regions:
        ax.plot(versions, [held[v].get(r, math.nan) for v in versions], marker="o", ms=3, color=colours[r],
                label=f"{r}: last node holds it")
    node_regions = timings.get("regions", {})
    roles = timings.get("roles", {})
    for r in regions:
        xs, ys = [], []
        for v in timings.get("deltas", []):
            for node, d in timings.get("delays", {}).get(v, {}).items():
                if node_regions.get(node) == r and roles.get(node) == "rollout" and "engine" in d:
                    xs.append(v)
                    ys.append(d["engine"])
        if xs:
            ax.scatter(xs, ys, s=9, marker="x", color=colours[r], alpha=0.6, label=f"{r}: an engine serves it")
    _integer_x(ax)
    ax.set_xlabel("version (delta)")
    ax.set_ylabel("seconds after the announcement")
    ax.set_title("dissemination per region (node timestamps, not polling)")
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    if regions:
        ax.legend(fontsize=7.5, loc="upper right", ncol=2)
    return _save(fig, path)


def tree_png(tree: dict[str, Any], roles: dict[str, str], regions: dict[str, str], root: str, path: Path) -> Path:
    """The coordinator's plan (grey arrows) and the parents the nodes pulled from (blue when they
    match the plan, red and labelled with the reason when they do not)."""
    from matplotlib.lines import Line2D

    from topology.tree import Plan
    from topology.viz import layout

    plan = {c: p for c, p in tree["plan"].items() if c in roles and p in roles}
    for n in roles:  # a node the plan does not place is drawn under the root
        if n != root and n not in plan:
            plan[n] = root
    p = Plan(root=root, parents=plan, edge_bps={}, eta_s={}, est_completion_s=0.0, regions=dict(regions),
             roles=dict(roles))
    pos, bands = layout(p, {n: regions.get(n, "?") for n in p.nodes})
    span = max(b for _, b in bands.values())
    depth = max(-y for _, y in pos.values())
    fig = _figure(max(8.0, span * 1.6), max(3.4, (depth + 1) * 1.2 + 1.0))
    ax = fig.add_subplot()
    for i, (r, (a, b)) in enumerate(bands.items()):
        ax.axvspan(a - 0.3, b + 0.3, color="#f2f2f2" if i % 2 == 0 else "#e6eef7", zorder=0)
        ax.text((a + b) / 2, 0.5, f"region {r}", ha="center", va="bottom", fontsize=10, fontweight="bold")

    def arrow(a: str, b: str, **kw: Any) -> None:
        ax.annotate("", xy=pos[b], xytext=pos[a], zorder=kw.pop("zorder", 1),
                    arrowprops=dict(arrowstyle="-|>", shrinkA=11, shrinkB=11, **kw))

    for c, par in tree["plan"].items():
        if c in pos and par in pos:
            arrow(par, c, color="#999999", lw=5, alpha=0.45)
    for n, info in tree["nodes"].items():
        for par in info.get("used_counts", {}):
            if n not in pos or par not in pos:
                continue
            if par == info.get("planned"):
                arrow(par, n, color="#1f77b4", lw=1.6, zorder=3)
            else:
                arrow(par, n, color="#d62728", lw=1.6, ls="--", zorder=3, connectionstyle="arc3,rad=0.25")
                (x1, y1), (x2, y2) = pos[par], pos[n]
                # beside the arc's middle (rad 0.25 bends it to the right of the par -> n direction)
                mx, my = (x1 + x2) / 2 + 0.25 * (y2 - y1) / 2, (y1 + y2) / 2 - 0.25 * (x2 - x1) / 2
                ax.text(mx, my, (info.get("reason") or "")[:60], color="#d62728", fontsize=7, ha="center",
                        va="center", zorder=6,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "#d62728", "alpha": 0.9})
    for n, (x, y) in pos.items():
        ax.scatter([x], [y], s=320, color=ROLE_COLOURS.get(roles.get(n, ""), "#7f7f7f"), zorder=4,
                   edgecolors="white")
        ax.text(x, y - 0.2, n, ha="center", va="top", fontsize=8, zorder=5,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    handles = [Line2D([], [], marker="o", ls="", color=c, label=r, markersize=8) for r, c in ROLE_COLOURS.items()]
    handles += [Line2D([], [], color="#999999", lw=5, alpha=0.45, label="planned parent"),
                Line2D([], [], color="#1f77b4", lw=1.6, label="pulled from (as planned)"),
                Line2D([], [], color="#d62728", lw=1.6, ls="--", label="pulled from (not planned)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=6, fontsize=7.5,
              framealpha=0.9)
    ax.set_title("dissemination tree: the coordinator's plan and the parents the nodes used", fontsize=10)
    ax.set_xlim(-0.7, span + 0.7)
    ax.set_ylim(-depth - 0.9, 1.0)
    ax.set_axis_off()
    return _save(fig, path)
