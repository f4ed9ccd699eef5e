"""End-to-end RL step time on the emulated WAN: no sync (the ideal), p2psync sparse sync, full-weight sync.

One command (root; builds the testbed, runs every mode, removes the testbed, also on failure):

    .venv/bin/python tools/bench_wan_rl.py --rounds 2                     # -> docs/benchmarks/wan_rl.json/.md/.png
    .venv/bin/python tools/bench_wan_rl.py --rounds 2 --max-staleness 0 --tag _k0   # on-policy: wan_rl_k0.*

What runs, per mode, on the same testbed (fresh processes and data folders each time):

- the trainer machine: ``p2psync node --role trainer --job demo.jobs:trainer`` (the GRPO job
  of ``trainer/grpo.py``, kept serving after its last step as in the demo), the coordinator of the
  gossip control plane (leases, the live dissemination plan);
- every other machine: ``p2psync node --role rollout --job rollout.worker:run`` (transformers engine),
  joined through gossip (``gossip.seeds`` = the trainer), static parent the trainer; the coordinator's
  live plan then chooses each node's parent. No relays (each region's first rollout node relays).

Modes (GRPO ``sync``): ``nosync`` (``false``: version 0 only, the ideal), ``p2psync`` (``true``: every
step a signed sparse delta), ``full`` (``"full"``: every step a raw full-weight snapshot, the baseline
users run today). Each runs ``--warmup`` + ``--steps`` GRPO steps; the warm-up steps (codec and engine
warm-up, first plan) are dropped. Per mode: median step time (the trainer's wall time between steps,
waiting for rollouts included), tokens generated in the measured window (the rollout workers' batch
events), weight-sync bytes (payload per version; bytes into the rollout nodes over the whole run),
the sync latency (version published on the trainer -> the last rollout engine serving it), rollout
tokens per dollar with the testbed config's price table, and the ratios to ``nosync`` of the same run.
Every mode is checked bit for bit: each rollout engine's fingerprint (recomputed from its own weights
after every switch) must equal the trainer's for that version, and every node must end at the
trainer's last version.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from wan_rl_report import median, write_outputs  # noqa: E402 - tools/ is on the path from here on

TOKEN = "wan-rl-bench-token-0123456789"
PY = sys.executable
CLI = [PY, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]
MODES = {"nosync": False, "p2psync": True, "full": "full"}
BASE_PORT = 7170
NODE_ARGS: list[str] = []
"""Extra ``--section.field=value`` overrides for every node (``--node-args``)."""


# ---- the testbed ----------------------------------------------------------------------------------------

def testbed_config(args: argparse.Namespace):
    """The default testbed (or ``--config``) cut to the named regions, ``--per-region`` machines each."""
    from p2psync.errors import ConfigError
    from p2psync.testbed.config import from_dict, load

    base = load(args.config, name=args.name) if args.config else from_dict({"name": args.name})
    d = base.to_dict()
    names = [r for r in args.regions.split(",") if r]
    by_name = {r["name"]: r for r in d["regions"]}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ConfigError("regions", f"unknown region(s) {', '.join(missing)} (have {', '.join(by_name)})")
    d["regions"] = [{**by_name[n], "nodes": args.per_region} for n in names]
    d["latency"] = [e for e in d["latency"] if e["a"] in names and e["b"] in names]
    if d["trainer_region"] not in names:
        d["trainer_region"] = names[0]
    d["name"] = args.name
    return from_dict(d)


# ---- processes ------------------------------------------------------------------------------------------

def _first_line(p: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        return p.stdout.readline().strip() if sel.select(timeout) else ""
    finally:
        sel.close()


def _node_args(name: str, m, port: int, d: Path, keydir: Path, extra: list[str]) -> list[str]:
    from p2psync.certs import Authority

    # Mutual TLS as in production: the cluster CA beside the trainer key, each node's certificate in
    # its data dir (the default tls.dir).
    Authority(keydir).node(name, m.region, d / "nodes" / name / "tls")
    return [*CLI, "--log-level", "WARNING", "node", "--role", m.role, "--id", name, f"--region={m.region}",
            f"--listen.host={m.ip}", f"--listen.port={port}", f"--data_dir={d / 'nodes' / name}",
            f"--cluster_token={TOKEN}", f"--trainer_public_key={keydir / 'trainer.pub'}",
            f"--gossip.node_class={m.node_class}", "--store.snapshot_interval=0", "--store.checkpoint_interval=0",
            "--limits.sse_keepalive=1", "--limits.poll_interval=2", "--limits.retry_after=0.5",
            "--limits.stall_timeout=30", *NODE_ARGS, *extra]


def start_mode(tb, mode: str, args: argparse.Namespace, d: Path, keydir: Path, port: int,
               procs: dict[str, subprocess.Popen]) -> dict[str, str]:
    """Spawn the trainer and every rollout node at once (each imports torch: start-up dominates small runs);
    ``procs`` gets every process as soon as it exists (the caller stops them, also on failure)."""
    t = tb.trainer
    turl = f"https://{t.ip}:{port}"
    jobs = d / "jobs"
    jobs.mkdir(parents=True)
    (d / "events").mkdir()
    (d / "logs").mkdir()
    tcfg = {"preset": args.preset, "task": args.task, "lr": args.lr, "steps": args.warmup + args.steps,
            "seed": args.seed, "max_staleness": args.max_staleness, "groups_per_step": args.groups_per_step,
            "group_size": args.group_size, "sync": MODES[mode], "threads": 1, "publish_threads": 1,
            "metrics_path": str(d / "metrics.jsonl"), "versions_path": str(d / "versions.jsonl"),
            "done_path": str(d / "trainer.done.json")}
    (jobs / "trainer.json").write_text(json.dumps(tcfg, indent=1))
    env = {"OMP_NUM_THREADS": "1", "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))}
    argv = _node_args("trainer", t, port, d, keydir,
                      [f"--trainer_private_key={keydir / 'trainer.key'}", f"--control.max_staleness={args.max_staleness}",
                       "--job", "demo.jobs:trainer", "--job-config", str(jobs / "trainer.json")])
    with open(d / "logs" / "trainer.log", "ab") as log:
        procs["trainer"] = tb.spawn("trainer", argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    for i, m in enumerate(tb.rollout_machines()):
        rcfg = {"engine": "hf", "preset": args.preset, "threads": 1, "seed": args.seed * 1000 + i + 1,
                "events_path": str(d / "events" / f"{m.id}.jsonl")}
        (jobs / f"{m.id}.json").write_text(json.dumps(rcfg, indent=1))
        argv = _node_args(m.id, m, port, d, keydir, [f"--parents={turl}", f"--gossip.seeds={turl}",
                                                     "--job", "rollout.worker:run",
                                                     "--job-config", str(jobs / f"{m.id}.json")])
        with open(d / "logs" / f"{m.id}.log", "ab") as log:
            procs[m.id] = tb.spawn(m.id, argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    urls = {}
    for name, p in procs.items():
        line = _first_line(p, 180)
        if not line.startswith("http"):
            raise RuntimeError(f"{mode}: node {name} did not start ({line!r}); see {d / 'logs' / (name + '.log')}")
        urls[name] = line
    return urls


def stop_mode(procs: dict[str, subprocess.Popen]) -> dict[str, int | None]:
    """Rollouts first (they hand their leases back), then the trainer; by pid."""
    from p2psync.testbed.runner import Testbed

    Testbed.stop([p for n, p in procs.items() if n != "trainer"])
    Testbed.stop([procs["trainer"]])
    for p in procs.values():
        if p.stdout:
            p.stdout.close()
    return {n: p.returncode for n, p in procs.items()}


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for x in path.read_text().splitlines():
        try:
            out.append(json.loads(x))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def node_status(tb, urls: dict[str, str]) -> dict[str, dict]:
    """Every node's /v1/status, read from the core namespace (the host cannot reach the testbed)."""
    r = tb.run("core", [PY, str(Path(__file__).resolve()), "_status", *(f"{n}={u}" for n, u in urls.items())],
               capture_output=True, text=True, timeout=60, env={**os.environ, "P2PSYNC_BENCH_CA": _CA[0]})
    if r.returncode != 0:
        raise RuntimeError(f"status poll failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


_CA = [""]
"""The cluster CA's folder (set in main; the status poller presents its client certificate)."""


def _poll_status(pairs: list[str]) -> int:
    from p2psync.certs import Authority
    from p2psync.transport.tls import Tls

    ctx = Tls.for_client(Authority(Path(os.environ["P2PSYNC_BENCH_CA"])).client()).client_context
    out = {}
    for pair in pairs:
        name, url = pair.split("=", 1)
        req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
                s = json.loads(resp.read())
            out[name] = {k: s.get(k) for k in ("version", "fingerprint", "bytes_in", "bytes_out", "parent", "region")}
        except OSError as exc:
            out[name] = {"error": repr(exc)}
    print(json.dumps(out), flush=True)
    return 0


# ---- one mode -------------------------------------------------------------------------------------------

class ModeRun:
    """One mode's processes on the testbed: :meth:`start`, :meth:`poll` until True, :meth:`finish` (always)."""

    def __init__(self, tb, mode: str, args: argparse.Namespace, work: Path, keydir: Path, port: int) -> None:
        self.tb, self.mode, self.args, self.keydir, self.port = tb, mode, args, keydir, port
        self.d = work / mode
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.rollouts = [m.id for m in tb.rollout_machines()]
        self.outcome: dict | None = None
        self.final: int | None = None
        self.problems: list[str] = []
        self.done = False
        self.t_start = self.deadline = self.load_start = 0.0

    def start(self) -> None:
        if self.d.exists():
            shutil.rmtree(self.d)
        self.d.mkdir(parents=True)
        self.t_start = time.monotonic()
        self.load_start = os.getloadavg()[0]
        self.deadline = self.t_start + self.args.timeout
        self.urls = start_mode(self.tb, self.mode, self.args, self.d, self.keydir, self.port, self.procs)

    def poll(self) -> bool:
        """True once the job ended and every rollout engine serves its last version (or something failed)."""
        if self.done:
            return True
        d = self.d
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead:
            self.problems.append(f"processes exited early: {', '.join(dead)}")
        elif self.outcome is None and (d / "trainer.done.json").exists():
            self.outcome = json.loads((d / "trainer.done.json").read_text())
            if self.outcome.get("rc"):
                self.problems.append(f"training job failed: {self.outcome.get('error')}")
            else:
                self.final = max(v["version"] for v in _lines(d / "versions.jsonl"))
        if not self.problems and self.outcome is not None:  # every engine serves the trainer's last version
            last = [max((e["version"] for e in _lines(d / "events" / f"{n}.jsonl")
                         if e.get("event") == "switch" and e.get("ok")), default=None) for n in self.rollouts]
            if all(v is not None and v >= self.final for v in last):
                self.done = True
        if not self.done and not self.problems and time.monotonic() > self.deadline:
            self.problems.append("timed out" if self.outcome is None
                                 else "not every rollout engine reached the last version")
        self.done = self.done or bool(self.problems)
        return self.done

    def finish(self) -> dict[str, Any]:
        """Read every node's status (if all went well), stop the processes by pid, summarise."""
        status: dict = {}
        try:
            if self.done and not self.problems:
                status = node_status(self.tb, self.urls)
        finally:
            codes = stop_mode(self.procs)
        wall = time.monotonic() - self.t_start
        bad = {n: c for n, c in codes.items() if c not in (0, -15, -9, None)}
        if bad:  # e.g. 3: a rollout engine diverged from the trainer's bits
            self.problems.append(f"non-zero exit codes {bad}")
        killed = sorted(n for n, c in codes.items() if c == -9)
        notes = [f"did not exit within 10 s of SIGTERM (killed): {', '.join(killed)}"] if killed else []
        res = summarise(self.mode, self.d, self.rollouts, self.args, self.tb.cfg, status, self.final)
        res.update(wall_s=round(wall, 1), exit_codes=codes, notes=notes,
                   load_average=[round(self.load_start, 1), round(os.getloadavg()[0], 1)])  # 1-min, start / end
        if res["mismatches"]:
            self.problems.append(f"{len(res['mismatches'])} fingerprint mismatches")
        res["problems"] = self.problems
        res["ok"] = not self.problems and res["bit_exact"]
        return res


def run_modes(tb, modes: list[str], args: argparse.Namespace, work: Path, keydir: Path, port: int
              ) -> list[dict[str, Any]]:
    """The modes one after the other, or side by side with ``--concurrent`` (a correctness check: they then
    share the CPU, so their step times are not comparable)."""
    runs = [ModeRun(tb, m, args, work, keydir, port + i) for i, m in enumerate(modes)]
    groups = [runs] if args.concurrent else [[r] for r in runs]
    out = []
    for group in groups:
        try:
            for r in group:
                print(f"[{tb.cfg.name}] {r.mode} ...", file=sys.stderr, flush=True)
                r.start()
            while not all([r.poll() for r in group]):  # noqa: C419 - poll every run each time (no short cut)
                time.sleep(0.5)
        finally:
            results = []
            for r in group:  # every group member is stopped, even if one of them failed to start
                results.append(r.finish())
        for r in results:
            print(f"[{tb.cfg.name}] {r['mode']}: median step {r['median_step_s']} s, {r['tokens']} tokens, "
                  f"bit-exact {r['bit_exact']} ({r['wall_s']} s)"
                  f"{'; ' + '; '.join(r['problems']) if r['problems'] else ''}", file=sys.stderr, flush=True)
        out.extend(results)
    return out


def summarise(mode: str, d: Path, rollouts: list[str], args: argparse.Namespace, cfg, status: dict,
              final: int | None) -> dict[str, Any]:
    rows = sorted(_lines(d / "metrics.jsonl"), key=lambda r: r["step"])
    versions = {v["version"]: v for v in _lines(d / "versions.jsonl")}
    events = {n: _lines(d / "events" / f"{n}.jsonl") for n in rollouts}
    measured = [r for r in rows if r["step"] > args.warmup]
    # Bit-exactness: every engine switch against the trainer's own record of that version.
    mismatches, switches = [], 0
    for n, evs in events.items():
        for e in evs:
            if e.get("event") != "switch":
                continue
            switches += 1
            want = versions.get(e.get("version"), {}).get("fingerprint")
            if not e.get("ok") or e.get("fingerprint") != want or e.get("expected") != want:
                mismatches.append({"node": n, "version": e.get("version"), "engine": e.get("fingerprint"),
                                   "trainer": want})
    last_fp = versions.get(final, {}).get("fingerprint") if final is not None else None
    nodes_at_final = bool(status) and all(s.get("version") == final and s.get("fingerprint") == last_fp
                                          for s in status.values())
    engines_at_final = all(any(e.get("event") == "switch" and e.get("version") == final and e.get("ok")
                               for e in evs) for evs in events.values())
    # The measured window: from the end of the last warm-up step to the end of the last step.
    t0 = rows[args.warmup - 1]["time"] if args.warmup and len(rows) >= args.warmup else None
    t1 = rows[-1]["time"] if rows else None
    if t0 is None and rows:
        t0 = rows[0]["time"] - rows[0]["step_s"]
    tokens = sum(e.get("tokens", 0) for evs in events.values() for e in evs
                 if e.get("event") == "batch" and t0 is not None and t0 < e["time"] <= t1)
    window = (t1 - t0) if t0 is not None and t1 is not None else None
    # Sync latency: the trainer's publish() call for version v (end of its optimizer step; the row's time is
    # when the version was published, after extract + encode + node.publish) -> the last rollout engine serving v.
    lat = []
    for r in measured:
        v = r.get("version")
        if not v or MODES[mode] is False:
            continue
        called = r["time"] - r.get("encode_s", 0.0) - r.get("publish_s", 0.0)
        ts = [min((e["time"] for e in evs if e.get("event") == "switch" and e.get("version") == v), default=None)
              for evs in events.values()]
        if ts and all(x is not None for x in ts):
            lat.append(max(ts) - called)
    dollars_per_s = sum(cfg.prices[m.node_class] for m in cfg.machines()) / 3600
    payloads = [r.get("payload_bytes", 0) for r in measured]
    return {
        "mode": mode, "sync": MODES[mode], "steps": len(rows), "measured_steps": len(measured),
        "step_s": [round(r["step_s"], 3) for r in measured],
        "median_step_s": None if not measured else round(median([r["step_s"] for r in measured]), 3),
        "median_train_s": None if not measured else round(median([r.get("train_s") for r in measured]), 3),
        "tokens": tokens, "window_s": None if window is None else round(window, 2),
        "tokens_per_s": None if not window else round(tokens / window, 1),
        "tokens_per_dollar": None if not window else round(tokens / (dollars_per_s * window), 1),
        "payload_bytes_per_step": median(payloads), "full_bytes": rows[-1].get("full_bytes") if rows else None,
        "changed_fraction": median([r.get("changed_fraction") for r in measured]),
        "bytes_in_rollouts": sum(s.get("bytes_in") or 0 for n, s in status.items() if n != "trainer"),
        "median_sync_s": None if not lat else round(median(lat), 3),
        "median_switch_s": median([e.get("switch_s") for evs in events.values() for e in evs
                                    if e.get("event") == "switch" and (e.get("version") or 0) > args.warmup]),
        "reward_last": rows[-1].get("reward_mean") if rows else None,
        "final_version": final, "switches_checked": switches, "mismatches": mismatches,
        "bit_exact": not mismatches and nodes_at_final and engines_at_final and switches > 0,
        "nodes": status,
    }


# ---- the suite --------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from p2psync import keys
    from p2psync.testbed.runner import Testbed

    cfg = testbed_config(args)
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    keydir = work / "keys"
    keys.write_pair(keys.generate(), keydir)
    _CA[0] = str(keydir)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with Testbed.up(cfg, Path(args.state_dir) if args.state_dir else None) as tb:
        for rnd in range(args.rounds):
            for r in run_modes(tb, modes, args, work / f"round{rnd + 1}", keydir, BASE_PORT + rnd * len(modes)):
                results[r["mode"]].append(r)
    return {"testbed": cfg, "results": results}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_status":  # inside the core namespace (see node_status)
        return _poll_status(sys.argv[2:])
    if len(sys.argv) > 2 and sys.argv[1] == "--render":  # rows, table and chart again from a run's JSON
        src = Path(sys.argv[2])
        write_outputs(json.loads(src.read_text()), src.parent, src.stem.removeprefix("wan_rl"))
        return 0
    os.environ.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="testbed description (TOML/JSON); default: the built-in testbed")
    ap.add_argument("--name", default="wanrl", help="testbed name (namespace prefix)")
    ap.add_argument("--regions", default="us-east,eu-west",
                    help="regions of the testbed to use, the trainer's first (default: a 1 Gbit/s and a 200 Mbit/s one)")
    ap.add_argument("--per-region", type=int, default=2, help="rollout machines per region")
    ap.add_argument("--modes", default="nosync,p2psync,full")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the modes, interleaved, this many times")
    ap.add_argument("--concurrent", action="store_true",
                    help="run the modes side by side (a quick correctness check; step times not comparable)")
    ap.add_argument("--preset", default="small", help="model preset of trainer/workload.py (random init)")
    ap.add_argument("--task", default="add_small")
    ap.add_argument("--lr", type=float, default=1e-6, help="an RL fine-tuning rate: the delta is sparse")
    ap.add_argument("--steps", type=int, default=8, help="measured GRPO steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="GRPO steps dropped at the start of each mode")
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="k of the GRPO job and the coordinator (1, the GRPO default: generation of the next batch "
                         "overlaps the sync; 0: on-policy, the sync is on every step's path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--node-args", default="",
                    help="extra node settings for every node, space separated (e.g. '--gossip.interval=0.25')")
    ap.add_argument("--rollout-seconds", type=float, default=60.0,
                    help="config-rate cost model: generation seconds per RL step (as tools/bench_wan.py)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per mode")
    ap.add_argument("--work", default="/tmp/p2psync-wan-rl", help="scratch space (node data, logs, events)")
    ap.add_argument("--keep-work", action="store_true", help="leave the scratch space (default: removed)")
    ap.add_argument("--state-dir", help="testbed state folder (default /run/p2psync-testbed)")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--tag", default="", help="suffix of the output names (wan_rl<TAG>.json/.md/.png)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    NODE_ARGS[:] = args.node_args.split()
    from bench_wan import machine_note

    header = {"command": "tools/bench_wan_rl.py " + " ".join(sys.argv[1:]), "machine": machine_note(),
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "workload": {k: getattr(args, k) for k in ("preset", "task", "lr", "steps", "warmup", "groups_per_step",
                                                        "group_size", "max_staleness", "seed", "rounds",
                                                        "node_args")}}
    try:
        res = run(args)
    finally:
        if not args.keep_work:
            shutil.rmtree(args.work, ignore_errors=True)
    doc = {**header, "rollout_seconds": args.rollout_seconds, "concurrent": args.concurrent,
           "load_average_end": [round(x, 1) for x in os.getloadavg()], "testbed": res["testbed"].to_dict(),
           "results": res["results"]}
    rows = write_outputs(doc, Path(args.out), args.tag)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
