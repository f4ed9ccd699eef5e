"""Benchmark: host memory of a rollout machine (node + engine in one process) beyond what the engine needs.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_vllm_apply.py --out /tmp/bench_vllm   # builds the workload
    PYTHONPATH=$PWD .venv/bin/python tools/bench_rollout_memory.py --from /tmp/bench_vllm --json out.jsonl

Uses the model and artifacts ``tools/bench_vllm_apply.py`` left in its ``--out``
folder (533 M parameters: the version-0 checkpoint, its signed snapshot and the
version-1 delta). Three fresh processes, one after the other, each measured
with the engine serving version 1:

- ``rollout``: ``p2psync node --role rollout --job rollout.worker:run`` with the
  transformers engine (bf16, CPU), following a trainer node that publishes the two
  artifacts: the defaults, where the node drops its copy once the engine holds
  the weights (``store.hold_weights``);
- ``rollout_holding``: the same with ``--store.hold_weights=true`` (a second copy);
- ``engine_only``: the same engine in a plain process that imports the same
  modules, loads version 0 from the snapshot and applies the delta (no node).

``extra_fraction`` = (resident memory of ``rollout`` - ``engine_only``) / bf16 bytes
of the model: what the node adds to the machine (store cache, buffers, the node's
own imports and threads). Both processes give the heap freed after the snapshot back
to the system (the rollout node when it drops its copy, the engine alone after its
load) and neither after the delta, so the engine's own allocations match.
``extra_fraction_parts``: the same by kind of resident memory (anonymous, mapped
files, shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchout import emit, loadavg

TOKEN = "bench-cluster-token-0123456789"


def _mem(pid: int) -> dict:
    """Resident memory of ``pid``: all of it (``rss``, what ``top`` shows) and its parts: anonymous
    (heap, the weights), file-backed (mapped files, such as the artifacts in the node's store: page
    cache the kernel may drop) and shared memory."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            got[{"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}[key]] = \
                int(rest.split()[0]) * 1024
    if "rss" not in got:
        raise RuntimeError(f"no VmRSS for {pid}")
    return got


def _switched_to(events: Path, version: int) -> bool:
    if not events.exists():
        return False
    rows = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    return any(r.get("event") == "switch" and r.get("version") == version and r.get("ok") for r in rows)


def rollout(src: Path, work: Path, hold: bool, timeout: float) -> dict:
    from p2psync.certs import Authority

    keys = src / "keys"
    work.mkdir(parents=True, exist_ok=True)
    ca = Authority(keys)  # mutual TLS, as every node runs: each node's certificate in <data_dir>/tls
    ca.node("trainer", "default", work / "t" / "tls")
    ca.node("r1", "default", work / "r" / "tls")
    common = [f"--cluster_token={TOKEN}", f"--trainer_public_key={keys / 'trainer.pub'}", "--listen.port=0"]
    trainer = subprocess.Popen([sys.executable, "-m", "p2psync.cli", "node", "--role", "trainer", "--id", "trainer",
                                f"--data_dir={work / 't'}", f"--trainer_private_key={keys / 'trainer.key'}",
                                f"--publish-dir={src / 'publish'}", *common],
                               stdout=subprocess.PIPE, stderr=open(work / "trainer.log", "ab"), text=True)
    procs = [trainer]
    try:
        url = trainer.stdout.readline().strip()
        events = work / "events.jsonl"
        cfg = work / "job.json"
        cfg.write_text(json.dumps({"engine": "hf", "model_path": str(src / "v0"), "threads": 1,
                                   "events_path": str(events), "audit": False}))
        argv = [sys.executable, "-m", "p2psync.cli", "node", "--role", "rollout", "--id", "r1",
                f"--data_dir={work / 'r'}", f"--parents={url}", *common,
                "--job", "rollout.worker:run", "--job-config", str(cfg)]
        if hold:
            argv.append("--store.hold_weights=true")
        node = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(work / "rollout.log", "ab"), text=True)
        procs.append(node)
        t0 = time.time()
        while not _switched_to(events, 1):
            if time.time() - t0 > timeout or node.poll() is not None:
                tail = (work / "rollout.log").read_text(errors="replace")[-1500:]
                raise SystemExit(f"the rollout node did not reach version 1; its log ends:\n{tail}")
            time.sleep(2)
        time.sleep(5)  # the node's housekeeping after the version (retention) settles
        return {**_mem(node.pid), "s_to_version_1": round(time.time() - t0, 1)}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def engine_only(src: Path) -> dict:
    """In this (fresh) process: the engine alone, at version 1."""
    import ctypes
    import gc

    import p2psync.node  # noqa: F401 - the same imports as the rollout process
    import rollout.worker  # noqa: F401
    from p2psync import keys
    from p2psync.artifact import ArtifactFile
    from p2psync.codec.decode import decode_state
    from rollout.engines import build_engine
    from rollout.options import WorkerOptions

    opts = WorkerOptions.from_dict({"engine": "hf", "model_path": str(src / "v0"), "threads": 1})
    engine = build_engine(opts.engine_config())
    pub = keys.load_public(src / "keys" / "trainer.pub")
    snap = ArtifactFile(src / "publish" / "000000-snapshot.p2sa", pub)
    state = decode_state(list(snap.manifest.tensors), snap.chunks(), len(snap.manifest.chunks),
                         snap.manifest.target_fingerprint)
    engine.load(state, 0, snap.manifest.target_fingerprint)
    model_bytes = sum(s.numel * 2 for s in snap.manifest.tensors)
    del state, snap
    gc.collect()
    try:  # the snapshot's decode given back, as the rollout node does once the engine holds the weights
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    delta = ArtifactFile(src / "publish" / "000001-delta.p2sa", pub)
    engine.apply(delta.manifest, [c for _, c in delta.chunks()])
    del delta
    gc.collect()
    return {**_mem(os.getpid()), "model_bytes": model_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", required=True, help="the --out folder of tools/bench_vllm_apply.py")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only-default", action="store_true",
                    help="measure the default rollout node only (skip the holding node and the engine alone)")
    args = ap.parse_args()
    src = Path(args.src).resolve()
    if args.engine_only:
        print(json.dumps(engine_only(src)), flush=True)
        return 0
    emit(measure(src, args.timeout, args.only_default), args.json)
    return 0


def measure(src: Path, timeout: float = 1200.0, only_default: bool = False, holding: bool = True) -> dict:
    """The three processes of the module doc, one after the other (``only_default``: the first;
    ``holding=False``: all but the holding node)."""
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-mem-") as d:
        res["rollout"] = rollout(src, Path(d) / "drop", False, timeout)
        if only_default:
            return res
        if holding:
            res["rollout_holding"] = rollout(src, Path(d) / "hold", True, timeout)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--from", str(src), "--engine-only"],
                         stdout=subprocess.PIPE, text=True, check=True)
    res["engine_only"] = json.loads(out.stdout.strip().splitlines()[-1])
    mb = res["engine_only"]["model_bytes"]
    res["model_bytes"] = mb
    res["extra_fraction"] = round((res["rollout"]["rss"] - res["engine_only"]["rss"]) / mb, 4)
    res["extra_fraction_parts"] = {k: round((res["rollout"].get(k, 0) - res["engine_only"].get(k, 0)) / mb, 4)
                                   for k in ("anon", "file", "shmem")}
    if holding:
        res["extra_fraction_holding"] = round((res["rollout_holding"]["rss"] - res["engine_only"]["rss"]) / mb, 4)
    res["loadavg"] = loadavg()
    return res


if __name__ == "__main__":
    sys.exit(main())
