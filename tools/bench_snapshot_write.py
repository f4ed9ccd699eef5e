"""Memory and time of writing a raw snapshot of the weights (a node's checkpoint, the trainer's
signed snapshot, a relay's rebuild): one pass that keeps every encoded chunk
(the `one-pass` mode, as a baseline) against two passes that hash, then encode again and write, chunk by chunk (what
the store does).

Each measurement runs in a fresh process (peak RSS is per process), modes alternating::

    .venv/bin/python tools/bench_snapshot_write.py --mb 1024 --rounds 3

Reports per run the wall time of the write and the peak resident memory above what the process
held with the weights loaded (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the
write), in MB and as a share of the model.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _state(mb: int):
    import torch

    from p2psync.state import ModelState

    g = torch.Generator().manual_seed(0)
    per = (mb << 20) // 2 // 8
    return ModelState({f"layer{i}.weight": (torch.randn(per, generator=g) * 0.02).bfloat16() for i in range(8)})


def _peak_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> int:
    """Start the peak resident set over from the current one (Linux: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _peak_kb()


def one(mode: str, mb: int) -> dict:
    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_snapshot
    from p2psync.store import STATE_FILE, VersionStore

    state = _state(mb)
    state.fingerprint  # noqa: B018 - computed before the baseline, as a node's weights are
    with tempfile.TemporaryDirectory(prefix="bench-snapwrite-") as d:
        store = VersionStore.open(Path(d), None)
        base = _reset_peak()
        t0 = time.perf_counter()
        if mode == "one-pass":
            opts = CodecOptions(chunk_size=16 << 20, zstd_level=0)
            enc = encode_snapshot(state, opts)
            m = build_manifest(enc, model_id="state-checkpoint", target_version=1, chunk_size=opts.chunk_size)
            write_file(Path(d) / STATE_FILE, m, enc.chunks)
            del enc
        else:
            store.save_state(state, 1)
        took = time.perf_counter() - t0
        peak = _peak_kb()
    extra = (peak - base) * 1024
    return {"mode": mode, "mb": mb, "write_s": round(took, 3), "extra_rss_mb": round(extra / 1e6, 1),
            "extra_share": round(extra / state.nbytes, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024, help="model size in MB of bf16 weights")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="append the rows here")
    ap.add_argument("--one", choices=["one-pass", "two-pass"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.mb)))
        return 0
    rows = []
    for r in range(args.rounds):
        for mode in ("one-pass", "two-pass"):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--mb", str(args.mb)],
                                 check=True, capture_output=True, text=True).stdout
            row = {**json.loads(out.strip().splitlines()[-1]), "round": r}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for mode in ("one-pass", "two-pass"):
        xs = [x for x in rows if x["mode"] == mode]
        print(json.dumps({"mode": mode, "median_write_s": statistics.median(x["write_s"] for x in xs),
                          "median_extra_rss_mb": statistics.median(x["extra_rss_mb"] for x in xs)}))
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
