"""Benchmark: decoding one trainer step's delta against the base words on 1 and on 2 threads.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_vllm_apply.py --out /tmp/bench_vllm   # builds the workload
    PYTHONPATH=$PWD .venv/bin/python tools/bench_decode_threads.py --from /tmp/bench_vllm --reps 5

The decode the vLLM backend runs for a delta in host memory (every segment
through ``segdecode.decode`` against the live words, segments handed out by
``workers.run_ordered``), here against the version-0 words read from the
checkpoint, alternating 1 and 2 threads ``--reps`` times. Reports every time,
the fastest of each (the least disturbed by other processes) and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchout import emit, loadavg


def measure(src: Path, reps: int = 5, fractions: tuple[float, ...] = ()) -> dict:
    """The decode of the delta in ``src`` on 1 and 2 threads, ``reps`` times each (see module doc).

    ``fractions``: also decode the largest segments holding about these fractions of the changes
    (1.0: all), each timed on both thread counts, for fits of time against changes (``points``)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from p2psync import dtypes, keys
    from p2psync.artifact import ArtifactFile
    from p2psync.codec import precompile, segdecode
    from p2psync.codec.decode import split_chunk
    from p2psync.codec.segment import parse_head
    from p2psync.state import tensor_seed
    from p2psync.workers import run_ordered

    precompile.warm(("BF16",))
    delta = ArtifactFile(src / "publish" / "000001-delta.p2sa", keys.load_public(src / "keys" / "trainer.pub"))
    names = [t.name for t in delta.manifest.tensors]
    raw = load_file(str(src / "dense_v0.safetensors"))
    # Copies in this process's memory (the loaded file is mapped: its pages may be dropped and read again).
    words = [raw[n].contiguous().view(torch.int16).reshape(-1).numpy().view(np.uint16).copy() for n in names]
    del raw
    chunks = [c for _, c in delta.chunks()]
    bf = dtypes.from_code("BF16")
    seeds = [np.uint64(tensor_seed(n)) for n in names]
    heads = [parse_head(s) for c in chunks for s in split_chunk(c)]
    order = sorted(range(len(heads)), key=lambda k: -len(heads[k].raw))

    def one(k: int):
        p = heads[k]
        return segdecode.decode(p.raw, p.body_at, p.start, p.stop, bf, words[p.tensor], seeds[p.tensor])

    counts = [int.from_bytes(bytes(h.raw[h.body_at:h.body_at + 4]), "little") for h in heads]
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def timed(ks: list[int], threads: int) -> float:
        t = time.perf_counter()
        out, _, err = run_ordered(len(heads), ks, one, threads, cpus)
        dt = time.perf_counter() - t
        if err is not None:
            raise err
        del out
        return round(dt, 4)

    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(reps):
        for threads in (1, 2):
            times[threads].append(timed(order, threads))
    points = []
    for frac in fractions:
        ks, got = [], 0
        for k in order:  # the largest segments first, up to about ``frac`` of the changes
            if got >= frac * sum(counts):
                break
            ks.append(k)
            got += counts[k]
        for threads in (1, 2):
            points.append({"changes": got, "segments": len(ks), "threads": threads,
                           "s": min(timed(ks, threads) for _ in range(max(1, reps // 2)))})
    return {"changes": sum(counts), "segments": len(heads), "s_1_thread": times[1], "s_2_threads": times[2],
            "fastest_1": min(times[1]), "fastest_2": min(times[2]),
            "speedup_fastest": round(min(times[1]) / min(times[2]), 3), "points": points, "loadavg": loadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", required=True, help="the --out folder of tools/bench_vllm_apply.py")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    emit(measure(Path(args.src), args.reps), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
