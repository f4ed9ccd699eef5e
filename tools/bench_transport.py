"""Publish-to-last-node time of the HTTP data plane on loopback.

Starts real ``p2psync node`` processes (trainer, relays, rollout nodes) on
127.0.0.1 and publishes through the trainer's ``--publish-dir``: first a tiny
warm-up snapshot (version 0: connections open, codec warm, every node synced,
as in a running job), then the measured artifact (version 1), a raw snapshot
of random bf16 words of the requested size (incompressible, so payload bytes
~= model bytes). Times come from each node's own event stream
(``GET /v1/events`` pushes a catalogue the moment its applied version
changes), so nothing polls while a transfer runs. Measured: from the trainer
announcing the artifact of version 1 (its children may fetch from then on; the
trainer's own apply runs meanwhile) to each node announcing version 1 applied;
CPU seconds of every node process over the same window plus the trainer's
publish (``/proc``); with ``--profile DIR``, py-spy samples of every node over
that window (collapsed stacks, native frames included); after the
run, SIGTERM -> exit time of every node (which then checkpoints its new weights;
above ``--sigterm-max-mb`` the nodes are killed instead), and separately the
SIGTERM -> exit time of idle nodes (``--idle-shutdown``). Topologies:

- ``hop``:   trainer -> 1 rollout
- ``chain``: trainer -> relay -> rollout (depth 2)
- ``tree``:  trainer -> 2 relays -> 2 rollouts each (6 nodes below the trainer)

each with cut-through on and off, and with mutual TLS on (the default of every
node) and off (``--tls on,off``: plain HTTP, to measure what TLS costs). Every
configuration runs ``--repeat`` times; the table shows medians, the JSON lines every run.

On uncapped loopback every node's CPU is the bottleneck (and all nodes share
the host's cores). ``--link-mbit M`` (root) runs each node on its own emulated
machine instead (one network namespace each, the WAN testbed with one region
and no added latency) whose uplink and downlink are capped at M Mbit/s, as
hosts with their own NICs: then the links bound the transfer, which is the case
the cut-through target is about (a depth-d tree costs one payload time plus d
chunk times). Times there come from the testbed's observer; SIGTERM timing and
profiling are loopback-only.

    .venv/bin/python tools/bench_transport.py --sizes 10,100,1000 --repeat 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

TOKEN = "bench-token-0123456789"
CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]
TOPOLOGIES = {"hop": {"r0": None}, "chain": {"relay": None, "r0": "relay"},
              "tree": {"relay-a": None, "relay-b": None, "ra0": "relay-a", "ra1": "relay-a",
                       "rb0": "relay-b", "rb1": "relay-b"}}
_TICK = os.sysconf("SC_CLK_TCK")
CA_DIR: Path | None = None
"""The cluster CA the nodes' certificates come from (beside the trainer key; made in :func:`main`)."""


def _context(url: str):
    """The client TLS context for an https node (a client certificate of the CA), else None."""
    if not url.startswith("https://"):
        return None
    from p2psync.certs import Authority
    from p2psync.transport.tls import Tls

    ca = Path(os.environ.get("P2PSYNC_BENCH_CA", str(CA_DIR)))
    return Tls.for_client(Authority(ca).client()).client_context


def status(url: str) -> dict:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10, context=_context(url)) as r:
        return json.loads(r.read())


def metrics(url: str) -> str:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10, context=_context(url)) as r:
        return r.read().decode()


def wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if status(url)["loaded"] and "p2psync_codec_warm_seconds" in metrics(url):
                return
        except OSError:  # still starting on a busy machine: try again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout} s")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


