"""``p2psync warm``: compile the codec's kernels into the per-user cache (see :mod:`p2psync.codec.precompile`)."""

from __future__ import annotations

import argparse

WARM_GROUP = "p2psync.warm"
"""Entry point group of the kernels other packages compile at ``p2psync warm`` (value: a function
``exercise(codes)``; the vLLM backend's in-place apply registers one)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warm", help="compile the codec's kernels into the per-user cache (run it at install)")
    p.add_argument("--codes", default="BF16,F16,F32", help="word types to build for (default BF16,F16,F32)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from p2psync.codec import precompile

    codes = [c.strip() for c in args.codes.split(",") if c.strip()]
    took = precompile.warm(codes)
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=WARM_GROUP), key=lambda e: e.name):
        ep.load()(codes)
    hits, misses = precompile.cache_stats()
    print(f"codec kernels ready in {took:.1f} s: {misses} compiled, {hits} loaded from the cache "
          f"({precompile.cache_location()})")
    return 0
