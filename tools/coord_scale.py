"""The live coordinator alone at N members (100,000 and beyond): CPU per gossip round and bytes it sends.

A full gossip simulation holds every node's table (N x N entries): 10,000 nodes is the most this
machine holds (``tools/gossip_scale.py``). This tool runs only the trainer's control plane, the real
code: its :class:`~p2psync.gossip.protocol.GossipNode` (the member table of N members, the
coordinator state, the failure detector) and the live plan (:class:`~p2psync.control.live_plan.
LivePlanner` through :mod:`p2psync.control.plan_gossip`, as the gossip service runs it). What the other
N - 1 nodes send it each round is generated from the protocol's rules instead of by N simulated
nodes:

- ``Syn`` s: each node opens ``fanout`` exchanges a round with peers drawn uniformly from its live
  members, so the coordinator gets about ``fanout`` of them (a Poisson draw). Idle, their roots
  equal its own (no reply). Under churn a peer's root differs in one key, which the peer holds one
  version older: the coordinator answers with its bucket hashes, gets the peer's ``Leaves`` for that
  bucket (one leaf differs), answers with a ``Digest`` of that leaf, gets a ``Delta`` that wants the
  key and answers it. Its own ``fanout`` Syns a round get a ``Buckets`` reply that differs in one
  bucket, answered with ``Leaves`` (a bucket holds ~1,560 keys at 100,000), and the peer's
  ``Digest`` of the one differing leaf with a ``Delta``. (Between 64 and ~2,000 members a bucket
  holds too few keys for ``Leaves``; the coordinator then answers Buckets with a ``Digest``.)
- ``Heartbeat`` s from the members that precede it on the watcher ring (``watchers + slack``).
- ``Report`` s, as members space them (``GossipNode.report_spacing``: ``live / report_budget``,
  500 s at 100,000): a member whose report is behind a new head sends it at its slot in the
  spacing, one with nothing new at its slot in ``max(report_interval, spacing)``; so about
  ``report_budget`` (200) a round after a new head, fewer between.
- Churn (1 % of the nodes per minute): joins and graceful leaves arrive as the member entries a
  peer's ``Delta`` carries, and each joiner's first exchange is with its seed, the coordinator (its
  table holds itself only: the coordinator answers with ``coordinator_max_entries``, 256); every peer
  names the same ``accept`` as the coordinator; a new head every ``--step-seconds``.

Figures: process CPU per round of every call into the coordinator (receive, tick, plan step and
publish), split into gossip and plan; bytes per second the coordinator sends (``wire_size`` of its
replies and its own messages). Checked against the full simulation at 10,000 (run this tool with
``--nodes 10000`` beside ``gossip_scale.py --nodes 10000``).

    python tools/coord_scale.py --nodes 100000 --json docs/benchmarks/coord_scale_100000.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from p2psync import keys
from p2psync.control import plan_gossip
from p2psync.control.live_plan import LivePlanner
from p2psync.gossip import GossipNode
from p2psync.gossip.index import hex32
from p2psync.gossip.items import BUCKETS, LEAVES, leaf_of
from p2psync.gossip.messages import Buckets, Delta, Digest, Heartbeat, Leaves, Message, Report, Syn, wire_size
from p2psync.gossip.signing import signer
from p2psync.gossip.sim import default_member


def poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p < limit:
            return k
        k += 1


class Harness:
    def __init__(self, n: int, seed: int, regions: int, replan_every: int = 1) -> None:
        self.replan_every = replan_every
        self.rng = random.Random(seed)
        self.n = n
        self.member = lambda i: default_member(i, regions)
        me = self.member(0)
        self.g = GossipNode(me, coordinator=me.id, seed=seed)
        self.g.coord.sign = signer(keys.generate())
        for i in range(1, n):
            self.g.members.merge(self.member(i), 0.0)
        self.plan_step = plan_gossip.PlanStep(LivePlanner(me.id))
        self.now = 0.0
        self.cpu_gossip = self.cpu_plan = 0.0
        self.sent = 0
        self.ids = [self.member(i) for i in range(1, n)]
        self.reports = {e.id: Report(e.id, 0, (0,), e.throughput, e.bandwidth) for e in self.ids}
        self.behind: set[str] = {e.id for e in self.ids}
        """Members whose report is due: behind the newest head, or (at the start) never sent."""
        self.heartbeat = 0
        self.next_id = n + 1_000_000

    def _send(self, out: list[tuple[str, Message]]) -> None:
        self.sent += sum(wire_size(m) for _, m in out)

    def _call(self, f, *args) -> list[tuple[str, Message]]:
        t = time.process_time()
        out = f(*args)
        self.cpu_gossip += time.process_time() - t
        self._send(out)
        return out

    def _peer(self) -> tuple[str, str]:
        e = self.ids[self.rng.randrange(len(self.ids))]
        return e.id, e.address

    def _one_older(self) -> tuple[int, str]:
        """A bucket and the key in it that a peer holds one version older than the coordinator does."""
        while not (keys_ := self.g.index.keys_in(b := self.rng.randrange(BUCKETS))):
            pass
        return b, keys_[self.rng.randrange(len(keys_))]

    def _older_leaves(self, sender: str) -> tuple[Leaves, str]:
        """The Leaves a peer that lacks the newest change of one key sends (that key's leaf differs),
        and the key."""
        g = self.g
        b, key = self._one_older()
        hashes = [hex32(h) for h in g.reconciler.leaf_hashes(b)]
        leaf = leaf_of(key)
        hashes[leaf] = "f" * 8 if hashes[leaf] != "f" * 8 else "0" * 8
        return Leaves(sender, (b,), "".join(hashes), g.config.max_body_bytes), key

    def _older_leaf_digest(self, sender: str, leaves: Leaves) -> Digest:
        """The peer's Digest of the leaf, in the one bucket ``leaves`` lists, of a key it holds one version
        older (drawn at random, as a change is)."""
        g = self.g
        b = leaves.buckets[0]
        keys_ = g.index.keys_in(b)
        leaf = leaf_of(keys_[self.rng.randrange(len(keys_))]) if keys_ else 0
        members, coord = g.members.entries, g.coord.entries
        items = [(k, members[k[2:]].version if k[0] == "m" else (coord[k[2:]].version,))
                 for k in keys_ if leaf_of(k) == leaf]
        if items:
            k, v = items[-1]
            items[-1] = (k, (*v[:-1], max(0, v[-1] - 1)))
        return Digest(sender, (), tuple(items), g.config.max_body_bytes, (b * LEAVES + leaf,))

    def round(self, churn: bool, events: float, new_head: bool) -> None:
        g, rng = self.g, self.rng
        # Joins and leaves, as a peer's Delta carries them.
        for _ in range(poisson(rng, events) if churn else 0):
            sender, addr = self._peer()
            if rng.random() < 0.5:
                e = self.member(self.next_id)
                self.next_id += 1
                self.ids.append(e)
                # The joiner's first exchange is with its seed, the coordinator: its table holds itself only.
                self._call(g.receive, self.now, e.address, Syn(e.id, "0" * 16, 1))
                self._call(g.receive, self.now, e.address,
                           Digest(e.id, tuple(range(64)), ((e.key, e.version),), g.config.max_body_bytes))
            else:
                i = rng.randrange(len(self.ids))
                e = replace(self.ids[i], status="left", status_at=self.now)
                self.ids[i] = self.ids[-1]
                self.ids.pop()
            self._call(g.receive, self.now, addr, Delta(sender, members=(e,)))
        if new_head:
            t = time.process_time()
            g.publish("head", {"version": int(self.now)}, self.now)
            self.cpu_gossip += time.process_time() - t
        # Syns from peers; under churn each starts a bucket exchange.
        for _ in range(poisson(rng, g.config.fanout)):
            sender, addr = self._peer()
            root = g.index.root if not churn else "0" * 16
            self._call(g.receive, self.now, addr, Syn(sender, root, g.index.count))
            if churn:  # the peer answers Buckets with Leaves, and the coordinator's Digest with a want
                leaves, key = self._older_leaves(sender)
                self._call(g.receive, self.now, addr, leaves)
                self._call(g.receive, self.now, addr, Delta(sender, want=(key,), accept=g.config.max_body_bytes))
        # Heartbeats from the members that precede the coordinator on the ring.
        self.heartbeat += 1
        c = g.config.detector
        for mid in g.members._neighbours(g.id, c.watchers + c.slack, -1):
            e = g.members.entries[mid]
            self._call(g.receive, self.now, e.address, Heartbeat(mid, e.incarnation, self.heartbeat))
        # Reports, spaced by the report budget: a member behind the new head at its slot in the
        # spacing, the others at their slot in max(report_interval, spacing).
        r = int(self.now)
        if new_head:
            self.behind = {e.id for e in self.ids}
        spacing = max(1, round(g.report_spacing()))
        idle = max(int(g.config.report_interval), spacing)
        for e in self.ids:
            i = int(e.id[1:])
            if e.id in self.behind and i % spacing == r % spacing:
                rep = self.reports.get(e.id) or Report(e.id, 0, (0,), e.throughput, e.bandwidth)
                rep = self.reports[e.id] = replace(rep, versions=(*rep.versions[-1:], r))
                self.behind.discard(e.id)
            elif i % idle == r % idle:
                rep = self.reports.get(e.id) or Report(e.id, 0, (0,), e.throughput, e.bandwidth)
            else:
                continue
            self._call(g.receive, self.now, e.address, rep)
        # The coordinator's own round, and the answers its Syns get.
        out = self._call(g.tick, self.now)
        if churn:  # a peer's Buckets differ in one bucket; the coordinator's Leaves, in one leaf
            for addr, m in out:
                if isinstance(m, Syn):
                    other = list(g.index.bucket_hex())
                    b = rng.randrange(BUCKETS)
                    other[8 * b] = "f" if other[8 * b] != "f" else "0"
                    for _, answer in self._call(g.receive, self.now, addr,
                                                Buckets("peer", "".join(other), g.config.max_body_bytes)):
                        if isinstance(answer, Leaves):
                            self._call(g.receive, self.now, addr, self._older_leaf_digest("peer", answer))
        # The plan step, as the gossip service runs it after a change (at most every replan_every s).
        if int(self.now) % self.replan_every:
            self.now += 1.0
            return
        t = time.process_time()
        new = self.plan_step.run(g, (), self.now)
        if new is not None:
            plan_gossip.publish(g, new, self.now)  # (its shards leave through the exchanges above)
        self.cpu_plan += time.process_time() - t
        self.now += 1.0

    def measure(self, seconds: int, churn: bool, step_seconds: int) -> dict[str, float]:
        cpu_g, cpu_p, sent, t0 = self.cpu_gossip, self.cpu_plan, self.sent, self.now
        events = self.n / 100 / 60
        for s in range(seconds):
            self.round(churn, events, churn and s % step_seconds == 0)
        dt = self.now - t0
        return {"gossip": (self.cpu_gossip - cpu_g) / dt, "plan": (self.cpu_plan - cpu_p) / dt,
                "bytes": (self.sent - sent) / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--regions", type=int, help="regions (default: 8 up to 16,000 nodes, as gossip_scale.py; "
                    "beyond, one per 2,000 nodes, as plan_scale.py's 50 x 2,000)")
    ap.add_argument("--seconds", type=int, default=60, help="simulated seconds per measurement")
    ap.add_argument("--step-seconds", type=int, default=30, help="seconds between head versions under churn")
    ap.add_argument("--replan-every", type=int, default=1, help="run the plan step every this many rounds "
                    "(the gossip service's control.replan_delay; changes in between are planned together)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f} s] {msg}", flush=True)

    regions = args.regions or (8 if args.nodes <= 16_000 else args.nodes // 2000)
    h = Harness(args.nodes, args.seed, regions, args.replan_every)
    t = time.process_time()
    h.round(False, 0.0, False)  # the first plan
    out: dict[str, Any] = {"nodes": args.nodes, "regions": regions, "replan_every_s": args.replan_every,
                           "seed": args.seed, "machine": platform.node(),
                           "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
                           "first_round_cpu_s": round(time.process_time() - t, 3)}
    log(f"{args.nodes} members, first plan: {out['first_round_cpu_s']} s CPU")
    # Every member's first report seen (spaced like the others: 500 rounds at 100,000).
    h.measure(max(int(h.g.config.report_interval), math.ceil(h.g.report_spacing())), False, args.step_seconds)
    for name, churn in (("idle", False), ("churn", True)):
        m = h.measure(args.seconds, churn, args.step_seconds)
        out[f"coordinator_cpu_per_round_s_{name}"] = round(m["gossip"] + m["plan"], 5)
        out[f"coordinator_cpu_per_round_s_{name}_plan"] = round(m["plan"], 5)
        out[f"coordinator_bytes_sent_per_s_{name}"] = round(m["bytes"])
        log(f"{name}: coordinator CPU {1e3 * (m['gossip'] + m['plan']):.2f} ms per round "
            f"(plan step {1e3 * m['plan']:.2f}), sends {m['bytes'] / 1e3:.1f} KB/s")
    out["wall_s"] = round(time.time() - t0)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
