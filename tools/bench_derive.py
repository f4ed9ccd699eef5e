"""Deriving the placement of a MoE checkpoint from vLLM's own loaders, against vLLM's own model load, in one process.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_derive.py --out DIR --json out.jsonl
    PYTHONPATH=$PWD .venv/bin/python tools/bench_derive.py --out DIR --compare OTHER_CHECKOUT --json out.jsonl

The ``tools/bench_vllm_apply.py --model moe`` shape (Qwen3-MoE, 64 experts of 256 rows per
layer, hidden 1024, vocabulary 32,768, tied), built by vLLM in this process as a worker does
(``tests/integration/vllm_modules.py``: build, load, CPU repacking), then per repeat vLLM's
``load_weights`` of the checkpoint in memory and ``rollout.engines.vllm.placement.probe.derive``.
``--compare``: the ``derive`` of another checkout of this repository (e.g. an older commit) run
on the same model after this one's (``--compare-first``: before it), and whether both give the
same placements. Each checkout's probe kernels are loaded first, as the engine's warm-up does
while it starts; the first derive of the process is the one an engine pays at a client's init
(``derive_first_over_get_model``), later ones reuse memory the first faulted in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tools"), str(REPO / "tests" / "integration")]


def _derive(root: Path, model, specs, reps: int) -> tuple[list[float], dict[str, str]]:
    """``derive`` as the checkout at ``root`` has it: seconds per repeat, and the placements."""
    for k in [k for k in sys.modules if k == "rollout" or k.startswith("rollout.")]:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        import rollout.engines.vllm.placement.probe as probe
        import rollout.engines.vllm.placement.kernels as kernels

        assert Path(probe.__file__).resolve().is_relative_to(root.resolve()), probe.__file__
        kernels.warm()  # as the engine's warm-up does while it starts, before a client's init binds
        times, got = [], {}
        for _ in range(reps):
            t = time.perf_counter()
            got = probe.derive(model, specs)
            times.append(time.perf_counter() - t)
        return times, {n: p.describe() for n, p in got.items()}
    finally:
        sys.path.remove(str(root))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the checkpoint")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", default=None, help="another checkout whose derive runs on the same model")
    ap.add_argument("--compare-first", action="store_true",
                    help="derive with the other checkout first (the first derive in a process is the one an engine pays)")
    ap.add_argument("--json", default=None, help="append the result line to this file")
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    import torch

    import vllm_workload
    from benchout import emit, loadavg
    from vllm_modules import vllm_model

    shape = argparse.Namespace(model="moe", vocab=32768, hidden=1024, mlp=3072, layers=args.layers, heads=8,
                               kv_heads=4, experts=args.experts, moe_mlp=256, lr=1e-6)
    v0, _, ck = vllm_workload.build_versions(shape, Path(args.out))
    t = time.perf_counter()
    timing: dict[str, float] = {}
    model = vllm_model(str(ck), timing=timing)
    res: dict = {"command": " ".join(["tools/bench_derive.py", *sys.argv[1:]]), "loadavg_start": loadavg(),
                 "params": sum(s.numel for s in v0.specs), "build_s": round(time.perf_counter() - t, 2),
                 "get_model_s": round(timing["get_model_s"], 2)}
    loads = []
    for _ in range(args.reps):
        items = [(s.name, torch.from_numpy(v0.words(s.name).view("int16")).view(torch.bfloat16).reshape(s.shape))
                 for s in v0.specs]
        t = time.perf_counter()
        model.load_weights(items)
        loads.append(time.perf_counter() - t)
    res["load_weights_s"] = [round(x, 3) for x in loads]
    runs = [("this", REPO), ("compare", Path(args.compare))] if args.compare else [("this", REPO)]
    if args.compare_first:
        runs.reverse()
    got = {}
    for label, root in runs:
        times, places = _derive(root, model, v0.specs, args.reps)
        got[label] = places
        part = res if label == "this" else res.setdefault("compare", {"checkout": args.compare})
        part["derive_s"] = [round(x, 3) for x in times]
        part["derive_median_s"] = round(statistics.median(times), 3)
        part["derive_over_get_model"] = round(part["derive_median_s"] / res["get_model_s"], 4)
        part["derive_first_over_get_model"] = round(times[0] / res["get_model_s"], 4)
    res["derive_over_load_weights"] = round(res["derive_median_s"] / statistics.median(loads), 2)
    if args.compare:
        res["compare"]["same_placements"] = got["this"] == got["compare"]
    res["loadavg_end"] = loadavg()
    emit(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