class Watch:
    """Follows one node's event stream in a thread; records when each version first appears."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        ctx = _context(url)
        self.conn = http.client.HTTPSConnection(host, int(port), timeout=600, context=ctx) if ctx is not None \
            else http.client.HTTPConnection(host, int(port), timeout=600)
        self.seen: dict[int, float] = {}
        """version -> when the node first announced it as applied"""
        self.heads: dict[int, float] = {}
        """version -> when the node first listed an artifact reaching it (in flight or complete)"""
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.conn.request("GET", "/v1/events", headers={"Authorization": f"Bearer {TOKEN}"})
            resp = self.conn.getresponse()
            while line := resp.readline():
                if line.startswith(b"data:"):
                    now = time.monotonic()
                    cat = json.loads(line[5:])
                    v, head = cat["version"], cat["head"]
                    with self.cond:
                        if v is not None and v not in self.seen:
                            self.seen[v] = now
                        if head is not None and head not in self.heads:
                            self.heads[head] = now
                        self.cond.notify_all()
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            pass  # the node stopped, or close() closed the connection under us

    def wait(self, version: int, timeout: float) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: version in self.seen, timeout):
                raise TimeoutError(f"version {version} not reached in {timeout} s")
            return self.seen[version]

    def wait_announced(self, version: int, timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: any(v >= version for v in self.heads), timeout):
                raise TimeoutError(f"version {version} not announced in {timeout} s")

    def announced(self, version: int) -> float:
        """When the node first listed an artifact reaching ``version`` (call after :meth:`wait`)."""
        with self.cond:
            return min(t for v, t in self.heads.items() if v >= version)

    def close(self) -> None:
        self.conn.close()


def start(root: Path, keydir: Path, name: str, role: str, parent: str | None, cut_through: bool,
          streams: int, publish: Path | None = None, tls: bool = True) -> tuple[subprocess.Popen, str]:
    if tls:
        from p2psync.certs import Authority

        Authority(keydir).node(name, "default", root / name / "tls")
    args = ["node", "--role", role, "--id", name, "--listen.port=0", f"--data_dir={root / name}",
            f"--tls.enabled={'true' if tls else 'false'}",
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


def make_artifact(path: Path, priv, nbytes: int, chunk_size: int, version: int, name: str = "w") -> int:
    import torch

    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_snapshot
    from p2psync.state import ModelState

    n = nbytes // 2
    g = torch.Generator().manual_seed(version)
    state = ModelState({name: torch.randint(-32768, 32767, (n,), dtype=torch.int16, generator=g)
                        .view(torch.bfloat16)})
    enc = encode_snapshot(state, CodecOptions(chunk_size=chunk_size, zstd_level=0))
    del state
    m = build_manifest(enc, model_id="bench", target_version=version, chunk_size=chunk_size, private_key=priv)
    write_file(path, m, enc.chunks)
    return m.payload_bytes


def stop(procs: dict[str, subprocess.Popen], sig: int = signal.SIGTERM) -> dict[str, float]:
    """Signal every node at once; seconds until each exited."""
    t0 = time.monotonic()
    for p in procs.values():
        p.send_signal(sig)
    out = {}
    for name, p in procs.items():
        try:
            p.wait(180)  # a node that moved checkpoints its weights on the way out
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        out[name] = time.monotonic() - t0
    return out


def spy(pids: dict[str, int], out: Path, tag: str) -> list[subprocess.Popen]:
    """Sample every node with py-spy (collapsed stacks, native frames) until :func:`unspy`."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, pid in pids.items():
        # --native pauses the process for each sample (py-spy cannot read native stacks without
        # stopping it), so profiled runs are a little slower than the plain ones.
        with open(out / f"{tag}-{name}.log", "wb") as log:
            spies.append(subprocess.Popen([exe, "record", "-p", str(pid), "-f", "raw", "-r", "100", "--native",
                                           "-o", str(out / f"{tag}-{name}.txt")], stdout=log, stderr=log))
    return spies


def unspy(spies: list[subprocess.Popen]) -> None:
    for s in spies:
        s.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for s in spies:
        try:
            s.wait(60)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait(5)


