"""``GossipNode``: the sans-IO push-pull gossip state machine.

It never touches a socket or a clock. The host calls :meth:`GossipNode.tick`
at (or after) :meth:`GossipNode.next_wakeup` and :meth:`GossipNode.receive` for
each message that arrives; both return ``(peer address, message)`` pairs to send,
fire and forget (a lost message only slows convergence). Given the same seed,
inputs and ``now`` values, the outputs are the same.

Exchange, initiated each round with ``fanout`` random live peers::

    A -> B  Syn(root)                    B: same root -> no reply (the common case)
    B -> A  Buckets(64 bucket hashes)
    A -> B  Digest(keys+versions of the differing buckets, at most max_digest_items)
    B -> A  Delta(entries A lacks or holds older, want=keys where A is newer)
    A -> B  Delta(wanted entries)

Between large tables that differ in a few buckets (over ``exchange.LEAF_FROM``, 32, keys per
differing bucket: from ~2,000 members), A answers Buckets with leaf hashes instead::

    A -> B  Leaves(64 leaf hashes of each differing bucket)
    B -> A  Digest(keys+versions of the differing leaves)
    A -> B  Delta(entries B lacks or holds older, want=keys where B is newer)
    B -> A  Delta(wanted entries)

So an idle cluster exchanges ~100-byte Syns, and a change costs each node a few
leaf digests (a few keys each; a bucket's keys at 10,000 members are ~156, ~1,560 at
100,000) plus the changed entries. Messages are bounded: at most ``max_entries``
entries each, and at most the JSON bytes their receiver takes: ``Buckets``,
``Digest``, ``Leaves`` and a ``Delta`` with a ``want`` name the sender's
``max_body_bytes`` as ``accept`` (1 MiB by default), and the answer to each is sized
to it (64 KiB when a peer of an older build names none; such a peer is never sent
``Leaves``, which it does not know); what does not fit goes in a later round. A
Digest lists at most ``max_digest_items`` (512) keys while the two tables differ in
at most half the buckets (or leaves), and up to ``max_digest_items_far`` (16,384)
beyond, when A lists buckets, not leaves: after a partition heals nearly every entry
differs, and one exchange then carries what dozens did. The coordinator's Deltas carry
at most ``coordinator_max_entries`` (256) entries and 64 KiB: every joiner's first
exchange is with it, and would otherwise take as much of the table as the joiner
accepts. The answers
are :mod:`p2psync.gossip.exchange`'s.

Each round a node also sends a ``Heartbeat`` to its
ring successors (see :mod:`p2psync.gossip.membership`), and a ``Report`` of its
versions held and measured throughput to the coordinator when they changed (at
least every ``report_interval``): those figures change on every node with every
version, so they go to their only reader instead of through the whole table.
Every report is an HTTP request on the coordinator, and every node takes a new
version at about the same time: so each member leaves at least ``live /
report_budget`` seconds between its reports, new versions included, at a random
phase, and the coordinator takes about ``report_budget`` (200) a second however
large the cluster (at 10,000 members a member reports every 50 s, at 100,000
every 500 s). Nothing waits on a report: a node's lease requests carry the
version it holds, and the scheduler takes the fresher of the two.

Lease entries (``leases/<node>``) are private to the coordinator and the node named
(:meth:`~p2psync.gossip.coordinator_state.CoordinatorState.holds`): the coordinator sends a new one
straight to its holder on its next round, and the holder's ``Report`` names the version it holds, so
a lost send is repaired by the holder's next report (the coordinator answers a report that names an
older version with its entry, and one that names a newer version, held since before the
coordinator restarted, with a ``want`` for it). Their traffic per node is the node's own leases,
whatever the cluster size.

Joining: a node that knows no live peer sends its Syns to the seed addresses and to
the addresses it remembered from its previous run (``rejoin``). Rejoining: every
``rejoin_interval`` a node also sends a Syn to one seed that no live member of its
table holds. Peers that saw a node leave or die keep its tombstone and never pick
it as a gossip peer again, so after a restart it is the restarted node that must
call them, and the seed probe heals a split when the restarted node remembers
nobody (its data dir lost) while its seeds remember it as gone.

Healing a partition: each side declares the other dead, and dead members are
never picked as gossip peers. So each round a node also calls one member it
holds dead with probability ``min(1, dead / live) * interval / reconnect_interval``
(after a split into halves every node calls across about every
``reconnect_interval``; one crashed member of 10,000 costs the cluster a call
every few thousand rounds). A node that gets a Syn from a member it holds
suspect or dead sends that member its entry at once, so it refutes within a
round; the refutations then spread like any change.
Leaving: :meth:`GossipNode.leave` returns the tombstone pushed to a few peers;
keep the node answering for a round or two if possible, then stop it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace

from p2psync.errors import CodecError
from p2psync.errors import NotCoordinator
from p2psync.gossip.coordinator_state import CoordinatorState, is_private
from p2psync.gossip.config import GossipConfig
from p2psync.gossip.exchange import Reconciler
from p2psync.gossip.index import BucketIndex
from p2psync.gossip.membership import MemberTable
from p2psync.gossip.items import LEASES_PREFIX, MAX_VERSIONS, CoordEntry, MemberEntry
from p2psync.gossip.messages import Buckets, Delta, Digest, Heartbeat, Leaves, Message, Report, Syn

logger = logging.getLogger(__name__)

Outgoing = list[tuple[str, Message]]



def _to(addr: str, msg: Message | None) -> Outgoing:
    return [] if msg is None else [(addr, msg)]


class GossipNode:
    """One participant: its member table, the coordinator state, and the exchange logic.

    Contract: ``receive`` never raises on a well-typed message from a peer; an
    entry it must refuse (a coordinator entry from a non-coordinator) is dropped
    and counted in ``coord.rejected``. Decoding bytes into messages, and so
    :class:`~p2psync.errors.CodecError`, happens before (``messages.loads``).
    """

    def __init__(self, me: MemberEntry, *, seeds: tuple[str, ...] = (), rejoin: tuple[str, ...] = (),
                 coordinator: str | None = None,
                 config: GossipConfig | None = None, seed: int = 0, now: float = 0.0,
                 verify: Callable[[CoordEntry], bool] | None = None,
                 sign: Callable[[CoordEntry], CoordEntry] | None = None) -> None:
        cfg = config or GossipConfig()
        self.rng = random.Random(seed)
        self.index = BucketIndex()
        self.members = MemberTable(me, self.index, cfg.detector)
        self.coord = CoordinatorState(me.id, coordinator, self.index, verify=verify, sign=sign,
                                      tombstone_ttl=cfg.detector.tombstone_ttl)
        self.reconciler = Reconciler(me.id, self.members, self.coord, cfg, self.rng)
        """The exchange's answers (:mod:`p2psync.gossip.exchange`)."""
        self.report = Report(me.id, me.incarnation, me.versions, me.throughput, me.bandwidth)
        """This node's figures as last given to :meth:`update_self`."""
        self._report_due = True
        self._last_report = now
        self._next_report = now
        self._lease_sends: dict[str, CoordEntry] = {}
        """Coordinator only: holder id -> its lease entry written since the last round (sent then)."""
        self.reports: dict[str, tuple[float, Report]] = {}
        """Coordinator only: member id -> (time received, its latest report)."""
        self.report_changes = 0
        """Coordinator only: reports taken whose bandwidth (what the plan reads) differs from the
        sender's previous one."""
        self.seeds = tuple(s for s in seeds if s != me.address)
        self.rejoin = tuple(a for a in dict.fromkeys(rejoin) if a != me.address and a not in self.seeds)
        """Addresses of members this node knew before a restart: called like seeds while it knows no live peer."""
        self._next_rejoin = now + self.config.rejoin_interval
        self.id = me.id
        # A random phase spreads the rounds of nodes started together.
        self._next_round = now + self.rng.random() * self.config.interval
        self._last_metrics = now
        self.stopped = False

    @property
    def config(self) -> GossipConfig:
        return self.reconciler.config

    @config.setter
    def config(self, config: GossipConfig) -> None:
        self.reconciler.config = config

    # ------------------------------------------------------------ timers

    def next_wakeup(self) -> float:
        """When :meth:`tick` next has something to do."""
        return self._next_round

    def tick(self, now: float) -> Outgoing:
        """Run timers: failure detector, and a gossip round when one is due."""
        if self.stopped:
            return []
        self.members.check(now)
        if now < self._next_round:
            return []
        self.coord.expire(now)
        self._next_round = max(self._next_round + self.config.interval, now)
        out: Outgoing = self._send_report(now)
        out.extend(self._send_leases())
        syn = Syn(self.id, self.index.root, self.index.count)
        for addr in self._pick_peers(self.config.fanout):
            out.append((addr, syn))
        if now >= self._next_rejoin:
            self._next_rejoin = now + self.config.rejoin_interval
            lost = self._lost_seeds()
            if lost:
                out.append((self.rng.choice(lost), syn))
        dead = self.members.dead_count()
        if dead:
            c = self.config
            p = min(1.0, dead / max(1, self.members.live_count)) * c.interval / c.reconnect_interval
            if self.rng.random() < p:
                e = self.members.random_dead(self.rng)
                if e is not None:
                    out.append((e.address, syn))
        me = self.members.me
        hb = Heartbeat(self.id, me.incarnation, self.members.next_heartbeat())
        for e in self.members.heartbeat_targets():
            out.append((e.address, hb))
        return out

    def report_spacing(self) -> float:
        """Seconds this member leaves between two reports at least: its share of the coordinator's
        ``report_budget`` with the live members it knows (0 in a cluster small enough not to need it)."""
        budget = self.config.report_budget
        return self.members.live_count / budget if budget else 0.0

    def _send_report(self, now: float) -> Outgoing:
        if now < self._next_report:
            return []
        if not self._report_due and now - self._last_report < self.config.report_interval:
            return []
        coord = self.coord.coordinator
        rep = replace(self.report, incarnation=self.members.me.incarnation, leases=self.coord.own_lease_version())
        if coord == self.id:
            self._take_report(now, rep)
        else:
            e = self.members.get(coord) if coord is not None else None
            if e is None or not e.live:
                return []
        self._report_due = False
        self._last_report = now
        # A random phase (0.5-1.5 of the spacing) keeps members that took a version together from
        # reporting it together again at every later one.
        self._next_report = now + self.report_spacing() * (0.5 + self.rng.random())
        return [] if coord == self.id else [(e.address, rep)]  # type: ignore[union-attr]

    def _send_leases(self) -> Outgoing:
        """The lease entries written since the last round, each to the node it names (if live here;
        if not, its next report asks again)."""
        if not self._lease_sends:
            return []
        out: Outgoing = []
        for holder, e in self._lease_sends.items():
            m = self.members.get(holder)
            if m is not None and m.live and holder != self.id:
                out.append((m.address, Delta(self.id, coord=(e,))))
        self._lease_sends.clear()
        return out

    def _lost_seeds(self) -> list[str]:
        """Seeds that no live member of this table holds (a split, or a seed that is really gone)."""
        if not self.seeds:
            return []  # (most nodes: no O(n) scan every rejoin_interval; at 10,000 nodes it was the top cost)
        seeds = set(self.seeds)
        live = {e.address for e in self.members.entries.values() if e.live and e.address in seeds}
        return [a for a in self.seeds if a not in live]

    def _pick_peers(self, k: int) -> list[str]:
        ring = self.members._ring_ids()
        entries = self.members.entries
        if len(ring) <= k + 1:
            peers = [entries[i].address for _, i in ring if i != self.id]
            if peers:
                return peers
            # Alone: the seeds, and (in turn, k at a time) the members remembered from before a restart.
            known = list(self.seeds) + list(self.rejoin)
            return known if len(known) <= k else self.rng.sample(known, k)
        picked: list[str] = []
        while len(picked) < k:
            i = ring[self.rng.randrange(len(ring))][1]
            a = entries[i].address
            if i != self.id and a not in picked:
                picked.append(a)
        return picked

    # ------------------------------------------------------------ receiving

    def receive(self, now: float, sender: str, msg: Message) -> Outgoing:
        """Handle one message from address ``sender``; returns replies."""
        if self.stopped:
            return []
        if isinstance(msg, Syn):
            out: Outgoing = []
            e = self.members.get(msg.sender)
            if e is not None and e.status in ("suspect", "dead"):
                out.append((sender, Delta(self.id, members=(e,))))  # it is alive: let it refute at once
            if msg.root != self.index.root:
                out.append((sender, Buckets(self.id, self.index.bucket_hex(), self.config.max_body_bytes)))
            return out
        if isinstance(msg, Buckets):
            return _to(sender, self.reconciler.on_buckets(msg))
        if isinstance(msg, Digest):
            return _to(sender, self.reconciler.on_digest(msg))
        if isinstance(msg, Leaves):
            return _to(sender, self.reconciler.on_leaves(msg))
        if isinstance(msg, Delta):
            return self._on_delta(now, sender, msg)
        if isinstance(msg, Heartbeat):
            e = self.members.on_heartbeat(now, msg.sender, msg.incarnation, msg.heartbeat)
            return [] if e is None else [(sender, Delta(self.id, members=(e,)))]
        if isinstance(msg, Report):
            if not self.coord.is_coordinator:
                return []
            self._take_report(now, msg)
            return self._lease_repair(sender, msg)
        raise CodecError(f"gossip: not a gossip message: {type(msg).__name__}")

    def _take_report(self, now: float, rep: Report) -> None:
        old = self.reports.get(rep.sender)
        if old is None or old[1].bandwidth != rep.bandwidth:
            self.report_changes += 1
            if self.members.changed is not None:
                self.members.changed.add(rep.sender)
        self.reports[rep.sender] = (now, rep)

    def _lease_repair(self, sender: str, msg: Report) -> Outgoing:
        """Coordinator: bring the reporting node's lease entry and this one's together (see the module doc)."""
        name = LEASES_PREFIX + msg.sender
        mine = self.coord.entries.get(name)
        held = 0 if mine is None else mine.version
        if mine is not None and held > msg.leases:
            return [(sender, Delta(self.id, coord=(mine,)))]
        if msg.leases > held:
            return [(sender, Delta(self.id, want=("c:" + name,)))]
        return []

    def _on_delta(self, now: float, sender: str, msg: Delta) -> Outgoing:
        for e in msg.members:
            self.members.merge(e, now)
            if self.coord.coordinator is None and e.role == "trainer" and e.live:
                # Trust on first use when no coordinator was configured.
                self.coord.coordinator = e.id
        for c in msg.coord:
            try:
                self.coord.merge(c, now)
            except NotCoordinator as exc:
                logger.warning("dropping coordinator entry from %s: %s", sender, exc)
        return _to(sender, self.reconciler.on_want(msg))

    # ------------------------------------------------------------ local changes

    def update_self(self, now: float, *, versions: tuple[int, ...] | None = None, throughput: float | None = None,
                    bandwidth: float | None = None, address: str | None = None) -> bool:
        """Record this node's versions held, measured metrics and address.

        The address changes the member entry at once (it spreads through the table).
        Versions, throughput and bandwidth go to the coordinator in a ``Report`` on
        the next round: at once for new versions, for metrics when they moved by
        25 % or more or ``metrics_interval`` has passed. Returns True if anything
        is to be published.
        """
        if address is not None and address != self.members.me.address:
            self.members.update_self(now, address=address)
            published = True
        else:
            published = False
        rep = self.report
        changes: dict[str, object] = {}
        if versions is not None and tuple(versions)[-MAX_VERSIONS:] != rep.versions:
            changes["versions"] = tuple(versions)[-MAX_VERSIONS:]
        due = now - self._last_metrics >= self.config.metrics_interval
        for name, value in (("throughput", throughput), ("bandwidth", bandwidth)):
            if value is None:
                continue
            old = getattr(rep, name)
            if value != old and (changes or due or abs(value - old) >= 0.25 * max(old, 1e-9)):
                changes[name] = float(value)
        if changes:
            if "throughput" in changes or "bandwidth" in changes:
                self._last_metrics = now
            self.report = replace(rep, **changes)  # type: ignore[arg-type]
            self._report_due = True
        return published or bool(changes)

    def track_changes(self) -> set[str]:
        """From now on, add to the returned set the id of every member whose entry is written or dropped
        here and (coordinator) whose reported bandwidth changes; the reader empties it. What lets the
        coordinator's plan step read only the members that changed, not every member after each change."""
        if self.members.changed is None:
            self.members.changed = set()
        return self.members.changed

    def publish(self, name: str, value: object, now: float | None = None) -> CoordEntry:
        """Write a coordinator entry (``head``, ``revoked``, ``leases/<node>``); coordinator only (the
        plan: :meth:`publish_plan`).
        With ``now``, the entry's version is at least ``now`` in milliseconds (see
        :class:`~p2psync.gossip.coordinator_state.CoordinatorState`)."""
        e = self.coord.write(name, value, now)
        if is_private(name):
            self._lease_sends[name[len(LEASES_PREFIX):]] = e
        return e

    def publish_plan(self, epoch: int, root: str, parents: dict[str, str], now: float | None = None) -> list[CoordEntry]:
        """Publish a plan as shard entries, only those that changed (coordinator only; see
        :meth:`~p2psync.gossip.coordinator_state.CoordinatorState.write_plan`)."""
        return self.coord.write_plan(epoch, root, parents, now)

    def leave(self, now: float) -> Outgoing:
        """Leave gracefully: mark this node left and push the tombstone to ``2 * fanout`` peers."""
        tomb = self.members.leave(now)
        msg = Delta(self.id, members=(tomb,))
        return [(addr, msg) for addr in self._pick_peers(2 * self.config.fanout)]

    def stop(self) -> None:
        """Stop answering (a crash in the simulator, or after leaving)."""
        self.stopped = True

    def copy_state_from(self, other: GossipNode) -> None:
        """Take over another node's member table and coordinator state (simulator set-up)."""
        self.index = other.index.copy()
        self.members.copy_from(other.members, self.index)
        self.coord.index = self.index
        self.coord.entries = {k: e for k, e in other.coord.entries.items() if self.coord.holds(k)}
        self.coord.max_version = other.coord.max_version
        self.coord._expiry = list(other.coord._expiry)

    # ------------------------------------------------------------ views for the host

    def live_members(self) -> list[MemberEntry]:
        return [e for e in self.members.live()]

    def report_of(self, member_id: str) -> Report | None:
        """Coordinator only: the latest report of ``member_id`` (None if none arrived)."""
        r = self.reports.get(member_id)
        return None if r is None else r[1]

    def alive_member_ids(self) -> set[str]:
        return {e.id for e in self.members.entries.values() if e.status == "alive"}

