"""``p2psync warm``: compile the codec's kernels into the per-user cache (see :mod:`p2psync.codec.precompile`)."""

from __future__ import annotations

import argparse
import importlib

ENGINE_PATHS = "rollout.engines.vllm.worker.warm:exercise"
"""The in-place apply of the vLLM backend: its kernels are built too (same distribution, imported by name)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warm", help="compile the codec's kernels into the per-user cache (run it at install)")
    p.add_argument("--codes", default="BF16,F16,F32", help="word types to build for (default BF16,F16,F32)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from p2psync.codec import precompile

    codes = [c.strip() for c in args.codes.split(",") if c.strip()]
    took = precompile.warm(codes)
    mod, _, fn = ENGINE_PATHS.partition(":")
    try:
        exercise = getattr(importlib.import_module(mod), fn)
    except ImportError:
        exercise = None  # installed without the rollout package
    if exercise is not None:
        exercise(codes)
    hits, misses = precompile.cache_stats()
    print(f"codec kernels ready in {took:.1f} s: {misses} compiled, {hits} loaded from the cache "
          f"({precompile.cache_location()})")
    return 0