def run_one(topology: str, cut_through: bool, artifact: Path, warm: Path, keydir: Path, streams: int,
            timeout: float, sigterm: bool = True, profile: Path | None = None, tag: str = "",
            tls: bool = True) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"bench-{topology}-"))
    publish = root / "publish"
    publish.mkdir()
    procs: dict[str, subprocess.Popen] = {}
    watches: dict[str, Watch] = {}
    try:
        procs["trainer"], turl = start(root, keydir, "trainer", "trainer", None, cut_through, streams, publish, tls)
        urls = {"trainer": turl}
        for name, parent in TOPOLOGIES[topology].items():
            role = "relay" if name.startswith("relay") else "rollout"
            procs[name], urls[name] = start(root, keydir, name, role, urls[parent or "trainer"], cut_through,
                                            streams, tls=tls)
        for u in urls.values():  # loaded, and the codec warm (as in a node that has run for a while)
            wait_ready(u, timeout)
        watches = {name: Watch(u) for name, u in urls.items()}
        os.link(warm, publish / warm.name)
        for w in watches.values():
            w.wait(0, timeout)
        # The trainer's publish-dir scanner re-opens (parses, signature-checks) every file in the
        # folder on each pass; a file is taken out once published, so that the measured window
        # holds the data plane and not that scanner.
        (publish / warm.name).unlink()
        time.sleep(0.5)  # let the warm-up's checkpoint and retention settle
        spies = spy({name: p.pid for name, p in procs.items()}, profile, tag) if profile else []
        cpu0 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
        os.link(artifact, publish / artifact.name)
        try:
            watches["trainer"].wait_announced(1, timeout)
            (publish / artifact.name).unlink()  # read whole by now (see above)
            t = {name: w.wait(1, timeout) for name, w in watches.items()}
            cpu1 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
        finally:
            unspy(spies)
        # The trainer announces the artifact (children may fetch) before its own apply ends.
        t_pub = watches["trainer"].announced(1)
        trainer_applied = t.pop("trainer")
        # SIGTERM makes every node checkpoint the new weights on its way out (seconds per GB).
        shutdown = stop(procs) if sigterm else {}
        arrive = {name: round(v - t_pub, 3) for name, v in t.items()}
        cpu = {name: round(cpu1[name] - cpu0[name], 2) for name in procs}
        return {"topology": topology, "cut_through": cut_through, "nodes": len(t), "loadavg": os.getloadavg()[0],
                "publish_to_last_s": max(arrive.values()), "arrive_s": arrive, "cpu_s": cpu,
                "trainer_applied_s": round(trainer_applied - t_pub, 3),
                "shutdown_s": {k: round(v, 3) for k, v in shutdown.items()}}
    finally:
        for w in watches.values():
            w.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        shutil.rmtree(root, ignore_errors=True)


# ---- capped links: every node on its own emulated machine (network namespace) -------------------

LINK_REGION = "lan"


def link_testbed(mbit: float, machines: int):
    """One region of ``machines`` rollout machines plus the trainer; every machine's uplink and
    downlink capped at ``mbit`` (``tc tbf``), no added latency: a rack of hosts with their own NICs."""
    from p2psync.testbed import Testbed
    from p2psync.testbed.config import from_dict

    cfg = from_dict({"name": "p2tx", "subnet": "10.98.0.0/16", "trainer_region": LINK_REGION,
                     "trainer_uplink_mbit": mbit, "node_uplink_mbit": mbit, "node_downlink_mbit": mbit,
                     "regions": [{"name": LINK_REGION, "wan_mbit": 0, "nodes": machines}], "latency": []})
    return Testbed.up(cfg)


