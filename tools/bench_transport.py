"""Publish-to-last-node time of the HTTP data plane on loopback.

Starts real ``p2psync node`` processes (trainer, relays, rollout nodes) on
127.0.0.1, publishes one snapshot artifact of the requested size through the
trainer's ``--publish-dir``, and measures from the moment the trainer reports
the version until the last node does (status polled every 10 ms). Topologies:

- ``hop``:   trainer -> 1 rollout
- ``chain``: trainer -> relay -> rollout (depth 2)
- ``tree``:  trainer -> 2 relays -> 2 rollouts each (6 nodes below the trainer)

each with cut-through on and off. The payload is random bf16 (incompressible,
so payload bytes ~= model bytes).

    .venv/bin/python tools/bench_transport.py --sizes 10,100 --chunk-size 1MiB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TOKEN = "bench-token-0123456789"
CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]
TOPOLOGIES = {"hop": {"r0": None}, "chain": {"relay": None, "r0": "relay"},
              "tree": {"relay-a": None, "relay-b": None, "ra0": "relay-a", "ra1": "relay-a",
                       "rb0": "relay-b", "rb1": "relay-b"}}


def status(url: str) -> dict:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def start(root: Path, keydir: Path, name: str, role: str, parent: str | None, cut_through: bool,
          streams: int, publish: Path | None = None) -> tuple[subprocess.Popen, str]:
    args = ["node", "--role", role, "--id", name, "--listen.port=0", f"--data_dir={root / name}",
            f"--cluster_token={TOKEN}", f"--trainer_public_key={keydir / 'trainer.pub'}",
            f"--cut_through={'true' if cut_through else 'false'}", f"--limits.parallel_streams={streams}",
            "--store.snapshot_interval=0", "--store.checkpoint_interval=0", "--limits.sse_keepalive=1"]
    if parent:
        args.append(f"--parents={parent}")
    if publish:
        args.append(f"--publish-dir={publish}")
    with open(root / f"{name}.log", "ab") as err:
        p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=err, text=True)
    return p, p.stdout.readline().strip()


def make_artifact(path: Path, priv, mbytes: int, chunk_size: int) -> int:
    import torch

    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_snapshot
    from p2psync.state import ModelState

    n = mbytes * (1 << 20) // 2
    g = torch.Generator().manual_seed(0)
    state = ModelState({"w": torch.randint(-32768, 32767, (n,), dtype=torch.int16, generator=g).view(torch.bfloat16)})
    enc = encode_snapshot(state, CodecOptions(chunk_size=chunk_size, zstd_level=0))
    m = build_manifest(enc, model_id="bench", target_version=0, chunk_size=chunk_size, private_key=priv)
    write_file(path, m, enc.chunks)
    return m.payload_bytes


def run_one(topology: str, cut_through: bool, artifact: Path, keydir: Path, streams: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"bench-{topology}-"))
    publish = root / "publish"
    publish.mkdir()
    procs = []
    try:
        tp, turl = start(root, keydir, "trainer", "trainer", None, cut_through, streams, publish)
        procs.append(tp)
        urls = {"trainer": turl}
        for name, parent in TOPOLOGIES[topology].items():
            role = "relay" if name.startswith("relay") else "rollout"
            p, urls[name] = start(root, keydir, name, role, urls[parent or "trainer"], cut_through, streams)
            procs.append(p)
        for u in urls.values():  # every node has loaded and is idle
            while not status(u)["loaded"]:
                time.sleep(0.05)
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        os.link(artifact, publish / artifact.name)
        t_pub = None
        done: dict[str, float] = {}
        while len(done) < len(urls):
            for name, u in urls.items():
                if name not in done and status(u)["version"] == 0:
                    done[name] = time.monotonic()
                    if name == "trainer":
                        t_pub = done[name]
            time.sleep(0.01)
        assert t_pub is not None
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        last = max(done.values())
        return {"topology": topology, "cut_through": cut_through, "nodes": len(urls) - 1,
                "publish_to_last_s": round(last - t_pub, 3),
                "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> int:
    # Share the numba kernel cache with the test suite, so that no node compiles during a run.
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".numba_cache"))
    from p2psync import keys
    from p2psync.cli.delta import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100", help="artifact sizes in MB, comma separated")
    ap.add_argument("--chunk-size", type=parse_size, default="1MiB")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--topologies", default="hop,chain,tree")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-keys-"))
    priv = keys.generate()
    keys.write_pair(priv, work)
    rows = []
    for mb in (int(s) for s in args.sizes.split(",")):
        art = work / f"{mb:06d}-snapshot.p2sa"
        payload = make_artifact(art, priv, mb, args.chunk_size)
        for topo in args.topologies.split(","):
            for ct in (True, False):
                r = run_one(topo, ct, art, work, args.streams)
                r.update(mb=mb, payload=payload, mb_per_s=round(payload / 2**20 / r["publish_to_last_s"], 1))
                rows.append(r)
                print(json.dumps(r), flush=True)
    print("\n| MB | topology | nodes | cut-through | publish -> last node (s) | MB/s | CPU s (all nodes) |")
    print("|---:|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mb']} | {r['topology']} | {r['nodes']} | {'on' if r['cut_through'] else 'off'} | "
              f"{r['publish_to_last_s']} | {r['mb_per_s']} | {r['cpu_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
