"""Gossip and live-coordinator scale figures on N simulated nodes (in-memory pump, fake clock, seeded).

Every node runs the real :class:`~p2psync.gossip.protocol.GossipNode` with the default
GossipConfig (interval 1 s, fanout 2); node 0 is the trainer, the coordinator: it signs its
entries with a trainer key and runs the real live plan (``LivePlanner`` and
:mod:`p2psync.control.plan_gossip`, as the node's gossip service does) once per second when the
alive membership changed. Nodes do not verify signatures here (that costs each node, not the
coordinator); bytes are of the compact JSON each message serializes to, and a message over its
receiver's ``max_body_bytes`` (1 MiB) is dropped as that node's server would refuse it (``oversize``).

Phases, each on a fresh cluster so that memory stays one cluster's:

- ``cluster``: initial plan, 20 s idle, a join, a graceful leave, the crash of the relay with
  the most children (rounds until 99 % know each; seconds until every child of the dead relay
  follows a new planned parent), then 60 s at 1 % churn per minute (joins and leaves) with a
  new head version every ``--step-seconds`` reported by every node.
- ``churn`` (not by default): the cluster phase's idle and churn figures alone; with
  ``--preplanned`` the first plan is handed to every node at set-up instead of spread (at 10,000 the
  spreading is ~15 rounds of bulk exchange).
- ``partition``: regions r00-r03 cut off from r04-r07 for ``--partition-seconds`` (each side
  declares the other dead), then healed: rounds until 99 % (and all) of the nodes hold one
  membership view (the same table root) in which every running node is alive.
- ``leases`` (not by default): 30 s in which each node's lease entry is rewritten every
  ``--lease-seconds`` (60): the bytes per node that lease entries add (each goes to its holder
  only, so the figure does not grow with n).
- ``loss``: ``--loss-rounds`` rounds at 5 % and at 20 % message loss (plus 5 % delayed up to 2 s):
  members ever suspected (all are alive).

    python tools/gossip_scale.py --nodes 10000 --json docs/benchmarks/gossip_scale_10000.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from p2psync import keys
from p2psync.control import plan_gossip
from p2psync.control.live_plan import LivePlanner
from p2psync.gossip.items import PLAN_PREFIX
from p2psync.gossip.signing import signer
from p2psync.gossip.sim import Faults, Sim, default_member

TRAINER = default_member(0)


def status_is(mid: str, status: str):
    return lambda nd: (e := nd.members.get(mid)) is not None and e.status == status


def not_alive(mid: str):
    return lambda nd: (e := nd.members.get(mid)) is not None and e.status != "alive"


class Coordinator:
    """The trainer node's control plane in the sim: its GossipNode (timed) and the live plan."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.g = sim.nodes[TRAINER.address]
        self.g.coord.sign = signer(keys.generate())
        self.planner = LivePlanner(self.g.id)
        self.plan_step = plan_gossip.PlanStep(self.planner)
        self.cpu = 0.0  # process time inside the trainer's gossip node and its re-plans
        self.replans: list[float] = []
        g, tick, receive = self.g, self.g.tick, self.g.receive

        def timed_tick(now):
            t = time.process_time()
            try:
                return tick(now)
            finally:
                self.cpu += time.process_time() - t

        def timed_receive(now, sender, msg):
            t = time.process_time()
            try:
                return receive(now, sender, msg)
            finally:
                self.cpu += time.process_time() - t
        g.tick, g.receive = timed_tick, timed_receive  # type: ignore[method-assign]

    def react(self) -> bool:
        """What the gossip service's plan task does after a change (``GossipService._replan``): the
        members to plan for and ``LivePlanner.update`` (skipped by ``PlanStep`` when neither the member
        table nor a reported bandwidth changed; None unless membership or figures moved), and
        the changed plan shards published. The service runs it after each change, at most every
        ``control.replan_delay`` (0.5 s); here once per round."""
        t = time.process_time()
        new = self.plan_step.run(self.g, (), None)
        if new is not None:
            plan_gossip.publish(self.g, new, self.sim.now)
            self.replans.append(time.process_time() - t)
        self.cpu += time.process_time() - t
        return new is not None

    def step(self, seconds: int = 1) -> None:
        for _ in range(seconds):
            self.react()
            self.sim.run_until(self.sim.now + 1.0)


def rounds(coord: Coordinator, pred, share: float = 0.99, max_rounds: int = 100) -> int | None:
    sim = coord.sim
    for r in range(1, max_rounds + 1):
        coord.step()
        if sim.fraction(pred) >= share:
            return r
    return None


