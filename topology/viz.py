"""The topology picture: a plan's tree laid out by region, edges labelled with bandwidth.

Each region is a vertical band (the trainer's first, then in the order the
data reaches them); depth in the tree runs downwards. Inside a band the nodes
of one depth are placed in depth-first order, so a relay's children sit
under it. Nodes are coloured by role; an edge that crosses into another
region is drawn dashed. Large plans drop node names and intra-region edge
labels to stay legible.

Uses matplotlib's object API with the Agg canvas (never pyplot), so it
works headless and leaves the caller's backend alone.
"""

from __future__ import annotations

from pathlib import Path

from topology.model import NetworkModel
from topology.tree import Plan

ROLE_COLOURS = {"trainer": "#d62728", "relay": "#ff7f0e", "rollout": "#1f77b4"}
_LABEL_NODES_UP_TO = 60
_LABEL_EDGES_UP_TO = 80


def layout(plan: Plan, regions: dict[str, str]) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """Node positions, and each region's band as (x start, x end)."""
    children = plan.children()
    order: list[str] = []
    stack = [plan.root]
    while stack:  # depth-first preorder
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children.get(n, [])))
    depth = plan.depths()
    region_order: list[str] = []
    for n in order:
        if regions[n] not in region_order:
            region_order.append(regions[n])
    rows: dict[tuple[str, int], list[str]] = {}
    for n in order:
        rows.setdefault((regions[n], depth[n]), []).append(n)
    width = {r: max(len(v) for (rr, _), v in rows.items() if rr == r) for r in region_order}
    bands: dict[str, tuple[float, float]] = {}
    x0 = 0.0
    for r in region_order:
        bands[r] = (x0, x0 + width[r])
        x0 += width[r] + 0.6
    pos = {}
    for (r, d), ns in rows.items():
        a, b = bands[r]
        step = (b - a) / len(ns)
        for i, n in enumerate(ns):
            pos[n] = (a + step * (i + 0.5), -float(d))
    return pos, bands


def draw_plan(plan: Plan, path: str | Path, model: NetworkModel | None = None, title: str | None = None) -> Path:
    """Write the picture of ``plan`` to ``path`` (format from the suffix: .png, .svg, .pdf)."""
    import networkx as nx
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    path = Path(path)
    nodes = plan.nodes
    regions = {n: (model.region_of(n) if model and n in model else plan.regions.get(n) or "?") for n in nodes}
    roles = {n: (model.node(n).role if model and n in model else plan.roles.get(n) or "rollout") for n in nodes}
    pos, bands = layout(plan, regions)
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from((p, c) for c, p in plan.parents.items())
    n = len(nodes)
    span = max(b for _, b in bands.values())
    max_depth = max(-y for _, y in pos.values())
    fig = Figure(figsize=(min(40.0, max(8.0, span * 0.55)), min(30.0, max(4.5, (max_depth + 1) * 1.6 + 1))), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (r, (a, b)) in enumerate(bands.items()):
        ax.axvspan(a - 0.25, b + 0.25, color="#f2f2f2" if i % 2 == 0 else "#e6eef7", zorder=0)
        ax.text((a + b) / 2, 0.55, r, ha="center", va="bottom", fontsize=10, fontweight="bold")
    cross = [(p, c) for c, p in plan.parents.items() if regions[p] != regions[c]]
    inner = [(p, c) for c, p in plan.parents.items() if regions[p] == regions[c]]
    size = 260 if n <= _LABEL_NODES_UP_TO else max(8, 4000 // n)
    nx.draw_networkx_edges(g, pos, edgelist=inner, ax=ax, edge_color="#777777", arrows=True, arrowsize=8,
                           node_size=size, width=0.8)
    nx.draw_networkx_edges(g, pos, edgelist=cross, ax=ax, edge_color="#444444", style="dashed", arrows=True,
                           arrowsize=10, node_size=size, width=1.4)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_size=size, node_color=[ROLE_COLOURS.get(roles[x], "#7f7f7f") for x in nodes],
                           edgecolors="white", linewidths=0.8)
    if n <= _LABEL_NODES_UP_TO:
        for x in nodes:
            px, py = pos[x]
            ax.text(px, py - 0.17, x, ha="center", va="top", fontsize=7.5, color="#222222",
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7})
    labelled = plan.parents.items() if n <= _LABEL_EDGES_UP_TO else [(c, p) for p, c in cross]
    for c, p in labelled:
        bps = plan.edge_bps.get(c, 0.0)
        if not bps > 0:
            continue  # unknown bandwidth (e.g. a tree observed rather than planned): no label
        (x1, y1), (x2, y2) = pos[p], pos[c]
        # Closer to the child than the midpoint, so labels of siblings fan out instead of piling up.
        lx, ly = x1 + (x2 - x1) * 0.78, y1 + (y2 - y1) * 0.78
        label = f"{bps / 1e9:.3g}G" if bps >= 1e9 else f"{bps / 1e6:.3g}M"
        ax.text(lx, ly, label, fontsize=7.5, ha="center", va="center",
                bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": "none", "alpha": 0.85})
    handles = [Line2D([], [], marker="o", linestyle="", color=col, label=role, markersize=8)
               for role, col in ROLE_COLOURS.items() if role in roles.values()]
    handles.append(Line2D([], [], color="#444444", linestyle="--", label="crosses regions"))
    ax.legend(handles=handles, loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_title(title or f"plan epoch {plan.epoch}: {n} nodes, estimated completion {plan.est_completion_s:.2f} s "
                          f"(edge labels: expected bandwidth, bit/s)", fontsize=10)
    ax.set_xlim(-0.6, span + 0.6)
    ax.set_ylim(-max_depth - 0.8, 1.1)
    # networkx hides the axes' ticks; the depth scale is worth keeping.
    ax.tick_params(left=True, labelleft=True)
    ax.set_yticks([-d for d in range(int(max_depth) + 1)])
    ax.set_yticklabels([f"depth {d}" for d in range(int(max_depth) + 1)], fontsize=8)
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    return path
