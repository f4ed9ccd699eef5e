"""Scale study of the planner: tree quality in the flow simulator, planning time, re-planning moves.

    .venv/bin/python tools/plan_scale.py            # writes docs/benchmarks/topology.md and its PNGs
    .venv/bin/python tools/plan_scale.py --nodes 100000 --json docs/benchmarks/plan_100k.json

The generated part of docs/benchmarks/topology.md ends where the hand-written
"## Probing live nodes" section starts; that section and what follows are kept.

1. 4 regions x 8 machines (+ trainer), realistic capacities (intra 10 Gbit/s,
   inter 0.2-1 Gbit/s, trainer uplink 1 Gbit/s, dc/cloud/edge machines),
   several seeds, with and without measured pairs: simulated completion of
   the planned tree vs the lower bounds, the star, fixed tiers and a random tree.
2. 10,000 machines in 20 regions: planning time.
3. One failure at that scale (the busiest relay, and a random machine):
   nodes moved by re-planning.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from topology.incremental import Replanner  # noqa: E402
from topology.tree import estimate  # noqa: E402
from topology.baselines import fixed_tiers_tree, flow_lower_bound, random_tree, star_tree, tree_lower_bound  # noqa: E402
from topology.fallbacks import moved_nodes  # noqa: E402
from topology.planner import PlannerConfig, plan  # noqa: E402
from topology.replan import replan  # noqa: E402
from topology.simulator import simulate  # noqa: E402
from topology.synthetic import synthetic_model  # noqa: E402
from topology.viz import draw_plan  # noqa: E402

SCHEMES = ("planned", "star", "fixed tiers", "random")
KEEP_FROM = "## Probing live nodes"


def small_study(seeds: list[int], cfg: PlannerConfig) -> list[dict]:
    rows = []
    for measured in (0.0, 0.3):
        for seed in seeds:
            m = synthetic_model(4, 8, seed=seed, measured_fraction=measured)
            t0 = time.perf_counter()
            p = plan(m, cfg)
            plan_s = time.perf_counter() - t0
            unrefined = plan(m, dataclasses.replace(cfg, refine_budget=0))
            trees = {"planned": p.parents, "no local search": unrefined.parents, "star": star_tree(m),
                     "fixed tiers": fixed_tiers_tree(m), "random": random_tree(m, seed, cfg.max_degree)}
            sim = {k: simulate(m, v, cfg.payload_bytes, cfg.chunk_bytes).makespan_s for k, v in trees.items()}
            rows.append({
                "seed": seed, "measured": measured, "plan_s": plan_s, "est": p.est_completion_s, **sim,
                "tree_lb": tree_lower_bound(m, cfg.payload_bytes).completion_s,
                "flow_lb": flow_lower_bound(m, cfg.payload_bytes).completion_s,
                "model": m, "plan": p,
            })
    return rows


def big_study(cfg: PlannerConfig, repeats: int) -> dict:
    m = synthetic_model(20, 500, seed=0)
    times = []
    p = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = plan(m, cfg)
        times.append(time.perf_counter() - t0)
    assert p is not None
    ch = p.children()
    depth = p.depths()
    busiest = max(p.parents, key=lambda n: (len(ch[n]), -depth[n], n))
    victims = {"busiest relay": busiest, "random machine": random.Random(1).choice(sorted(p.parents))}
    failures = {}
    for label, victim in victims.items():
        t0 = time.perf_counter()
        q = replan(p, m.without_nodes([victim]), cfg)
        dt = time.perf_counter() - t0
        moved = moved_nodes(p, q)
        failures[label] = {"victim": victim, "children": len(ch[victim]), "moved": len(moved),
                           "frac": len(moved) / len(q.parents), "est_before": p.est_completion_s,
                           "est_after": q.est_completion_s, "replan_s": dt}
    return {"nodes": len(m), "times": times, "est": p.est_completion_s, "max_depth": max(depth.values()),
            "entries": sum(1 for c, x in p.parents.items() if p.regions[c] != p.regions[x]), "failures": failures}


def scale_run(nodes: int, cfg: PlannerConfig, repeats: int) -> dict:
    """One size: plan (repeated), one failure re-planned incrementally, quality by estimate and bounds.

    Regions: 20 up to 10,000 machines, 50 above (20 x 500 and 50 x 2,000 as in issue 46). Times are
    CPU seconds of this process (the VM is shared; wall clock is reported beside them).
    """
    regions = 20 if nodes <= 10_000 else 50
    per = max(1, round(nodes / regions))
    m = synthetic_model(regions, per, seed=0)
    cpu, wall = [], []
    p = None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        p = plan(m, cfg)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    assert p is not None
    ch, depth = p.children(), p.depths()
    busiest = max(p.parents, key=lambda n: (len(ch[n]), -depth[n], n))
    inner = max((n for n in p.parents if ch[n] and depth[n] >= 3), key=lambda n: (len(ch[n]), -depth[n], n))
    failures = {}
    for label, victim in (("busiest relay", busiest), ("busiest relay at depth >= 3", inner),
                          ("random machine", random.Random(1).choice(sorted(p.parents)))):
        rcpu, rwall, change = [], [], None
        for _ in range(repeats):
            r = Replanner(p, m, cfg)  # holding state: built once when the coordinator adopts a plan
            c0, t0 = time.process_time(), time.perf_counter()
            change = r.fail(victim)
            rcpu.append(time.process_time() - c0)
            rwall.append(time.perf_counter() - t0)
        assert change is not None
        failures[label] = {"victim": victim, "depth": depth[victim], "children": len(ch[victim]),
                           "subtree": len(_subtree(ch, victim)), "moved": len(change.moved), "touched": change.touched,
                           "replan_s": statistics.median(rcpu), "replan_wall_s": statistics.median(rwall),
                           "est_after": change.plan.est_completion_s}
    events = _events(p, m, cfg, repeats)
    tb = tree_lower_bound(m, cfg.payload_bytes).completion_s
    fb = flow_lower_bound(m, cfg.payload_bytes).completion_s
    star = estimate(m, m.trainer, star_tree(m), cfg.payload_bytes, cfg.chunk_bytes).completion_s
    tiers = estimate(m, m.trainer, fixed_tiers_tree(m), cfg.payload_bytes, cfg.chunk_bytes).completion_s
    main = failures["busiest relay"]
    return {
        "nodes": len(m), "regions": regions, "per_region": per,
        "plan_s": statistics.median(cpu), "plan_s_all": cpu, "plan_wall_s": wall,
        "replan_s": {"failure": main["replan_s"], **{k: e["replan_s"] for k, e in events.items()}},
        "replan_moved": {"failure": main["moved"], **{k: e["moved"] for k, e in events.items()}},
        "failures": failures, "events": events,
        "est_s": p.est_completion_s, "tree_bound_s": tb, "flow_bound_s": fb,
        "est_vs_bound": p.est_completion_s / tb, "est_vs_flow_bound": p.est_completion_s / fb,
        "star_est_s": star, "fixed_tiers_est_s": tiers, "max_depth": max(depth.values()),
        "machine": f"{os.cpu_count()}-core VM shared with other work, pinned to one core (taskset -c 0)"
                   if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1 else platform.node(),
        "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _events(p, m, cfg: PlannerConfig, repeats: int) -> dict:
    """A join, one plan edge's bandwidth collapsing, and the busiest region cut off, each re-planned
    incrementally (median CPU seconds, nodes moved)."""
    from topology.model import NodeSpec

    ch = p.children()
    fed = {}
    for c, x in p.parents.items():
        if p.regions[c] != p.regions[x] and x != p.root:
            fed[p.regions[x]] = fed.get(p.regions[x], 0) + 1
    cut = max((r for r in fed if r != m.region_of(m.trainer)), key=lambda r: (fed[r], r), default=None)
    edge = max((c for c, x in p.parents.items() if ch[c] and x != p.root and p.regions[c] == p.regions[x]),
               key=lambda c: (len(ch[c]), c))
    kinds = {
        "join": lambda r: r.join(NodeSpec("joiner", m.region_names()[-1], "rollout", 10e9, 10e9)),
        "link": lambda r: r.link_changed(p.parents[edge], edge, 1e6),
        "partition": lambda r: r.partition(cut if cut is not None else m.region_names()[-1]),
    }
    out = {}
    for kind, run in kinds.items():
        cpu, change = [], None
        for _ in range(repeats):
            r = Replanner(p, m, cfg)
            c0 = time.process_time()
            change = run(r)
            cpu.append(time.process_time() - c0)
        assert change is not None
        out[kind] = {"replan_s": statistics.median(cpu), "moved": len(change.moved), "touched": change.touched,
                     "est_after": change.plan.est_completion_s}
    return out


def _subtree(ch: dict, top: str) -> set:
    out, stack = {top}, [top]
    while stack:
        for c in ch.get(stack.pop(), ()):
            out.add(c)
            stack.append(c)
    return out


def chart(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sel = [r for r in rows if r["measured"] == 0.0]
    fig = Figure(figsize=(9, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = ["lower bound\n(any scheme)", "lower bound\n(any tree)", "planned", "fixed tiers", "random", "star"]
    keys = ["flow_lb", "tree_lb", "planned", "fixed tiers", "random", "star"]
    colours = ["#bbbbbb", "#888888", "#2ca02c", "#ff7f0e", "#9467bd", "#d62728"]
    width = 0.8 / len(sel)
    for i, r in enumerate(sel):
        xs = [k + (i - (len(sel) - 1) / 2) * width for k in range(len(keys))]
        ax.bar(xs, [r[k] for k in keys], width=width * 0.95, color=colours, edgecolor="white")
    for k, key in enumerate(keys):
        med = statistics.median(r[key] for r in sel)
        ax.text(k, med * 1.15, f"{med:.1f} s", ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("time until the last node holds it (s, log)")
    ax.set_title(f"4 regions x 8 machines, 256 MiB artifact, simulated; one bar per seed ({len(sel)} seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def report(rows: list[dict], big: dict, cfg: PlannerConfig, command: str, out: Path, load: list[float]) -> str:
    lines = [
        "# Topology planner: scale study",
        "",
        f"Command: `{command}` (about 30 s). Machine: 2-core VM shared with other work "
        f"(Python {platform.python_version()}, {platform.machine()}); 1-minute load average "
        f"{min(load):.1f}-{max(load):.1f} while it ran; times are wall clock and noisy.",
        "",
        "Model (`topology/synthetic.py`): trainer with a 1 Gbit/s uplink in region r00; 8 machines per "
        "region, classes dc (10/10 Gbit/s up/down, 50 %), cloud (5/10, 30 %), edge (1/2.5, 20 %); "
        "10 Gbit/s per flow inside a region; every ordered region pair 0.2-1 Gbit/s (drawn per direction; "
        "also the pipe's shared capacity), RTT 20-150 ms between regions. \"measured 30 %\": 30 % of the "
        "pairs carry a probe-like measurement (estimate x U(0.9, 1.1)), so links are asymmetric and noisy. "
        f"Artifact {cfg.payload_bytes // 2**20} MiB in {cfg.chunk_bytes // 2**20} MiB chunks, max degree {cfg.max_degree}.",
        "",
        "Simulated time (s) until the last node holds the artifact (`topology/simulator.py`: max-min fair "
        "flows, chunk cut-through, half-RTT delay per hop). *Tree bound*: no single-parent tree can beat it "
        "(best path bottleneck and delay per node, sharing ignored; computed exactly, see "
        "`topology/baselines.py`). *Flow bound*: no scheme at all can "
        "(max-flow into each region, e.g. striping chunks over several parents). *No local search*: the "
        "constructive planner alone (`refine_budget=0`); *planned* adds the local search of "
        "`topology/refine.py` (moves on the critical path, region entry handed to a machine with a faster "
        "measured link).",
        "",
        "| pairs measured | seed | planned | no local search | tree bound | planned / tree bound | flow bound | star | star / planned | fixed tiers | random | plan time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {int(r['measured'] * 100)} % | {r['seed']} | {r['planned']:.2f} | {r['no local search']:.2f} | {r['tree_lb']:.2f} | "
            f"**{r['planned'] / r['tree_lb']:.3f}x** | {r['flow_lb']:.2f} | {r['star']:.1f} | "
            f"**{r['star'] / r['planned']:.1f}x** | {r['fixed tiers']:.2f} | {r['random']:.2f} | {r['plan_s'] * 1e3:.0f} ms |"
        )
    ratios = [r["planned"] / r["tree_lb"] for r in rows]
    speedups = [r["star"] / r["planned"] for r in rows]
    flow = [r["planned"] / r["flow_lb"] for r in rows]
    tiers = [r["fixed tiers"] / r["planned"] for r in rows]
    by_flavour = {}
    for r in rows:
        by_flavour.setdefault(r["measured"], []).append(r["planned"] / r["tree_lb"])
    lines += [""]
    for measured, rs in by_flavour.items():
        lines.append(
            f"- Planned vs tree bound, {int(measured * 100)} % of pairs measured: worst {max(rs):.3f}x, "
            f"median {statistics.median(rs):.3f}x (target <= 1.1x: {'met' if max(rs) <= 1.1 else 'MISSED'})."
        )
    lines.append(
        "- The tree bound is exact (a Pareto label search over (delay, bottleneck); a unit test checks it "
        "against every simple path), and the local search closes part of the remaining gap "
        f"(no local search: worst {max(r['no local search'] / r['tree_lb'] for r in rows):.3f}x)."
    )
    if max(ratios) > 1.1:
        lines.append("  The target is missed: see the rows above 1.1x.")
    lines += [
        f"- Planned vs star (the trainer's 1 Gbit/s uplink is the star's bottleneck: 32 x 256 MiB through it): "
        f"at least {min(speedups):.1f}x faster, median {statistics.median(speedups):.1f}x "
        f"(target >= 3x: {'met' if min(speedups) >= 3 else 'MISSED'}).",
        f"- Fixed tiers are {min(tiers):.1f}-{max(tiers):.1f}x slower than the planned tree: the trainer feeds "
        "every middle server itself, so its uplink is split four ways, and the middle server is not chosen "
        "by bandwidth.",
        f"- Planned vs flow bound: {min(flow):.2f}-{max(flow):.2f}x. That gap is what a single-parent tree "
        "leaves on the table when a region's best single inbound path is slower than the sum of its inbound "
        "links; only multi-parent striping could close it. Not attempted here.",
        "",
        "![4x8 simulated completion per scheme](topology_4x8.png)",
        "",
        "The planned tree for seed 0 (no measurements), as `p2psync viz` draws it:",
        "",
        "![planned tree, 4x8 seed 0](topology_tree_4x8.png)",
        "",
        f"## {big['nodes'] - 1:,} machines in 20 regions",
        "",
        f"- Planning time: {', '.join(f'{t:.2f} s' for t in big['times'])} "
        f"(target <= 5 s: {'met' if max(big['times']) <= 5 else 'MISSED'}). "
        f"Estimated completion {big['est']:.2f} s for 256 MiB; tree depth {big['max_depth']}; "
        f"{big['entries']} edges cross regions (one per region).",
        "- The simulator is not run at this size (its cost grows with nodes x chunks); the figure is the "
        "planner's estimate, which equalled the simulator on the 4x8 runs above. The local search is "
        "skipped at this size: its default budget (100,000 node visits, one per node per trial) buys "
        "fewer than 32 trials.",
        "",
        "| one failure | victim | its children | nodes moved | share of nodes | estimate before -> after | re-plan time |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, f in big["failures"].items():
        lines.append(
            f"| {label} | {f['victim']} | {f['children']} | {f['moved']} | **{f['frac']:.2%}** | "
            f"{f['est_before']:.2f} s -> {f['est_after']:.2f} s | {f['replan_s']:.2f} s |"
        )
    worst = max(f["frac"] for f in big["failures"].values())
    lines += [
        "",
        f"Target <= 5 % of the nodes moved: {'met' if worst <= 0.05 else 'MISSED'}. Only the failed node's "
        "children move (its strongest child takes its place, the others go below it); the re-plan time "
        "includes building a fresh plan to check that the repaired tree is not more than 1.5x worse.",
        "",
    ]
    text = "\n".join(lines)
    # Sections written by hand below the generated part (the probe runs) are kept.
    kept = ""
    if out.exists():
        old = out.read_text()
        at = old.find(KEEP_FROM)
        if at >= 0:
            kept = "\n" + old[at:]
    out.write_text(text + kept)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="planning-time repeats at 10,000 nodes")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--nodes", type=int, help="only the scale run at about this many machines (plus the trainer)")
    ap.add_argument("--json", help="with --nodes: write the figures (plan_s, replan_s, replan_moved, est_vs_bound, ...) here")
    args = ap.parse_args()
    if args.nodes:
        import json

        res = scale_run(args.nodes, PlannerConfig(), args.repeats)
        text = json.dumps(res, indent=1)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return 0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = PlannerConfig()
    load = [os.getloadavg()[0]]
    rows = small_study(list(range(args.seeds)), cfg)
    chart(rows, out / "topology_4x8.png")
    first = rows[0]
    draw_plan(first["plan"], out / "topology_tree_4x8.png", first["model"])
    load.append(os.getloadavg()[0])
    big = big_study(cfg, args.repeats)
    command = "python tools/plan_scale.py" + ("" if args.seeds == 5 and args.repeats == 3 else f" --seeds {args.seeds} --repeats {args.repeats}")
    load.append(os.getloadavg()[0])
    print(report(rows, big, cfg, command, out / "topology.md", load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