def follows(coord: Coordinator):
    """Predicate: the node follows a planned parent (or is the coordinator)."""
    return lambda nd: nd.id == coord.g.id or plan_gossip.planned_parent(nd, nd.id) is not None


def per_node_rate(sim: Sim, before: dict[str, int], seconds: float) -> tuple[float, float]:
    sent = [(sim.bytes_sent[a] - before.get(a, 0)) / seconds for a in sim.nodes]
    return sum(sent) / len(sent), max(sent)


def _started(n: int, seed: int, out: dict[str, Any], log, preplanned: bool = False) -> Coordinator:
    """A cluster of ``n`` whose first plan reached every node, then 20 idle seconds measured. With
    ``preplanned`` the plan's shards are handed to every node at set-up, as the member tables are
    (the spreading of the first plan, ~15 rounds of bulk exchange at 10,000, is not simulated)."""
    sim = Sim.cluster(n, seed=seed, count_bytes=True)
    coord = Coordinator(sim)
    coord.react()
    out["replan_cpu_initial_s"] = round(coord.replans[0], 3)
    if preplanned:
        shards = [e for name, e in coord.g.coord.entries.items() if name.startswith(PLAN_PREFIX)]
        for nd in sim.nodes.values():
            for e in shards:
                nd.coord.merge(e, sim.now)
        out["preplanned"] = True
        log(f"first plan handed to every node ({len(shards)} shards)")
    else:
        out["plan_spread_rounds"] = rounds(coord, follows(coord), share=1.0, max_rounds=120)
        log(f"initial plan reached every node after {out['plan_spread_rounds']} rounds")

    before, cpu0, t0 = dict(sim.bytes_sent), coord.cpu, sim.now
    coord.step(20)
    idle = per_node_rate(sim, before, sim.now - t0)
    out["bytes_per_node_per_s_idle"], out["bytes_per_node_per_s_idle_max"] = round(idle[0]), round(idle[1])
    out["coordinator_cpu_per_round_s"] = round((coord.cpu - cpu0) / (sim.now - t0), 5)
    log(f"idle: {idle[0]:.0f} B/s per node (max {idle[1]:.0f}), coordinator CPU "
        f"{out['coordinator_cpu_per_round_s'] * 1e3:.2f} ms per round")
    return coord


def phase_cluster(n: int, seed: int, step_seconds: int, out: dict[str, Any], log) -> None:
    coord = _started(n, seed, out, log)
    sim = coord.sim
    joiner = default_member(n + 100_000)
    sim.join(joiner, seeds=(TRAINER.address,))
    out["joiner_rounds_p99"] = rounds(coord, status_is(joiner.id, "alive"))
    leaver = default_member(n - 1)
    sim.leave(leaver.address)
    out["leaver_rounds_p99"] = rounds(coord, status_is(leaver.id, "left"))
    log(f"joiner known by 99 % after {out['joiner_rounds_p99']} rounds, leaver {out['leaver_rounds_p99']}")

    plan = coord.planner.plan
    assert plan is not None
    children = plan.children()
    victim = max((c for c in children if c != plan.root), key=lambda c: len(children[c]))
    affected = [sim.nodes[default_member(int(c[1:])).address] for c in children[victim]]
    crash_at = sim.now
    sim.crash(default_member(int(victim[1:])).address)
    moved_at: dict[str, float] = {}
    known = None
    for r in range(1, 121):
        coord.step()
        for nd in affected:
            pp = plan_gossip.planned_parent(nd, nd.id)
            if nd.id not in moved_at and pp is not None and pp[2] != victim:
                moved_at[nd.id] = sim.now
        if known is None and sim.fraction(not_alive(victim)) >= 0.99:
            known = r
        if known is not None and len(moved_at) == len(affected):
            break
    out["failure_rounds_p99"] = known
    out["failure_victim_children"] = len(affected)
    out["failure_to_new_parent_s"] = (round(max(moved_at.values()) - crash_at, 1)
                                      if len(moved_at) == len(affected) else None)
    out["replan_cpu_max_s"] = round(max(coord.replans[1:] or [0.0]), 3)
    log(f"crash of {victim} ({len(affected)} children): 99 % know it after {known} rounds, every child "
        f"follows a new parent after {out['failure_to_new_parent_s']} s")

    _churn(coord, n, seed, step_seconds, out, log)


def phase_churn(n: int, seed: int, step_seconds: int, out: dict[str, Any], log, preplanned: bool) -> None:
    """The cluster phase's idle and churn figures alone (no join, leave or crash before the churn)."""
    _churn(_started(n, seed, out, log, preplanned), n, seed, step_seconds, out, log)