def run_one_linked(tb, topology: str, cut_through: bool, artifact: Path, warm: Path, keydir: Path,
                   streams: int, timeout: float, tls: bool = True) -> dict:
    """:func:`run_one` with each node on its own capped machine of ``tb`` (see :func:`link_testbed`).
    Times come from the testbed's observer (the nodes' event streams, read from the core namespace):
    trainer's announcement -> each node's version applied."""
    from p2psync.testbed import nodes

    names = list(TOPOLOGIES[topology])
    machine = {"trainer": tb.trainer.id, **{n: f"{LINK_REGION}-{i}" for i, n in enumerate(names)}}
    parents = {machine[n]: [machine[p or "trainer"]] for n, p in TOPOLOGIES[topology].items()}
    root = Path(tempfile.mkdtemp(prefix=f"bench-link-{topology}-"))
    publish = root / "publish"
    publish.mkdir()
    ns = nodes.start(tb, parents, root, keydir, TOKEN, publish,
                     extra=[f"--cut_through={'true' if cut_through else 'false'}",
                            f"--limits.parallel_streams={streams}", "--store.snapshot_interval=0",
                            "--store.checkpoint_interval=0", "--store.checkpoint_on_exit=false",
                            "--limits.sse_keepalive=1"], tls=tls)
    try:
        ready = tb.run("core", [sys.executable, "-c",
                                "import sys; sys.path.insert(0, 'tools'); import bench_transport as b; "
                                "[b.wait_ready(u, float(sys.argv[1])) for u in sys.argv[2:]]",
                                str(timeout), *ns.urls.values()], capture_output=True, text=True,
                       env={**os.environ, "P2PSYNC_BENCH_CA": str(keydir)})
        if ready.returncode != 0:
            raise RuntimeError(f"nodes not ready: {ready.stderr[-2000:]}")
        ns.watch(0, timeout, then=lambda: os.link(warm, publish / warm.name))
        (publish / warm.name).unlink()
        time.sleep(0.5)
        cpu0: dict[str, float] = {}

        def drop() -> None:
            cpu0.update({m: cpu_seconds(p.pid) for m, p in ns.procs.items()})
            os.link(artifact, publish / artifact.name)
        seen = ns.watch(1, timeout, then=drop)
        cpu1 = {m: cpu_seconds(p.pid) for m, p in ns.procs.items()}
        if seen["timed_out"]:
            raise TimeoutError(f"version 1 not reached by {seen['timed_out']}")
        by_machine = {m: n for n, m in machine.items()}
        t_pub = seen["nodes"][tb.trainer.id]["announced"]
        arrive = {by_machine[m]: round(r["applied"] - t_pub, 3) for m, r in seen["nodes"].items()
                  if m != tb.trainer.id}
        received = {by_machine[m]: round(r["received"] - t_pub, 3) for m, r in seen["nodes"].items()
                    if m != tb.trainer.id}
        return {"topology": topology, "cut_through": cut_through, "nodes": len(arrive),
                "loadavg": os.getloadavg()[0], "publish_to_last_s": max(arrive.values()),
                "received_last_s": max(received.values()), "arrive_s": arrive, "received_s": received,
                "cpu_s": {by_machine[m]: round(cpu1[m] - cpu0[m], 2) for m in ns.procs},
                "trainer_applied_s": round(seen["nodes"][tb.trainer.id]["applied"] - t_pub, 3), "shutdown_s": {}}
    finally:
        ns.stop()
        shutil.rmtree(root, ignore_errors=True)


