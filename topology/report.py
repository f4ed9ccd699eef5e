"""Plain-text views of a model and a plan, for ``p2psync plan`` and the scale study."""

from __future__ import annotations

from collections.abc import Sequence

from topology.model import NetworkModel
from topology.tree import Plan, bfs_order


def fmt_bps(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:.2f}G"
    if bps >= 1e6:
        return f"{bps / 1e6:.0f}M"
    return f"{bps / 1e3:.0f}k"


def format_matrix(model: NetworkModel, max_nodes: int = 12) -> str:
    """The bandwidth matrix: per node pair when the model is small, per region pair otherwise.

    Per region pair it shows the per-flow bandwidth / RTT that estimates
    unmeasured pairs, and how many pairs were measured.
    """
    ids = model.node_ids
    lines = []
    if len(ids) <= max_nodes:
        lines.append(f"bandwidth (bits/s) from row to column, * = measured; {len(ids)} nodes")
        w = max(len(n) for n in ids) + 1
        lines.append(" " * w + "".join(f"{n[-7:]:>8}" for n in ids))
        for a in ids:
            cells = []
            for b in ids:
                cells.append(f"{'-':>8}" if a == b else f"{fmt_bps(model.bandwidth(a, b)) + ('*' if model.is_measured(a, b) else ' '):>8}")
            lines.append(f"{a:<{w}}" + "".join(cells))
        return "\n".join(lines)
    regions = model.region_names()
    by_region = model.by_region()
    measured: dict[tuple[str, str], int] = {}
    for m in model.measurements():
        key = (model.region_of(m.src), model.region_of(m.dst))
        measured[key] = measured.get(key, 0) + 1
    lines.append(f"{len(ids)} nodes in {len(regions)} regions; per-flow bandwidth / RTT from row region to column region"
                 f" ({len(model.measurements())} measured pairs)")
    w = max(len(r) for r in regions) + 9
    lines.append(" " * w + "".join(f"{r:>14}" for r in regions))
    for a in regions:
        cells = [f"{fmt_bps(model.region_bandwidth(a, b)) + '/' + format(model.region_rtt(a, b) * 1e3, '.0f') + 'ms':>14}" for b in regions]
        lines.append(f"{a + ' (' + str(len(by_region[a])) + ')':<{w}}" + "".join(cells))
    return "\n".join(lines)


def format_plan(plan: Plan, max_lines: int = 60) -> str:
    """The tree, one node per line (indented by depth) with its edge bandwidth and estimated finish.

    Large plans are summarised: the path into every region, then per region
    its size, depth and slowest edge.
    """
    children = plan.children()
    depth = plan.depths()
    head = (f"plan epoch {plan.epoch}: {len(plan.nodes)} nodes, root {plan.root}, "
            f"estimated completion {plan.est_completion_s:.2f} s "
            f"(payload {plan.payload_bytes / 2**20:.0f} MiB, chunk {plan.chunk_bytes / 2**20:.0f} MiB)")
    lines = [head]
    if len(plan.nodes) <= max_lines:
        def walk(n: str) -> None:
            region = plan.regions.get(n, "")
            edge = "" if n == plan.root else f"  <- {fmt_bps(plan.edge_bps[n])}bit/s"
            lines.append(f"{'  ' * depth[n]}{n} [{region}]{edge}  eta {plan.eta_s.get(n, 0.0):.2f} s")
            for c in children.get(n, ()):
                walk(c)
        walk(plan.root)
        return "\n".join(lines)
    lines.append("entries (edges that cross into a region):")
    for n in bfs_order(children, plan.root):
        p = plan.parents.get(n)
        if p is not None and plan.regions.get(p) != plan.regions.get(n):
            lines.append(f"  {p} [{plan.regions.get(p)}] -> {n} [{plan.regions.get(n)}]  {fmt_bps(plan.edge_bps[n])}bit/s"
                         f"  depth {depth[n]}  eta {plan.eta_s[n]:.2f} s")
    lines.append("regions:")
    per: dict[str, list[str]] = {}
    for n in plan.parents:
        per.setdefault(plan.regions.get(n, ""), []).append(n)
    for r in sorted(per):
        ns = per[r]
        slow = min(ns, key=lambda n: plan.edge_bps[n])
        last = max(ns, key=lambda n: plan.eta_s[n])
        lines.append(f"  {r}: {len(ns)} nodes, depth {min(depth[n] for n in ns)}-{max(depth[n] for n in ns)}, "
                     f"slowest edge {fmt_bps(plan.edge_bps[slow])}bit/s, last {last} at {plan.eta_s[last]:.2f} s")
    return "\n".join(lines)


def format_scores(rows: Sequence[tuple[str, float]], reference: float | None = None) -> str:
    """``name  seconds  (x reference)`` lines."""
    w = max(len(name) for name, _ in rows)
    out = []
    for name, t in rows:
        ratio = f"  {t / reference:6.2f}x" if reference else ""
        out.append(f"  {name:<{w}}  {t:9.2f} s{ratio}")
    return "\n".join(out)
