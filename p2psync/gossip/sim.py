"""In-memory pump for many :class:`GossipNode` s: a fake clock, seeded faults, no sleeps.

Contract: a run is a pure function of the nodes, the seed and the calls made,
so a test that fails fails the same way every time. Messages are delivered
after a random latency; with the fault knobs a message may be dropped, held
back by an extra delay (which also reorders it behind later ones), and with
``wire=True`` every message goes through ``messages.dumps``/``loads`` as on
HTTP. Byte counts are of the compact JSON a message serializes to; when bytes
are counted, a message over its receiver's ``max_body_bytes`` (its server's limit on
gossip bodies) is dropped as the server would refuse it, and counted in ``oversize``.
:meth:`Sim.partition` cuts the network between groups of nodes until
:meth:`Sim.heal`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

from p2psync.gossip.items import MemberEntry
from p2psync.gossip.messages import Message, dumps, loads, wire_size
from p2psync.gossip.config import GossipConfig
from p2psync.gossip.protocol import GossipNode


@dataclass(frozen=True)
class Faults:
    """Seeded fault injection, per message."""

    drop: float = 0.0
    """Probability that a message is lost."""
    delay: float = 0.0
    """Probability that a message is held back by an extra U(0, max_delay) seconds."""
    max_delay: float = 2.0
    latency: tuple[float, float] = (0.002, 0.05)
    """Every message takes U(lo, hi) seconds; distinct draws reorder messages too."""


class Sim:
    """Drives nodes by address through one event queue on a fake clock."""

    def __init__(self, faults: Faults | None = None, seed: int = 0, *, wire: bool = False,
                 count_bytes: bool = False) -> None:
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        self.wire = wire
        self.count_bytes = count_bytes or wire
        self.now = 0.0
        self.nodes: dict[str, GossipNode] = {}
        self._queue: list[tuple[float, int, str, str, Message | None]] = []
        self._seq = 0
        self.bytes_sent: dict[str, int] = {}
        self.messages = 0
        self.dropped = 0
        self.oversize = 0
        self._side: Callable[[str], object] | None = None

    # ------------------------------------------------------------ building

    def add(self, node: GossipNode) -> GossipNode:
        addr = node.members.me.address
        self.nodes[addr] = node
        self.bytes_sent.setdefault(addr, 0)
        self._push(max(node.next_wakeup(), self.now), addr, "tick", addr, None)
        return node

    @classmethod
    def cluster(cls, n: int, *, config: GossipConfig | None = None, faults: Faults | None = None, seed: int = 0,
                wire: bool = False, count_bytes: bool = False,
                make: Callable[[int], MemberEntry] | None = None) -> Sim:
        """A sim with ``n`` nodes that already know each other (node 0 is the trainer/coordinator)."""
        sim = cls(faults, seed, wire=wire, count_bytes=count_bytes)
        make = make or default_member
        entries = [make(i) for i in range(n)]
        coordinator = entries[0].id
        template = GossipNode(entries[0], coordinator=coordinator, config=config)
        for e in entries[1:]:
            template.members.merge(e, 0.0)
        template.members.live_ids()
        for i, e in enumerate(entries):
            node = GossipNode(e, coordinator=coordinator, config=config, seed=seed * 1_000_003 + i)
            node.copy_state_from(template)
            sim.add(node)
        return sim

    def join(self, entry: MemberEntry, seeds: tuple[str, ...], config: GossipConfig | None = None,
             rejoin: tuple[str, ...] = (), coordinator: str | None = None) -> GossipNode:
        """Start a new node that knows only ``seeds`` (and ``rejoin``: addresses it remembered from a
        previous run). A node started again at an address replaces the stopped one there."""
        if coordinator is None:
            coordinator = next(iter(self.nodes.values())).coord.coordinator
        node = GossipNode(entry, seeds=seeds, rejoin=rejoin, coordinator=coordinator, config=config,
                          seed=self.rng.randrange(1 << 30), now=self.now)
        return self.add(node)

    def crash(self, addr: str) -> None:
        """The node stops answering without a word (kill -9)."""
        self.nodes[addr].stop()

    def leave(self, addr: str) -> None:
        """Graceful leave: the node pushes its tombstone, answers for two more rounds, then stops."""
        node = self.nodes[addr]
        self._send(addr, node.leave(self.now))
        self._push(self.now + 2 * node.config.interval, addr, "stop", addr, None)

    def partition(self, side: Callable[[str], object]) -> None:
        """Drop every message between addresses on different sides (``side(address)``) from now on."""
        self._side = side

    def heal(self) -> None:
        """End :meth:`partition`."""
        self._side = None

    # ------------------------------------------------------------ running

    def _push(self, t: float, dest: str, kind: str, src: str, msg: Message | None) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, kind, dest + "\0" + src, msg))

    def _send(self, src: str, out: list[tuple[str, Message]]) -> None:
        f = self.faults
        rng = self.rng
        sizes: dict[int, int] = {}  # a Syn or Heartbeat goes to several peers: serialize it once
        for dest, msg in out:
            self.messages += 1
            if self.count_bytes:
                size = sizes.get(id(msg))
                if self.wire:
                    data = dumps(msg)
                    size = sizes[id(msg)] = len(data)
                    msg = loads(data)
                elif size is None:
                    size = sizes[id(msg)] = wire_size(msg)
                self.bytes_sent[src] += size
                receiver = self.nodes.get(dest)
                if receiver is not None and size > receiver.config.max_body_bytes:
                    self.oversize += 1
                    continue
            if self._side is not None and self._side(src) != self._side(dest):
                self.dropped += 1
                continue
            if f.drop and rng.random() < f.drop:
                self.dropped += 1
                continue
            t = self.now + rng.uniform(*f.latency)
            if f.delay and rng.random() < f.delay:
                t += rng.uniform(0, f.max_delay)
            self._push(t, dest, "msg", src, msg)

    def run_until(self, t_end: float) -> None:
        """Process every event up to ``t_end`` (fake time)."""
        q = self._queue
        while q and q[0][0] <= t_end:
            t, _, kind, route, msg = heapq.heappop(q)
            self.now = t
            dest, src = route.split("\0")
            node = self.nodes.get(dest)
            if node is None:
                continue
            if kind == "tick":
                if node.stopped:
                    continue
                self._send(dest, node.tick(t))
                self._push(max(node.next_wakeup(), t + 1e-6), dest, "tick", dest, None)
            elif kind == "stop":
                node.stop()
            elif msg is not None:
                self._send(dest, node.receive(t, src, msg))
        self.now = max(self.now, t_end)

    def running(self) -> list[GossipNode]:
        return [n for n in self.nodes.values() if not n.stopped]

    def fraction(self, pred: Callable[[GossipNode], bool]) -> float:
        """Share of running nodes for which ``pred`` holds."""
        run = self.running()
        return sum(1 for n in run if pred(n)) / max(1, len(run))

    def rounds_until(self, pred: Callable[[GossipNode], bool], share: float = 0.99, max_rounds: int = 200,
                     interval: float = 1.0) -> int | None:
        """Run round by round until ``pred`` holds on ``share`` of running nodes; rounds taken or None."""
        start = self.now
        for r in range(1, max_rounds + 1):
            self.run_until(start + r * interval)
            if self.fraction(pred) >= share:
                return r
        return None


def default_member(i: int, region_count: int = 8) -> MemberEntry:
    """Member ``i`` of a synthetic cluster: node 0 is the trainer, every 16th a relay, the rest rollout."""
    role = "trainer" if i == 0 else ("relay" if i % 16 == 0 else "rollout")
    node_class = ("reserved", "on-demand", "preemptible")[i % 3] if i else "reserved"
    return MemberEntry(
        id=f"n{i:05d}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:7070", role=role,
        region=f"r{i % region_count:02d}", node_class=node_class, versions=(0,),
        throughput=1000.0 + 10 * (i % 50), bandwidth=1.25e8,
    )