def idle_shutdown(warm: Path, keydir: Path, timeout: float) -> dict[str, float]:
    """SIGTERM -> exit of a trainer and a rollout node that synced the warm-up version and sat idle."""
    root = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    publish = root / "publish"
    publish.mkdir()
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["trainer"], turl = start(root, keydir, "trainer", "trainer", None, True, 4, publish)
        procs["r0"], rurl = start(root, keydir, "r0", "rollout", turl, True, 4)
        for u in (turl, rurl):
            wait_ready(u, timeout)
        w = Watch(rurl)
        os.link(warm, publish / warm.name)
        w.wait(0, timeout)
        time.sleep(1.0)  # idle: the warm-up version applied, nothing in flight
        w.close()
        return {k: round(v, 3) for k, v in stop(procs).items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        shutil.rmtree(root, ignore_errors=True)


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mb"], r["topology"], r["cut_through"], r.get("tls", True)), []).append(r)
    out = []
    for (mb, topo, ct, tls), rs in groups.items():
        last = statistics.median(r["publish_to_last_s"] for r in rs)
        payload = rs[0]["payload"]
        followers = [c for r in rs for n, c in r["cpu_s"].items() if n != "trainer"]
        out.append({"mb": mb, "topology": topo, "cut_through": ct, "tls": tls, "nodes": rs[0]["nodes"], "runs": len(rs),
                    "cpu_node_per_gb": statistics.median(followers) / (payload / 1e9),
                    "last_s": last, "min_s": min(r["publish_to_last_s"] for r in rs),
                    "max_s": max(r["publish_to_last_s"] for r in rs),
                    "mb_per_s": payload / 1e6 / last,
                    "cpu_trainer": statistics.median(r["cpu_s"]["trainer"] for r in rs),
                    "cpu_node": statistics.median(followers),
                    "shutdown_max": max((max(r["shutdown_s"].values(), default=0) for r in rs), default=0)})
    return out


def main() -> int:
    # Share the numba kernel cache with the test suite, so that no node compiles during a run.
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".numba_cache"))
    from p2psync import keys
    from p2psync.cli.delta import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100", help="artifact sizes in MB (10**6 bytes), comma separated")
    ap.add_argument("--chunk-size", type=parse_size, default="1MiB")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--topologies", default="hop,chain,tree")
    ap.add_argument("--cut-through", default="on,off", help="on, off or on,off")
    ap.add_argument("--tls", default="on", help="mutual TLS on every link: on, off (plain HTTP) or on,off")
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (the table shows medians)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for one version")
    ap.add_argument("--json", help="append every run as a JSON line to this file")
    ap.add_argument("--sigterm-max-mb", type=int, default=100,
                    help="end nodes with SIGTERM (timed, checkpoints the weights) up to this size, SIGKILL above")
    ap.add_argument("--idle-shutdown", type=int, default=3, help="times to measure SIGTERM -> exit of idle nodes")
    ap.add_argument("--link-mbit", type=float, default=0,
                    help="run every node on its own emulated machine (network namespace, needs root) with its "
                         "uplink and downlink capped at this many Mbit/s; 0: all on the host's loopback")
    ap.add_argument("--profile", type=Path, help="sample every node with py-spy during the measured window; "
                                                "collapsed stacks to DIR/<MB>-<topology>-<on|off>-<run>-<node>.txt")
    args = ap.parse_args()
    global CA_DIR
    work = Path(tempfile.mkdtemp(prefix="bench-keys-"))
    CA_DIR = work
    tb = None
    try:
        priv = keys.generate()
        keys.write_pair(priv, work)
        warm = work / "000000-snapshot.p2sa"
        make_artifact(warm, priv, 128 << 10, 64 << 10, 0, "warm-up")
        idle = []
        for _ in range(args.idle_shutdown):
            idle.append(idle_shutdown(warm, work, args.timeout))
            print(json.dumps({"idle_shutdown_s": idle[-1]}), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"idle_shutdown_s": idle[-1]}) + "\n")
        rows = []
        tb = link_testbed(args.link_mbit, max(len(TOPOLOGIES[t]) for t in args.topologies.split(","))) \
            if args.link_mbit else None
        for mb in (int(s) for s in args.sizes.split(",")):
            art = work / "000001-snapshot.p2sa"
            payload = make_artifact(art, priv, mb * 10**6, args.chunk_size, 1)
            for topo in args.topologies.split(","):
                for ct, tls, k in ((c == "on", t == "on", k) for c in args.cut_through.split(",")
                                   for k in range(args.repeat) for t in args.tls.split(",")):
                    # TLS on and off alternate inside each repeat, so that load drifts hit both alike.
                    if tb is not None:
                        r = run_one_linked(tb, topo, ct, art, warm, work, args.streams, args.timeout, tls)
                    else:
                        r = run_one(topo, ct, art, warm, work, args.streams, args.timeout,
                                    sigterm=mb <= args.sigterm_max_mb, profile=args.profile,
                                    tag=f"{mb}-{topo}-{'on' if ct else 'off'}-{k}", tls=tls)
                    r.update(mb=mb, payload=payload, chunk_size=args.chunk_size, streams=args.streams,
                             link_mbit=args.link_mbit, tls=tls)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(r) + "\n")
            art.unlink()
    finally:
        if tb is not None:
            tb.down()
        shutil.rmtree(work, ignore_errors=True)
    print("\n| MB | topology | nodes | cut-through | TLS | runs | publish -> last node, median (min-max) s "
          "| MB/s per node | CPU s trainer | CPU s per node | CPU s per GB per node | slowest SIGTERM -> exit s |")
    print("|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in summarise(rows):
        print(f"| {s['mb']} | {s['topology']} | {s['nodes']} | {'on' if s['cut_through'] else 'off'} "
              f"| {'on' if s['tls'] else 'off'} | {s['runs']} "
              f"| {s['last_s']:.3f} ({s['min_s']:.3f}-{s['max_s']:.3f}) | {s['mb_per_s']:.0f} | {s['cpu_trainer']:.2f} "
              f"| {s['cpu_node']:.2f} | {s['cpu_node_per_gb']:.1f} | {s['shutdown_max']:.2f} |")
    if idle:
        every = sorted(v for d in idle for v in d.values())
        print(f"\nidle SIGTERM -> exit ({len(every)} nodes): median {statistics.median(every):.3f} s, "
              f"max {every[-1]:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
