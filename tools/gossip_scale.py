"""Gossip scale figures: convergence rounds, traffic per node, false suspicions under loss.

Drives N simulated GossipNodes through the in-memory pump (fake clock, seeded), with the
default GossipConfig (interval 1 s, fanout 2, suspect 10 s, dead 20 s).

    python tools/gossip_scale.py --nodes 1000
"""

from __future__ import annotations

import argparse
import logging
import time

from p2psync.gossip.sim import Faults, Sim, default_member


def status_is(mid: str, status: str):
    return lambda nd: (e := nd.members.get(mid)) is not None and e.status == status


def traffic(sim: Sim, seconds: float, churn: bool, step: int = 30) -> tuple[float, float]:
    """Mean and max bytes sent per node per second over ``seconds`` of simulated time."""
    before = dict(sim.bytes_sent)
    start = sim.now
    n = len(sim.nodes)
    trainer = sim.nodes[default_member(0).address]
    for s in range(int(seconds)):
        if churn:
            if s % 10 == 0:  # one join and one leave every 10 s
                e = default_member(n + s)
                sim.join(e, seeds=(default_member(0).address,))
                sim.leave(default_member(1 + (s // 10) * 3).address)
            if s % step == 0:  # a new head version: trainer publishes head + plan, every node reports its versions
                v = s // step + 1
                trainer.publish("head", {"version": v}, sim.now)
                parents = {nd.id: trainer.id for nd in sim.running() if nd.id != trainer.id}
                trainer.publish("plan", {"epoch": v, "root": trainer.id, "parents": parents}, sim.now)
                for nd in sim.running():
                    nd.update_self(sim.now, versions=(v - 1, v), throughput=1100.0)
        sim.run_until(start + s + 1)
    secs = sim.now - start
    sent = [(sim.bytes_sent[a] - before.get(a, 0)) / secs for a in sim.nodes]
    return sum(sent) / len(sent), max(sent)


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--loss-rounds", type=int, default=120)
    ap.add_argument("--step-seconds", type=int, default=30, help="seconds between head versions in the churn run")
    args = ap.parse_args()
    n, t0 = args.nodes, time.time()

    sim = Sim.cluster(n, seed=args.seed, count_bytes=True)
    sim.run_until(3.0)
    idle = traffic(sim, 20, churn=False)
    joiner = default_member(n + 100_000)
    sim.join(joiner, seeds=(default_member(0).address,))
    r_join = sim.rounds_until(status_is(joiner.id, "alive"))
    leaver = default_member(n - 1)
    sim.leave(leaver.address)
    r_leave = sim.rounds_until(status_is(leaver.id, "left"))
    victim = default_member(n - 2)
    sim.crash(victim.address)
    r_suspect = sim.rounds_until(status_is(victim.id, "suspect"), share=0.99, max_rounds=100)
    r_dead = sim.rounds_until(status_is(victim.id, "dead"), max_rounds=100)
    churn = traffic(sim, 60, churn=True, step=args.step_seconds)
    print(f"nodes {n}, seed {args.seed}")
    print(f"join: 99 % of nodes know the joiner alive after {r_join} rounds")
    print(f"leave: 99 % know the leaver left after {r_leave} rounds")
    print(f"failure: 99 % hold it suspect after {r_suspect} rounds, dead after {r_suspect + r_dead} rounds "
          f"(suspect_after 10 s + dead_after 20 s + spreading)")
    print(f"traffic idle: mean {idle[0] / 1e3:.2f} KB/s per node, max {idle[1] / 1e3:.2f} KB/s")
    print(f"traffic with churn (1 join + 1 leave / 10 s, every {args.step_seconds} s a new version on every node "
          f"(reported to the coordinator) + head + plan): "
          f"mean {churn[0] / 1e3:.2f} KB/s per node, max {churn[1] / 1e3:.2f} KB/s")

    for loss in (0.05, 0.20):
        lossy = Sim.cluster(n, seed=args.seed + 7, faults=Faults(drop=loss, delay=0.05, max_delay=2.0))
        lossy.run_until(float(args.loss_rounds))
        suspected = {m for nd in lossy.nodes.values() for _, m in nd.members.suspicions}
        dead = sum(1 for nd in lossy.nodes.values() for e in nd.members.entries.values() if e.status == "dead")
        print(f"loss {loss:.0%}: {len(suspected)} of {n} live members ever suspected in {args.loss_rounds} rounds "
              f"({len(suspected) / n:.2%}), dead entries about live members: {dead}")
    print(f"wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
