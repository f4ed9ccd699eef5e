"""``p2psync viz PLAN``: draw a plan's tree by region, edges labelled with bandwidth, nodes coloured by role."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "viz", help="draw a plan as a picture",
        description="Draw a plan's tree laid out by region (PNG, SVG or PDF by the output suffix).",
    )
    p.add_argument("plan", metavar="PLAN.json", help="plan written by `p2psync plan -o`")
    p.add_argument("--model", metavar="MODEL.json", help="network model (regions and roles are otherwise taken from the plan)")
    p.add_argument("-o", "--output", default="plan.png", metavar="OUT.png|svg", help="picture to write (default plan.png)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from p2psync.errors import ConfigError
    from topology.model import NetworkModel
    from topology.tree import Plan
    from topology.viz import draw_plan

    if not args.output.lower().endswith((".png", ".svg", ".pdf")):
        raise ConfigError("--output", f"must end in .png, .svg or .pdf, got {args.output!r}")
    plan = Plan.load(args.plan)
    model = NetworkModel.load(args.model) if args.model else None
    path = draw_plan(plan, args.output, model)
    print(f"picture written to {path}")
    return 0
