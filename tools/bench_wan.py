"""Dissemination on the emulated multi-region WAN, side by side: time until the last machine holds the weights.

One command per suite (root; builds the testbed, runs, removes it):

    .venv/bin/python tools/bench_wan.py main     # 4 regions x 4 machines, every method, delta + snapshot
    .venv/bin/python tools/bench_wan.py scaling  # p2psync tree and star on the delta, 2..4 regions x 2..8

Methods (each measured from the moment the payload is available at the
trainer until the last machine holds it, verified where the method verifies;
for p2psync the clock starts when the trainer node announces the artifact (its
event stream lists it), which is when a trainer using the Publisher API hands
it over; the time from dropping the file into the trainer's publish folder,
polled every 0.2 s, is reported beside it as ``from_file_drop_s``):

- ``p2psync-tree``: real ``p2psync node`` processes wired as the topology
  planner's tree for the testbed's network model (fallbacks as extra
  candidates); a machine "holds it" when every chunk arrived and was verified
  against the signed manifest (the artifact is complete in its store, as its
  event stream says); ``applied`` (decoded, fingerprint checked, written) is
  reported beside it. Small deltas are pushed down the open streams
  (``limits.push_bytes``), larger artifacts pulled.
- ``p2psync-star``: the same nodes, every one pulling from the trainer.
- ``http-unicast``: an aiohttp file server at the trainer, every machine
  downloads the file at once (``tools/wan/unicast.py``).
- ``shardcast``: PyPI shardcast, origin at the trainer, one middle node per
  region (its first machine), the others as clients of their middle node
  (``tools/wan/shardcast_node.py``), moving the same files.
- ``gloo``: ``torch.distributed`` gloo broadcast of the full bf16 weights
  (full weights only: a collective cannot skip the unchanged bytes).

Payloads: the real delta artifact and the full snapshot artifact of the codec
workload (``tools/wan/artifacts.py``). Beside each time: the lower bound
``max over machines of (payload / path capacity + one-way delay)``.

Repeats. Each method runs ``--repeat`` times (default 5), interleaved: round r
runs every method once, in an order rotated by r, so that a change in the
host's load falls on every method alike. p2psync runs start fresh node
processes each time; every node starts from version 0 already on disk (the
state checkpoint of the v0 weights, linked into its data directory), so a run
costs the nodes' start and the measured versions, not the 143 MB version 0
over the WAN (``--cold-start``: spread version 0 over the WAN instead, as a
first deployment would, reported apart as ``snapshot-cold``). The tables give
the median and the spread (min-max) of "holds" and "applied" over the runs and
the load average each run started under (``tools/wan/report.py``). Writes JSON,
a markdown table and a PNG under ``--out`` (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from wan.report import chart, lower_bound, markdown, rows_of, scaling_chart, targets, tokens_per_dollar  # noqa: E402

TOKEN = "wan-bench-token-0123456789"
PY = sys.executable
__all__ = ["lower_bound", "tokens_per_dollar", "machine_note"]  # also used by bench_wan_rl.py


# ---- methods -----------------------------------------------------------------------------------

def run_p2psync(tb, art: dict, parents: dict, work: Path, timeout: float, snapshot: bool = True,
                node_opts: list[str] | None = None, keep_logs: bool = False, cold: bool = False) -> dict:
    """One run: fresh nodes, then each payload published in turn, timed (see the module doc)."""
    from p2psync.store import STATE_FILE
    from p2psync.testbed import nodes

    d = Path(tempfile.mkdtemp(prefix="p2p-", dir=work))
    publish = d / "publish"
    publish.mkdir()
    if not cold:  # every node starts holding version 0 (the same file, linked: no copy per node)
        from wan.artifacts import seed_state

        seed = seed_state(art)
        for name in [tb.trainer.id, *parents]:
            (d / name).mkdir()
            os.link(seed, d / name / STATE_FILE)
    ns = nodes.start(tb, parents, d, Path(art["keys"]), TOKEN, publish,
                     extra=["--store.snapshot_interval=0", "--store.checkpoint_interval=0",
                            "--store.checkpoint_on_exit=false", "--limits.sse_keepalive=1",
                            "--limits.stall_timeout=30", *(node_opts or [])],
                     log_level="INFO" if keep_logs else "WARNING")
    out = {}
    try:
        # v0 (cold: every node starts from nothing and loads its codec on the way) is kept apart;
        # v1 the delta and v2 the full snapshot are measured on running nodes.
        steps = [(0, "snapshot-cold", "snapshot")] if cold else []
        steps.append((1, "delta", "delta"))
        if snapshot:
            steps.append((2, "snapshot", "snapshot2"))
        if not cold:
            ns.watch(0, timeout)  # every node loaded version 0
            ns.wait_warm(timeout)  # and its codec: the first apply runs at full speed
            # children settled re-open their push streams padded (p2psync.transport.push): give
            # every stream's padding time to cross the links it shares (a star's 16 streams share
            # the trainer's uplink) before the version is published
            from p2psync.config import LimitsConfig

            streams = [(ps[0], child) for child, ps in parents.items()]
            time.sleep(2 + tb.cfg.concurrent_seconds(streams, LimitsConfig().stream_warmup_bytes))
        for version, kind, file in steps:
            src = Path(art[file])
            dropped: list[float] = []

            def drop(src: Path = src) -> None:
                dropped.append(time.monotonic())
                os.link(src, publish / src.name)

            seen = ns.watch(version, timeout, then=drop)
            # t0: the artifact file appears in the trainer's publish folder (so the trainer's own
            # pick-up, polled every 0.2 s, and verification count against p2psync, as a user of the
            # publish folder would see them). ta: the trainer announced it (its event stream listed
            # it): the artifact is available to the network, the moment shardcast's clock starts
            # (after its sharding and hashing) and a trainer using the Publisher API hands it over.
            t0 = dropped[0]
            tr = seen["nodes"][tb.trainer.id]
            trainer_s, ta = tr["applied"], tr["announced"]
            rest = {n: r for n, r in seen["nodes"].items() if n != tb.trainer.id}
            fp_ok = all(r["fingerprint"] == art["fingerprints"][str(version)] for r in rest.values())
            done = not seen["timed_out"]

            def since(t: float | None, key: str) -> float | None:
                return round(max(r[key] for r in rest.values()) - t, 3) if done and t is not None else None
            out[kind] = {
                "seconds": since(t0, "applied"),
                "received_s": since(t0, "received"),
                "announced_to_received_s": since(ta, "received"),
                "announced_to_applied_s": since(ta, "applied"),
                "per_node_received_s": {n: None if r["received"] is None or ta is None else round(r["received"] - ta, 3)
                                        for n, r in rest.items()},
                "per_node_s": {n: None if r["applied"] is None else round(r["applied"] - t0, 3) for n, r in rest.items()},
                "trainer_announced_s": None if ta is None else round(ta - t0, 3),
                "trainer_applied_s": None if trainer_s is None else round(trainer_s - t0, 3),
                "timed_out": seen["timed_out"], "bit_exact": fp_ok and done,
            }
            time.sleep(2)  # let relays settle before the next version
    finally:
        ns.stop()
        if keep_logs:  # the logs only: each node's data directory holds GBs of weights and artifacts
            for sub in d.iterdir():
                if sub.is_dir():
                    shutil.rmtree(sub, ignore_errors=True)
            print(f"node logs kept in {d}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(d, ignore_errors=True)
    return out


def run_unicast(tb, art: dict, work: Path, timeout: float, kinds=("snapshot", "delta")) -> dict:
    d = Path(tempfile.mkdtemp(prefix="uni-", dir=work))
    serve_dir = d / "serve"
    serve_dir.mkdir()
    t = tb.trainer
    out = {}
    server = tb.spawn(t.id, [PY, "tools/wan/unicast.py", "serve", "--host", t.ip, "--dir", str(serve_dir)],
                      stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        for kind in kinds:
            src = Path(art[kind])
            os.link(src, serve_dir / src.name)
            clients = {m.id: tb.spawn(m.id, [PY, "tools/wan/unicast.py", "fetch", "--url",
                                             f"http://{t.ip}:8080/{src.name}", "--out", str(d / f"{m.id}.bin")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                       for m in tb.rollout_machines()}
            for p in clients.values():  # every client has started and imported what it needs
                assert p.stdout.readline().strip() == "ready"
            go = time.monotonic() + 0.5
            for p in clients.values():
                p.stdin.write(f"{go!r}\n")
                p.stdin.flush()
            ends = {}
            for n, p in clients.items():
                o, _ = p.communicate(timeout=timeout)
                r = json.loads(o.strip().splitlines()[-1])
                assert r["bytes"] == src.stat().st_size, (n, r)
                ends[n] = r["end"]
            out[kind] = {"seconds": round(max(ends.values()) - go, 3),
                         "per_node_s": {n: round(e - go, 3) for n, e in ends.items()}}
            for m in tb.rollout_machines():
                (d / f"{m.id}.bin").unlink(missing_ok=True)
    finally:
        tb.stop([server])
        shutil.rmtree(d, ignore_errors=True)
    return out


def run_shardcast(tb, art: dict, work: Path, timeout: float) -> dict:
    d = Path(tempfile.mkdtemp(prefix="sc-", dir=work))
    t = tb.trainer
    procs = []
    out = {}
    try:
        origin = tb.spawn(t.id, [PY, "tools/wan/shardcast_node.py", "origin", "--dir", str(d / "origin")],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(origin)
        assert origin.stdout.readline().strip() == "ready"
        middles, clients = {}, {}
        by_region: dict[str, list] = {}
        for m in tb.rollout_machines():
            by_region.setdefault(m.region, []).append(m)
        for region, ms in by_region.items():
            mid = ms[0]
            p = tb.spawn(mid.id, [PY, "tools/wan/shardcast_node.py", "middle", "--dir", str(d / mid.id),
                                  "--upstream", f"http://{t.ip}:8000"], stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "ready"
            middles[mid.id] = p
            for c in ms[1:]:
                q = tb.spawn(c.id, [PY, "tools/wan/shardcast_node.py", "client", "--dir", str(d / c.id),
                                    "--server", f"http://{mid.ip}:8000", "--versions", "v1,v2"],
                             stdout=subprocess.PIPE, text=True)
                procs.append(q)
                clients[c.id] = q
        for q in clients.values():
            assert q.stdout.readline().strip() == "ready"
        for kind in ("snapshot", "delta"):
            origin.stdin.write(art[kind] + "\n")
            origin.stdin.flush()
            pub = json.loads(origin.stdout.readline())
            ends = {}
            deadline = time.monotonic() + timeout
            for n, p in {**middles, **clients}.items():
                line = p.stdout.readline()  # one line per version, in order
                if not line or time.monotonic() > deadline:
                    raise RuntimeError(f"shardcast {n} gave no result for {pub['version']}")
                r = json.loads(line)
                assert r.get("version") == pub["version"] and "end" in r, (n, r)
                ends[n] = r["end"]
            out[kind] = {"seconds": round(max(ends.values()) - pub["published"], 3),
                         "per_node_s": {n: round(e - pub["published"], 3) for n, e in ends.items()}}
    finally:
        tb.stop(procs)
        shutil.rmtree(d, ignore_errors=True)
    return out


def run_gloo(tb, art: dict, work: Path, timeout: float) -> dict:
    ms = [tb.trainer, *tb.rollout_machines()]
    numel = art["params"]
    procs = []
    try:
        for rank, m in enumerate(ms):
            argv = [PY, "tools/wan/gloo_bcast.py", "--master", tb.trainer.ip, "--rank", str(rank),
                    "--world", str(len(ms)), "--numel", str(numel), "--timeout", str(timeout)]
            if rank == 0:
                argv += ["--weights", art["weights"]]
            with open(work / f"gloo-{m.id}.log", "ab") as log:
                procs.append(tb.spawn(m.id, argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                      env={"OMP_NUM_THREADS": "1"}))
        res = []
        for p in procs:
            o, _ = p.communicate(timeout=timeout + 120)
            res.append(json.loads(o.strip().splitlines()[-1]))
    finally:
        tb.stop(procs)
    t0 = res[0]["start"]
    ok = all(r["crc_head"] == res[0]["crc_head"] for r in res)
    return {"snapshot": {"seconds": round(max(r["end"] for r in res) - t0, 3), "bit_exact": ok,
                         "per_node_s": {ms[r["rank"]].id: round(r["end"] - t0, 3) for r in res[1:]},
                         "payload_bytes": 2 * numel}}


# ---- suites ------------------------------------------------------------------------------------

def plan_parents(cfg, payload: int, chunk: int) -> dict:
    from p2psync.testbed.model import network_model
    from topology.planner import PlannerConfig, plan

    p = plan(network_model(cfg), PlannerConfig(payload_bytes=payload, chunk_bytes=chunk))
    return {c: [par, *p.fallbacks.get(c, [])] for c, par in p.parents.items()}, p


def star_parents(cfg) -> dict:
    return {m.id: ["trainer"] for m in cfg.machines() if m.role != "trainer"}


def suite(args, cfg, art: dict, methods: list[str]) -> dict:
    """``args.repeat`` rounds; round r runs every method once, the order rotated by r (module doc)."""
    from p2psync.testbed.runner import Testbed

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    plan_info = None
    with Testbed.up(cfg) as tb:
        for rep in range(args.repeat):
            for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
                t = time.monotonic()
                load = round(os.getloadavg()[0], 1)
                print(f"[{cfg.name}] round {rep + 1}/{args.repeat}: {method} (load {load}) ...", file=sys.stderr,
                      flush=True)
                if method == "p2psync-tree":
                    parents, p = plan_parents(cfg, art["delta_bytes"], art["delta_chunk"])
                    plan_info = {"parents": p.parents, "est_completion_s": p.est_completion_s}
                    r = run_p2psync(tb, art, parents, work, args.timeout, not args.delta_only, args.node_opt,
                                    args.keep_logs, args.cold_start)
                elif method == "p2psync-star":
                    r = run_p2psync(tb, art, star_parents(cfg), work, args.timeout, not args.delta_only,
                                    args.node_opt, args.keep_logs, args.cold_start)
                elif method == "http-unicast":
                    r = run_unicast(tb, art, work, args.timeout)
                elif method == "shardcast":
                    r = run_shardcast(tb, art, work, args.timeout)
                elif method == "gloo":
                    r = run_gloo(tb, art, work, args.timeout)
                else:
                    raise SystemExit(f"unknown method {method}")
                results[method].append({**r, "load": load, "rep": rep})
                print(f"[{cfg.name}] {method}: {json.dumps({k: v.get('seconds') for k, v in r.items()})} "
                      f"({time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
    return {"results": results, "plan": plan_info}


def machine_note() -> str:
    """The machine as measured: cores, memory, GPU if any, and the load at the start
    (``P2PSYNC_BENCH_MACHINE`` adds what the host cannot tell, e.g. who else shares it)."""
    load = os.getloadavg()
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)
        gpu = q.stdout.strip().replace("\n", ", ") or gpu
    extra = os.environ.get("P2PSYNC_BENCH_MACHINE", "shared with other engineers' work")
    return (f"{platform.machine()} {os.cpu_count()} cores ({extra}), "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, {gpu}; "
            f"load average at start {load[0]:.1f}")


def main() -> int:
    os.environ.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=["main", "scaling"])
    ap.add_argument("--config", help="testbed description (TOML/JSON); default: the built-in 4x4 testbed")
    ap.add_argument("--name", default="wanb", help="testbed name (namespace prefix)")
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--per-region", type=int, default=4)
    ap.add_argument("--preset", default="bench", help="model preset of trainer/workload.py (main: bench)")
    ap.add_argument("--methods", default="p2psync-tree,p2psync-star,http-unicast,shardcast,gloo")
    ap.add_argument("--grid", default="2x2,2x4,2x8,4x2,4x4,4x8", help="scaling: REGIONSxPER_REGION list")
    ap.add_argument("--rollout-seconds", type=float, default=60.0, help="cost model: rollout phase per RL step")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--delta-only", action="store_true",
                    help="p2psync methods: measure the delta only (no full snapshot as version 2)")
    ap.add_argument("--node-opt", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                    help="extra option for every p2psync node (repeatable), e.g. --node-opt=--limits.decode_nice=19")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each method, interleaved (median and spread)")
    ap.add_argument("--cold-start", action="store_true",
                    help="p2psync methods: nodes start empty and version 0 spreads over the WAN first (untimed)")
    ap.add_argument("--keep-logs", action="store_true", help="p2psync methods: INFO node logs, kept under --work")
    ap.add_argument("--work", default="/tmp/p2psync-wan", help="artifacts cache and scratch space")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--tag", default="", help="main: suffix of the files written (wan<TAG>.json, wan_main<TAG>.md/.png)")
    args = ap.parse_args()
    from wan.artifacts import make

    from p2psync.testbed.config import load, scaled

    base = load(args.config, name=args.name) if args.config else None
    print(f"building the {args.preset} workload's artifacts (cached in {args.work}) ...", file=sys.stderr, flush=True)
    art = make(Path(args.work), preset=args.preset)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"command": "tools/bench_wan.py " + " ".join(sys.argv[1:]), "machine": machine_note(),
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "workload": {k: art[k] for k in ("preset", "lr", "warmup", "params", "bf16_bytes", "snapshot_bytes",
                                                "delta_bytes", "delta_chunk", "snapshot_chunk")},
              "rollout_seconds": args.rollout_seconds}
    if args.suite == "main":
        cfg = scaled(args.regions, args.per_region, base, name=args.name)
        res = suite(args, cfg, art, args.methods.split(","))
        rows = rows_of(cfg, art, res["results"], args.rollout_seconds)
        goals = targets(rows)
        doc = {**header, "testbed": cfg.to_dict(), "plan": res["plan"], "results": res["results"], "rows": rows,
               "targets": goals}
        (out / f"wan{args.tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
        table = markdown(rows, cfg, args.rollout_seconds) + "\n\n" + "\n".join(
            f"- {g['target']}: {g['measured']} (needs {g['required']}): {'met' if g['met'] else 'MISSED'}" for g in goals)
        (out / f"wan_main{args.tag}.md").write_text(table + "\n")
        chart(rows, out / f"wan_main{args.tag}.png",
              f"{len(cfg.machines()) - 1} machines in {len(cfg.regions)} regions, "
              f"{art['preset']} model ({art['params'] / 1e6:.0f}M params)")
        print(table)
        return 0
    points = []
    for spec in args.grid.split(","):
        r, n = (int(x) for x in spec.split("x"))
        cfg = scaled(r, n, base, name=args.name)
        res = suite(args, cfg, art, ["p2psync-tree", "p2psync-star"])
        rows = rows_of(cfg, art, res["results"], args.rollout_seconds)
        get = {(x["method"], x["payload"]): x for x in rows}
        points.append({"regions": r, "per_region": n, "machines": r * n,
                       "tree_delta_s": get[("p2psync-tree", "delta")]["seconds"],
                       "star_delta_s": get[("p2psync-star", "delta")]["seconds"],
                       "tree_snapshot_s": get[("p2psync-tree", "snapshot")]["seconds"],
                       "star_snapshot_s": get[("p2psync-star", "snapshot")]["seconds"],
                       "delta_lower_bound_s": get[("p2psync-tree", "delta")]["lower_bound_s"],
                       "snapshot_lower_bound_s": get[("p2psync-tree", "snapshot")]["lower_bound_s"],
                       "results": res["results"]})
        print(json.dumps({k: v for k, v in points[-1].items() if k != "results"}), flush=True)
        (out / "wan_scaling.json").write_text(json.dumps({**header, "points": points}, indent=1) + "\n")
    lines = ["| regions x machines | delta: tree (s) | delta: star (s) | delta bound (s) | snapshot: tree (s) | "
             "snapshot: star (s) | snapshot bound (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p['regions']} x {p['per_region']} | {p['tree_delta_s']} | {p['star_delta_s']} | "
                     f"{p['delta_lower_bound_s']} | {p['tree_snapshot_s']} | {p['star_snapshot_s']} | "
                     f"{p['snapshot_lower_bound_s']} |")
    (out / "wan_scaling.md").write_text("\n".join(lines) + "\n")
    scaling_chart(points, out / "wan_scaling.png", art)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
