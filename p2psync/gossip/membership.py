"""Member table and failure detector (sans-IO: every call takes ``now``).

Contract of :class:`MemberTable`:

- A member's entry is owned by that member. A merge keeps, per member, the entry
  with the largest ``(incarnation, status rank, rev)``; at one incarnation
  ``alive < suspect < dead < left``. Other nodes only ever mark a member suspect
  or dead at the incarnation they know; the member refutes by publishing a
  higher incarnation as soon as it sees such an entry about itself (also after a
  restart that lost its state).
- Heartbeats do not ride the table. Gossiping every member's counter to every
  node costs O(n) bytes per message and breaks the traffic budget at 1,000
  nodes; instead each member sends its counter each round to the ``watchers +
  slack`` members that follow it on a hash ring of live members, and each node
  watches the ``watchers`` members that precede it. A watcher that sees no
  heartbeat progress from a member for ``suspect_after`` seconds marks it
  suspect; any node that has held a suspect entry for ``dead_after`` seconds
  without a refutation marks it dead. Both spread through the table.
- A graceful leave is a ``left`` tombstone that spreads like any entry. Dead and
  left entries are removed ``tombstone_ttl`` after their ``status_at`` (a time on
  the clock the nodes share loosely, so all nodes drop them at about the same
  time) and are refused afterwards, so they do not come back.

Why these defaults (interval 1 s): with message loss p, a live member is falsely
suspected by one watcher only after ``suspect_after / interval`` heartbeats in a
row are lost: 0.2**10 = 1e-7 per watcher and round at 20 % loss. There are
``watchers * n`` watches, so the expected false suspicions per round grow with n
and the wait must grow with log n to hold them: each tenfold of live members
beyond 1,000 adds ``suspect_per_decade`` (2 s: 0.2**2 = 1/25 < 1/10), so at
10,000 members and 20 % loss a watch raises a false suspicion about once in
8e8 rounds (0.2**12), i.e. one every ~9 hours for the whole cluster, and it is
refuted within a round or two (the watcher answers the next heartbeat with the
suspect entry). A suspect is declared dead only after ``dead_after`` (20 s,
plus ``dead_per_decade`` per tenfold beyond 1,000), the time a refutation
needs to reach every node that holds the suspicion: spreading takes about
log(n) rounds, and longer under loss. A crash is known (suspect at 99 % of the
nodes) in ``suspect_after`` plus the spreading, about 14 s at 1,000 nodes and
18 s at 10,000; leases (30 s) and transport errors, not gossip, are what move
work and re-parent children quickly. A watch that never heard the member
directly waits ``unheard_factor`` times longer, because the member may not know
this watcher yet.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import random
from dataclasses import dataclass, replace

from p2psync.gossip.index import BucketIndex
from p2psync.gossip.items import MemberEntry, ring_hash, ring_item

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DetectorConfig:
    """Failure detector timing and shape (seconds)."""

    suspect_after: float = 10.0
    """No heartbeat progress seen by a watcher for this long: suspect."""
    dead_after: float = 20.0
    """A suspect entry held this long without refutation: dead."""
    watchers: int = 3
    """How many members watch each member."""
    slack: int = 2
    """A member also heartbeats this many members beyond its watchers, so that views
    differing by a few joins do not leave a watcher without heartbeats."""
    unheard_factor: float = 3.0
    """A watch that never heard its member directly waits this many times longer."""
    tombstone_ttl: float = 300.0
    """Dead and left entries are removed this long after ``status_at``."""
    suspect_per_decade: float = 2.0
    """Added to ``suspect_after`` per tenfold of live members beyond 1,000 (see the module doc)."""
    dead_per_decade: float = 5.0
    """Added to ``dead_after`` per tenfold of live members beyond 1,000."""

    def __post_init__(self) -> None:
        for name in ("suspect_after", "dead_after", "tombstone_ttl", "unheard_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.watchers < 1 or self.slack < 0:
            raise ValueError("watchers must be >= 1 and slack >= 0")
        if self.suspect_per_decade < 0 or self.dead_per_decade < 0:
            raise ValueError("suspect_per_decade and dead_per_decade must be >= 0")

    def timeouts(self, live: int) -> tuple[float, float]:
        """(suspect wait, dead wait) in a cluster of ``live`` members: longer by the per-decade
        figures for each tenfold beyond 1,000."""
        decades = max(0.0, math.log10(max(1, live) / 1000))
        return (self.suspect_after + self.suspect_per_decade * decades,
                self.dead_after + self.dead_per_decade * decades)


def restart_incarnation(saved: int, now: float) -> int:
    """The incarnation a node starts with: above the one it last published (``saved``, kept in its
    data dir) and at least the wall-clock second, so that it also wins when the data dir was lost.

    A restarted node must outrank what its peers remember of its previous run, the ``left`` or
    ``dead`` tombstone included (at one incarnation a tombstone wins over ``alive``); starting
    from 0 again, its entry lost against every peer's and the peers kept it out of their views.
    """
    return max(saved + 1, int(now))


class Deadlines:
    """Member ids each due at a time, kept in slots of 1/16 s (a heap of slot numbers, a list of ids
    per slot): an id costs a list slot, where a heap of ``(time, id)`` tuples cost ~90 bytes an
    entry. After a partition each node holds a deadline for every member across it (the simulator
    holds 10,000 nodes' worth). Lazy, like a heap: the caller checks an id against its table when
    it comes due."""

    __slots__ = ("_slots", "_keys")
    PER_SECOND = 16

    def __init__(self) -> None:
        self._slots: dict[int, list[str]] = {}
        self._keys: list[int] = []

    def push(self, t: float, member_id: str) -> None:
        k = math.floor(t * self.PER_SECOND) + 1  # > t * PER_SECOND: the slot is due only once t has passed
        ids = self._slots.get(k)
        if ids is None:
            self._slots[k] = ids = []
            heapq.heappush(self._keys, k)
        ids.append(member_id)

    def pop_due(self, now: float) -> list[str]:
        """The ids whose time is before ``now`` (at most 1/16 s after it passed), removed."""
        keys, limit, out = self._keys, now * self.PER_SECOND, []
        while keys and keys[0] <= limit:
            out.extend(self._slots.pop(heapq.heappop(keys)))
        return out

    def copy(self) -> Deadlines:
        c = Deadlines()
        c._slots = {k: list(v) for k, v in self._slots.items()}
        c._keys = list(self._keys)
        return c


class _Watch:
    __slots__ = ("armed_at", "heard_at", "heard")

    def __init__(self, now: float) -> None:
        self.armed_at = now
        self.heard_at = now
        self.heard = False


class MemberTable:
    """Every member this node knows, with merge, refutation and failure detection."""

    def __init__(self, me: MemberEntry, index: BucketIndex, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self.index = index
        self.entries: dict[str, MemberEntry] = {}
        self.heartbeats: dict[str, int] = {}
        """Largest heartbeat counter heard directly, per member (watched ones and senders)."""
        self._suspect_since: dict[str, float] = {}
        # Deadlines (lazy: an entry is checked against the table when it comes due), so a round costs
        # the due entries, not a scan of every suspect and tombstone (after a partition, thousands of each).
        self._dead_due = Deadlines()
        self._drop_due = Deadlines()
        self._dead_list: list[str] = []
        """Members held ``dead`` (not ``left``), for :meth:`random_dead`; lazy, like the deadlines: an
        id whose entry is no longer dead is removed when it is drawn (or when stale ids outnumber the
        dead), which saves an index of every dead member on every node."""
        self._dead_count = 0
        self._watch: dict[str, _Watch] = {}
        self._ring: list[tuple[int, str]] = []
        self._ring_shared = False
        """True while ``_ring`` is another table's list (simulator set-up): copied on the first change."""
        self.suspicions: list[tuple[float, str]] = []
        """(time, member) of every suspicion this node raised: the false-suspicion figure."""
        self.my_heartbeat = 0
        self.changes = 0
        """Entries written or dropped here so far: equal counts mean an unchanged table (what the
        coordinator's plan step compares before it walks every member)."""
        self.changed: set[str] | None = None
        """When set (:meth:`GossipNode.track_changes <p2psync.gossip.protocol.GossipNode.track_changes>`),
        the ids of members whose entry was written or dropped are added here; the reader empties it."""
        self.my_id = me.id
        self._put(me, 0.0)

    # ------------------------------------------------------------ reading

    @property
    def me(self) -> MemberEntry:
        return self.entries[self.my_id]

    def get(self, member_id: str) -> MemberEntry | None:
        return self.entries.get(member_id)

    def live(self) -> list[MemberEntry]:
        """Alive and suspect members (suspects may still be fine), this node included."""
        return [self.entries[i] for _, i in self._ring_ids()]

    def live_ids(self) -> list[str]:
        """Ids of alive and suspect members, in ring order (kept sorted as liveness changes)."""
        return [i for _, i in self._ring_ids()]

    @property
    def live_count(self) -> int:
        """How many members are alive or suspect, this node included."""
        return len(self._ring_ids())

    def __len__(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------ writing

    def _put(self, e: MemberEntry, now: float) -> None:
        self.changes += 1
        if self.changed is not None:
            self.changed.add(e.id)
        old = self.entries.get(e.id)
        self.entries[e.id] = e
        self.index.replace(e.key, old.hash if old else None, e.hash)
        was_live = old is not None and old.live
        if was_live != e.live:
            self._ring_change(e.id, e.live)
        if e.status == "suspect":
            if old is None or old.status != "suspect" or old.incarnation != e.incarnation:
                self._suspect_since[e.id] = now
                self._dead_due.push(now + self.config.timeouts(len(self._ring))[1], e.id)
        else:
            self._suspect_since.pop(e.id, None)
        self._mark_dead(e.id, old is not None and old.status == "dead", e.status == "dead")
        if not e.live and (old is None or old.live or old.status_at != e.status_at):
            self._drop_due.push(e.status_at + self.config.tombstone_ttl, e.id)

    def _mark_dead(self, member_id: str, was: bool, dead: bool) -> None:
        if dead and not was:
            self._dead_count += 1
            self._dead_list.append(member_id)
        elif was and not dead:
            self._dead_count -= 1
            if len(self._dead_list) > 2 * self._dead_count + 64:
                self._dead_list = list(dict.fromkeys(i for i in self._dead_list if self._is_dead(i)))

    def _is_dead(self, member_id: str) -> bool:
        e = self.entries.get(member_id)
        return e is not None and e.status == "dead"

    def dead_count(self) -> int:
        return self._dead_count

    def random_dead(self, rng: random.Random) -> MemberEntry | None:
        """A member held dead, chosen at random (None if none): a reconnection target."""
        ids = self._dead_list
        while ids and self._dead_count:
            i = rng.randrange(len(ids))
            if self._is_dead(ids[i]):
                return self.entries[ids[i]]
            ids[i] = ids[-1]  # stale: no longer dead here
            ids.pop()
        return None

    def _ring_change(self, member_id: str, live: bool) -> None:
        """Insert or remove one member on the ring: O(log n) search plus a list shift, not a re-sort."""
        if self._ring_shared:
            self._ring = list(self._ring)
            self._ring_shared = False
        item = ring_item(member_id)
        i = bisect.bisect_left(self._ring, item)
        present = i < len(self._ring) and self._ring[i] == item
        if live and not present:
            self._ring.insert(i, item)
        elif not live and present:
            del self._ring[i]

    def _drop(self, member_id: str) -> None:
        self.changes += 1
        if self.changed is not None:
            self.changed.add(member_id)
        old = self.entries.pop(member_id)
        self.index.replace(old.key, old.hash, None)
        if old.live:
            self._ring_change(member_id, False)
        self._mark_dead(member_id, old.status == "dead", False)
        self._suspect_since.pop(member_id, None)
        self.heartbeats.pop(member_id, None)

    def merge(self, e: MemberEntry, now: float) -> bool:
        """Take ``e`` if it is newer than what this node holds; True if the table changed.

        An entry about this node that is newer, or that marks it suspect or dead at
        its incarnation or later, makes it refute with a higher incarnation.
        """
        if e.id == self.my_id:
            me = self.me
            if me.status == "left":
                return False
            if e.version > me.version or (not e.live and e.incarnation >= me.incarnation):
                refuted = replace(me, incarnation=max(me.incarnation, e.incarnation) + 1, status="alive", status_at=0.0)
                logger.info("refuting %s of %s at incarnation %d", e.status, self.my_id, e.incarnation)
                self._put(refuted, now)
                return True
            return False
        if not e.live and e.status_at + self.config.tombstone_ttl <= now:
            return False
        cur = self.entries.get(e.id)
        if cur is not None and e.version <= cur.version:
            return False
        self._put(e, now)
        return True

    def copy_from(self, other: MemberTable, index: BucketIndex) -> None:
        """Start from another node's table (which must hold this node's entry as it is
        here), with ``index`` a copy of its index: how the simulator builds big clusters."""
        if other.entries.get(self.my_id) is not self.me:
            raise ValueError("copy_from needs a table that holds this node's current entry")
        self.index = index
        self.entries = dict(other.entries)
        self._suspect_since = dict(other._suspect_since)
        self._dead_due = other._dead_due.copy()
        self._drop_due = other._drop_due.copy()
        self._dead_list = list(other._dead_list)
        self._dead_count = other._dead_count
        self._ring = other._ring
        self._ring_shared = other._ring_shared = True
        self.changes += 1

    def update_self(self, now: float, **fields: object) -> MemberEntry:
        """Publish new content for this node (``versions``, ``throughput``, ...): bumps ``rev``."""
        e = replace(self.me, rev=self.me.rev + 1, **fields)  # type: ignore[arg-type]
        self._put(e, now)
        return e

    def leave(self, now: float) -> MemberEntry:
        """Mark this node as left (a tombstone that spreads); returns the tombstone."""
        e = replace(self.me, status="left", status_at=now)
        self._put(e, now)
        return e

    # ------------------------------------------------------------ ring and heartbeats

    def _ring_ids(self) -> list[tuple[int, str]]:
        return self._ring

    def _neighbours(self, member_id: str, k: int, step: int) -> list[str]:
        ring = self._ring_ids()
        n = len(ring)
        if n <= 1 or k <= 0:
            return []
        i = bisect.bisect_left(ring, (ring_hash(member_id), member_id))
        if i >= n or ring[i][1] != member_id:
            return []
        return [ring[(i + step * j) % n][1] for j in range(1, min(k, n - 1) + 1)]

    def heartbeat_targets(self) -> list[MemberEntry]:
        """Members to send this node's heartbeat to: its ring successors (watchers plus slack)."""
        c = self.config
        return [self.entries[i] for i in self._neighbours(self.my_id, c.watchers + c.slack, 1)]

    def watched(self) -> list[str]:
        """Members this node watches: the ``watchers`` members before it on the ring."""
        return self._neighbours(self.my_id, self.config.watchers, -1)

    def next_heartbeat(self) -> int:
        self.my_heartbeat += 1
        return self.my_heartbeat

    def on_heartbeat(self, now: float, sender: str, incarnation: int, heartbeat: int) -> MemberEntry | None:
        """Record a heartbeat; returns the entry to send back if this node holds ``sender``
        as suspect or dead at ``incarnation`` or later, so that the sender refutes it."""
        e = self.entries.get(sender)
        if e is None:
            return None
        seen = self.heartbeats.get(sender, -1)
        if heartbeat > seen or incarnation > e.incarnation:
            self.heartbeats[sender] = max(seen, heartbeat)
            w = self._watch.get(sender)
            if w is not None:
                w.heard_at = now
                w.heard = True
        if not (e.status == "alive") and e.incarnation >= incarnation:
            return e
        return None

    # ------------------------------------------------------------ timers

    def check(self, now: float) -> list[MemberEntry]:
        """Run the failure detector and remove old tombstones; returns entries it changed."""
        c = self.config
        suspect_after, dead_after = c.timeouts(len(self._ring))
        changed: list[MemberEntry] = []
        if self.me.status != "left":
            watched = set(self.watched())
            for mid in list(self._watch):
                if mid not in watched:
                    del self._watch[mid]
            for mid in watched:
                w = self._watch.get(mid)
                if w is None:
                    self._watch[mid] = _Watch(now)
                    continue
                e = self.entries[mid]
                wait = suspect_after if w.heard else suspect_after * c.unheard_factor
                if e.status == "alive" and now - w.heard_at > wait:
                    s = replace(e, status="suspect", status_at=now)
                    self._put(s, now)
                    self.suspicions.append((now, mid))
                    logger.info("suspecting %s: no heartbeat for %.1f s", mid, now - w.heard_at)
                    w.heard_at = now  # a refuted member gets a fresh wait
                    changed.append(s)
            for mid in self._dead_due.pop_due(now):
                since = self._suspect_since.get(mid)
                if since is None:
                    continue  # refuted
                if now - since <= dead_after:  # suspected again later, or the cluster grew since
                    self._dead_due.push(since + dead_after, mid)
                    continue
                d = replace(self.entries[mid], status="dead", status_at=now)
                self._put(d, now)
                logger.info("declaring %s dead: suspect for %.1f s", mid, now - since)
                changed.append(d)
        for mid in self._drop_due.pop_due(now):
            t = self.entries.get(mid)
            if t is not None and not t.live and t.status_at + c.tombstone_ttl <= now:
                self._drop(mid)
        return changed