def _churn(coord: Coordinator, n: int, seed: int, step_seconds: int, out: dict[str, Any], log) -> None:
    """60 s in which 1 % of the nodes join or leave per minute, with a new head every ``step_seconds``
    reported by every node. Running figures are logged every 10 s (a run stopped early still tells)."""
    sim = coord.sim
    rng = random.Random(seed)
    events = max(1, n // 100)
    before, cpu0, t0, plans0 = dict(sim.bytes_sent), coord.cpu, sim.now, len(coord.replans)
    next_id, version = n + 200_000, 1
    for s in range(60):
        for k in range(events * s // 60, events * (s + 1) // 60):
            if k % 2 == 0:
                sim.join(default_member(next_id), seeds=(TRAINER.address,))
                next_id += 1
            else:
                victims = [nd for nd in sim.running() if nd.id != coord.g.id and not nd.members.me.status == "left"]
                sim.leave(rng.choice(victims).members.me.address)
        if s % step_seconds == 0:
            version += 1
            coord.g.publish("head", {"version": version}, sim.now)
            for nd in sim.running():
                nd.update_self(sim.now, versions=(version - 1, version), throughput=1100.0)
        coord.step()
        if s % 10 == 9 and s < 59:
            rate = per_node_rate(sim, before, sim.now - t0)
            log(f"churn, {s + 1} s: {rate[0]:.0f} B/s per node, coordinator CPU "
                f"{(coord.cpu - cpu0) / (sim.now - t0) * 1e3:.2f} ms per round so far")
    churn = per_node_rate(sim, before, sim.now - t0)
    out["bytes_per_node_per_s_churn"], out["bytes_per_node_per_s_churn_max"] = round(churn[0]), round(churn[1])
    out["coordinator_cpu_per_round_s_churn"] = round((coord.cpu - cpu0) / (sim.now - t0), 5)
    out["replans_churn"] = len(coord.replans) - plans0
    out["oversize_messages"] = sim.oversize
    log(f"churn: {churn[0]:.0f} B/s per node (max {churn[1]:.0f}), coordinator CPU "
        f"{out['coordinator_cpu_per_round_s_churn'] * 1e3:.2f} ms per round; oversize messages {sim.oversize}")


def phase_leases(n: int, seed: int, lease_seconds: int, out: dict[str, Any], log) -> None:
    """30 s in which every node's ``leases/<node>`` entry is rewritten once per ``lease_seconds`` (a
    work item granted or completed, as ``lease_core._publish_leases`` writes it): each goes from the
    coordinator to its holder only, so a node's share is its own entries. Measured once the first plan
    reached every node, after 10 idle seconds (the baseline, ``..._leases_idle``)."""
    sim = Sim.cluster(n, seed=seed + 5, count_bytes=True)
    coord = Coordinator(sim)
    coord.react()
    rounds(coord, follows(coord), share=1.0, max_rounds=120)
    before, t0 = dict(sim.bytes_sent), sim.now
    coord.step(10)
    out["bytes_per_node_per_s_leases_idle"] = round(per_node_rate(sim, before, sim.now - t0)[0])
    ids = [nd.id for nd in sim.nodes.values() if nd is not coord.g]
    rng = random.Random(seed)
    before, cpu0, t0 = dict(sim.bytes_sent), coord.cpu, sim.now
    for s in range(30):
        t = time.process_time()
        for k in range(len(ids) * s // lease_seconds, len(ids) * (s + 1) // lease_seconds):
            node = ids[k % len(ids)]
            coord.g.publish(f"leases/{node}", [[f"w{rng.randrange(10**6)}", round(sim.now + 30.0, 3)]], sim.now)
        coord.cpu += time.process_time() - t
        coord.step()
    rate = per_node_rate(sim, before, sim.now - t0)
    out["bytes_per_node_per_s_leases"] = round(rate[0])
    out["coordinator_cpu_per_round_s_leases"] = round((coord.cpu - cpu0) / (sim.now - t0), 5)
    log(f"a lease entry per node every {lease_seconds} s: {rate[0]:.0f} B/s per node (max {rate[1]:.0f}; "
        f"{out['bytes_per_node_per_s_leases_idle']} B/s idle before), "
        f"coordinator CPU {out['coordinator_cpu_per_round_s_leases'] * 1e3:.2f} ms per round")


def one_view(sim: Sim) -> tuple[float, bool]:
    """Share of running nodes on the most common table root, and whether every running node is alive there."""
    run = sim.running()
    roots = Counter(nd.index.root for nd in run)
    root, count = roots.most_common(1)[0]
    holder = next(nd for nd in run if nd.index.root == root)
    ok = all((e := holder.members.get(nd.id)) is not None and e.status == "alive" for nd in run)
    return count / len(run), ok


def phase_partition(n: int, seed: int, seconds: int, out: dict[str, Any], log) -> None:
    sim = Sim.cluster(n, seed=seed + 3)
    sim.run_until(3.0)
    side = lambda addr: int(addr.split(".")[-1].split(":")[0]) % 8 < 4  # noqa: E731  (regions r00-r03 / r04-r07)
    sim.partition(side)
    sim.run_until(sim.now + seconds)
    a = sim.nodes[default_member(1).address]
    out["partition_dead_across"] = sum(1 for e in a.members.entries.values() if e.status == "dead")
    sim.heal()
    r99 = r100 = None
    for r in range(1, 121):
        sim.run_until(sim.now + 1.0)
        share, ok = one_view(sim)
        log(f"  heal round {r}: {share:.1%} of the nodes on the most common view")
        if ok and share >= 0.99 and r99 is None:
            r99 = r
        if ok and share == 1.0:
            r100 = r
            break
    out["partition_heal_rounds"], out["partition_heal_rounds_all"] = r99, r100
    log(f"partition of {seconds} s (a node held {out['partition_dead_across']} members dead): one view at "
        f"99 % after {r99} rounds, at 100 % after {r100}")


def phase_loss(n: int, seed: int, loss_rounds: int, out: dict[str, Any], log) -> None:
    for loss in (0.05, 0.20):
        sim = Sim.cluster(n, seed=seed + 7, faults=Faults(drop=loss, delay=0.05, max_delay=2.0))
        sim.run_until(float(loss_rounds))
        suspected = {m for nd in sim.nodes.values() for _, m in nd.members.suspicions}
        dead = sum(1 for nd in sim.nodes.values() for e in nd.members.entries.values() if e.status == "dead")
        key = f"loss{round(loss * 100)}"
        out[f"false_suspicions_{key}"], out[f"dead_entries_{key}"] = len(suspected), dead
        log(f"loss {loss:.0%}: {len(suspected)} of {n} live members ever suspected in {loss_rounds} rounds, "
            f"dead entries about live members: {dead}")
        del sim


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    # N simulated nodes hold N x N entries (10**8 objects at 10,000): a full pass of the cyclic
    # collector then costs seconds, lands in whatever code allocates (the coordinator's receive
    # measured 0.43 s a round, mostly that) and is no cost of the code measured. The simulator's
    # objects form no cycles that matter; each phase collects once when it ends.
    gc.disable()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--loss-rounds", type=int, default=120)
    ap.add_argument("--partition-seconds", type=int, default=60)
    ap.add_argument("--step-seconds", type=int, default=30, help="seconds between head versions in the churn minute")
    ap.add_argument("--lease-seconds", type=int, default=60, help="seconds between lease entries of one node (leases)")
    ap.add_argument("--phases", default="cluster,partition,loss", help="comma-separated subset of the phases "
                    "(also: leases, 30 s of lease entries; churn, the cluster phase's idle and churn figures alone)")
    ap.add_argument("--preplanned", action="store_true", help="churn phase: hand the first plan to every "
                    "node at set-up instead of spreading it (plan_spread_rounds is then not measured)")
    ap.add_argument("--json", type=Path, help="write the figures here (merged into the file if it exists)")
    args = ap.parse_args()
    n, t0 = args.nodes, time.time()
    out: dict[str, Any] = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    out.update(nodes=n, seed=args.seed, machine=platform.node(), date=time.strftime("%Y-%m-%d"),
               command=" ".join(["python", *sys.argv]))

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f} s] {msg}", flush=True)

    for phase in args.phases.split(","):
        t = time.time()
        {"cluster": lambda: phase_cluster(n, args.seed, args.step_seconds, out, log),
         "churn": lambda: phase_churn(n, args.seed, args.step_seconds, out, log, args.preplanned),
         "partition": lambda: phase_partition(n, args.seed, args.partition_seconds, out, log),
         "loss": lambda: phase_loss(n, args.seed, args.loss_rounds, out, log),
         "leases": lambda: phase_leases(n, args.seed, args.lease_seconds, out, log)}[phase]()
        out[f"wall_s_{phase}"] = round(time.time() - t)
        gc.collect()
        if args.json:
            args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    log("done")


if __name__ == "__main__":
    main()
