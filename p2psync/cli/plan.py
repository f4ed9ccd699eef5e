"""``p2psync plan``: plan the dissemination tree from a saved network model.

``--from MODEL.json`` reads a model (the schema of :mod:`topology.model`;
a probe run writes the same schema through
``topology.model.model_from_measurements``), prints the bandwidth matrix and
the plan, scores the plan in the flow simulator beside the star, fixed-tier
and random baselines and the lower bounds, and writes the plan JSON.
"""

from __future__ import annotations

import argparse

# The simulator's cost grows with nodes x chunks; above this the scores are skipped.
SIMULATE_UP_TO = 300


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="plan the relay tree from a network model",
        description="Plan the bandwidth-weighted relay tree rooted at the trainer, print it, score it and write plan JSON.",
    )
    p.add_argument("--from", dest="source", required=True, metavar="MODEL.json",
                   help="network model (nodes, region figures, measured links) to plan from")
    p.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here")
    p.add_argument("--payload-bytes", type=int, default=256 * 2**20, help="artifact size to plan for (default 256 MiB)")
    p.add_argument("--chunk-bytes", type=int, default=4 * 2**20, help="chunk size (default 4 MiB)")
    p.add_argument("--max-degree", type=int, default=8, help="most children per node (default 8)")
    p.add_argument("--seed", type=int, default=0, help="tie-break seed (default 0)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulated scores")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from topology.baselines import fixed_tiers_tree, flow_lower_bound, random_tree, star_tree, tree_lower_bound
    from topology.model import NetworkModel
    from topology.planner import PlannerConfig, plan
    from topology.report import format_matrix, format_plan, format_scores
    from topology.simulator import simulate

    model = NetworkModel.load(args.source)
    cfg = PlannerConfig(payload_bytes=args.payload_bytes, chunk_bytes=args.chunk_bytes,
                        max_degree=args.max_degree, seed=args.seed)
    result = plan(model, cfg)
    print(format_matrix(model))
    print()
    print(format_plan(result))
    if not args.no_sim and len(model) <= SIMULATE_UP_TO:
        rows = []
        for name, parents in (
            ("planned tree", result.parents),
            ("star", star_tree(model)),
            ("fixed tiers", fixed_tiers_tree(model)),
            ("random tree", random_tree(model, args.seed, args.max_degree)),
        ):
            rows.append((name, simulate(model, parents, cfg.payload_bytes, cfg.chunk_bytes).makespan_s))
        tree_lb = tree_lower_bound(model, cfg.payload_bytes).completion_s
        rows.append(("lower bound, any tree", tree_lb))
        rows.append(("lower bound, any scheme", flow_lower_bound(model, cfg.payload_bytes).completion_s))
        print()
        print("simulated time until the last node holds the artifact (x the tree lower bound):")
        print(format_scores(rows, tree_lb))
    elif not args.no_sim:
        print(f"\n(simulation skipped: {len(model)} nodes > {SIMULATE_UP_TO}; the estimate above stands)")
    if args.output:
        result.save(args.output)
        print(f"\nplan written to {args.output}")
    return 0
