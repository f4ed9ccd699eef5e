"""The orchestration behind ``p2psync demo`` (see :mod:`demo.cli` for what it shows)."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from demo.cluster import ClusterSpec, LocalCluster
from demo.monitor import Monitor
from demo.summary import headline, median, summarize


SHOWCASE: dict[str, Any] = {
    "steps": 60, "preset_e2e": "demo", "task": "add_small", "lr": 7.5e-5, "adam_eps": 1e-3, "reward": "exact",
    "temperature": 1.0, "group_size": 8, "groups_per_step": 8, "warm_start_steps": 40, "warm_start_noise": 0.5,
    "warm_start_batch": 16, "rollouts_per_region": 2,
}
"""The default run: the sparse RL regime (see the README's "What the demo shows")."""
QUICK: dict[str, Any] = {
    "steps": 4, "preset_e2e": "mini", "task": "add_small", "lr": 1e-2, "adam_eps": 1e-8, "reward": "shaped",
    "temperature": 1.0,
    "group_size": 8, "groups_per_step": 4, "warm_start_steps": 0, "warm_start_noise": 0.0, "warm_start_batch": 16,
    "rollouts_per_region": 1,
}
"""``--quick``: a 0.5M-parameter model from scratch at a high learning rate, a few steps (tests)."""


def apply_profile(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option left unset on the command line from ``--quick``'s or the showcase's values."""
    profile = QUICK if getattr(args, "quick", False) else SHOWCASE
    for key, val in profile.items():
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    return args


def regime(args: argparse.Namespace) -> dict[str, Any]:
    """What the run trains, for the report."""
    apply_profile(args)
    return {"model": args.model_path or f"preset {args.preset_e2e}", "task": args.task, "lr": args.lr,
            "adam_eps": args.adam_eps, "reward": args.reward, "temperature": args.temperature, "group_size": args.group_size,
            "groups_per_step": args.groups_per_step, "warm_start_steps": args.warm_start_steps,
            "warm_start_noise": args.warm_start_noise, "warm_start_batch": args.warm_start_batch,
            "max_staleness": args.max_staleness,
            "regions": args.regions, "relays_per_region": args.relays_per_region,
            "rollouts_per_region": args.rollouts_per_region, "seed": args.seed}


def _trainer_options(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    apply_profile(args)
    opts: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "max_staleness": args.max_staleness,
                            "metrics_path": str(out / "metrics.jsonl"), "sync": not args.no_sync,
                            "versions_path": str(out / "versions.jsonl"), "preset": args.preset_e2e,
                            "threads": 1, "done_path": str(out / "trainer.done.json"),
                            "temperature": args.temperature, "adam_eps": args.adam_eps, "reward": args.reward,
                            "warm_start_steps": args.warm_start_steps,
                            "warm_start_noise": args.warm_start_noise, "warm_start_batch": args.warm_start_batch,
                            # the rollout nodes only wait for version 0 meanwhile: both cores
                            "warm_start_threads": 2}
    first = getattr(args, "publish_first", "auto")
    if first != "auto":
        opts["publish_first"] = first == "on"
    for key in ("task", "group_size", "groups_per_step", "lr", "model_path"):
        val = getattr(args, key)
        if val is not None:
            opts[key] = val
    return opts


def _rollout_options(args: argparse.Namespace, out: Path, name: str, idx: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"engine": getattr(args, "engine", "hf"), "seed": args.seed * 1000 + idx, "threads": 1,
                            "switch": getattr(args, "switch", "step"),
                            "preset": args.preset_e2e, "events_path": str(out / "events" / f"{name}.jsonl")}
    if args.model_path:
        opts["model_path"] = args.model_path
    return opts


def start_cluster(args: argparse.Namespace, out: Path) -> tuple[LocalCluster, dict[str, Path]]:
    """Trainer, then the relays, then (once the coordinator's plan has placed the relays) the rollout nodes.

    Relays first, as a deployment would start its fixed infrastructure: the coordinator then plans
    them as the regions' entries, and the rollout nodes that join later are placed below them. (When
    a region's relay and rollout nodes join in the same burst, the coordinator's minimal re-plan
    places them one at a time and, all offers from the trainer being equal across the region
    boundary, can make a rollout node the region's entry with the relay below it.)
    """
    apply_profile(args)
    spec = ClusterSpec(regions=args.regions, rollouts_per_region=args.rollouts_per_region,
                       relays_per_region=args.relays_per_region, host=getattr(args, "host", "127.0.0.1"),
                       capture=str(Path(args.capture).resolve()) if getattr(args, "capture", None) else "")
    cluster = LocalCluster(out / "cluster", spec)
    (out / "events").mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1"}
    trainer = cluster.start("trainer", "trainer", spec.region_name(0), job="demo.jobs:trainer",
                            job_config=_trainer_options(args, out))
    seeds = [trainer.url]
    events: dict[str, Path] = {}
    relays: dict[str, list[str]] = {}
    for r in range(spec.regions):
        region = spec.region_name(r)
        relays[region] = [cluster.start(f"{region}-relay{k + 1}", "relay", region, parents=[trainer.url],
                                        seeds=seeds, env=env).url for k in range(spec.relays_per_region)]
    cluster.wait_planned([p.name for p in cluster.by_role("relay")], timeout=30.0)
    idx = 0
    for r in range(spec.regions):
        region = spec.region_name(r)
        for k in range(spec.rollouts_per_region):
            name = f"{region}-rollout{k + 1}"
            idx += 1
            parents = [relays[region][k % len(relays[region])]] if relays[region] else []
            opts = _rollout_options(args, out, name, idx)
            events[name] = Path(opts["events_path"])
            cluster.start(name, "rollout", region, parents=[*parents, trainer.url], seeds=seeds,
                          job="demo.jobs:rollout", job_config=opts, env=env)
    return cluster, events


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from demo import dashboard, report

    apply_profile(args)
    con = Console()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    plain = args.plain or not con.is_terminal
    t_start = time.time()
    con.print(f"starting a trainer, {args.regions * args.relays_per_region} relays and "
              f"{args.regions * args.rollouts_per_region} rollout nodes in {args.regions} regions (logs in "
              f"{out / 'cluster' / 'logs'})")
    # SIGTERM (a CI timeout, `kill`) ends the demo like Ctrl-C: the cluster is stopped on the way
    # out instead of the interpreter dying with the nodes left running (and if the demo is killed
    # outright, each node stops itself: P2PSYNC_EXIT_WITH_PARENT).
    def _terminate(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    # Compile the codec's kernels once here (numba caches them beside the source) rather than in
    # every node process at once: on a fresh checkout that is ~7 compilations racing on the cores.
    t_warm = time.time()
    from p2psync.codec.decode import warm_up

    warm_up()
    if time.time() - t_warm > 5:
        con.print(f"compiled the codec kernels in {time.time() - t_warm:.0f} s (cached for later runs)")
    about = regime(args)
    cluster, events = start_cluster(args, out)
    mon = Monitor(cluster, out / "metrics.jsonl", events, versions_path=out / "versions.jsonl")
    mon.start()
    done_path = out / "trainer.done.json"
    outcome: dict[str, Any] | None = None
    failed: list[str] = []
    final_reached = False
    last_step = None
    live = None
    try:
        if not plain:
            live = Live(console=con, refresh_per_second=2, transient=False)
            live.start()
        deadline = t_start + args.timeout
        while time.time() < deadline:
            snap = mon.snapshot()
            versions = sorted(snap["expected"])
            if live is not None:
                so_far = summarize(snap, problems=[], wall_s=time.time() - t_start, regime=about)
                live.update(dashboard.render(snap, so_far, args.steps, "nodes"))
            elif snap["steps"] and snap["steps"][-1].get("step") != last_step:
                last_step = snap["steps"][-1].get("step")
                con.print(dashboard.plain_line(snap, args.steps), highlight=False)
            failed = [p.name for p in cluster.procs if not p.alive]
            if failed:
                break
            if outcome is None and done_path.exists():
                outcome = json.loads(done_path.read_text())
                if outcome.get("rc"):
                    break
            if outcome is not None and versions:
                head = versions[-1]
                followers = [v for v in snap["nodes"].values() if v.role != "trainer"]
                if followers and all(v.version == head for v in followers):
                    final_reached = True
                    break
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()
        cpu = cluster.cpu_seconds()
        codes = cluster.stop()
        mon.stop()
    snap = mon.snapshot()
    problems = []
    if snap["mismatches"]:
        problems.append(f"{len(snap['mismatches'])} fingerprint mismatches")
    if failed:
        problems.append(f"processes died: {', '.join(failed)}")
    if outcome is None:
        problems.append("the training job did not finish in time" if time.time() >= t_start + args.timeout
                        else "the training job did not finish")
    elif outcome.get("rc"):
        problems.append(f"the training job failed: {outcome.get('error', outcome)}")
    if outcome is not None and not outcome.get("rc") and not final_reached:
        problems.append("not every node reached the last version")
    bad_exit = {n: c for n, c in codes.items() if c not in (0, None, -15)}
    if bad_exit:
        problems.append(f"non-zero exit codes: {bad_exit}")
    roles = {p.name: p.role for p in cluster.procs}
    switch_s = [s.get("switch_s") for s in snap["switches"] if s.get("switch_s") is not None]
    summary = summarize(snap, problems=problems, wall_s=time.time() - t_start, regime=about, extra={
        "median_switch_s": median(switch_s), "exit_codes": codes, "cpu_s": cpu,
        "cpu_s_by_role": {r: round(sum(c for n, c in cpu.items() if roles.get(n) == r), 2)
                          for r in sorted(set(roles.values()))},
    })
    index = report.write(out / "report", snap, summary)
    if not plain:
        con.print(dashboard.render(snap, summary, args.steps, "final state", running=False))
    else:
        for label, value in headline(summary, args.steps):
            con.print(f"{label}: {value}", highlight=False)
    con.print(f"report: {index}")
    if problems:
        con.print(f"[red]FAILED: {'; '.join(problems)}[/]")
        for m in snap["mismatches"][:10]:
            con.print(f"  {m.node} v{m.version} ({m.source}): {m.seen[:16]} != trainer {m.expected[:16]}")
        print(f"see the logs in {out / 'cluster' / 'logs'}", file=sys.stderr)
        return 1
    con.print("[green]OK: every rollout node and engine held exactly the trainer's bits at every version[/]")
    return 0
