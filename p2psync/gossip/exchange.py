"""Anti-entropy between two member tables: the answers to ``Buckets``, ``Leaves``, ``Digest`` and a
``Delta``'s ``want``, each sized to what the peer said it takes (see :mod:`p2psync.gossip.protocol`
for the exchange and its bounds).

:class:`Reconciler` reads the node's tables (its member table, the coordinator state and their
index) and never writes them: merging what arrives is the node's (:class:`~p2psync.gossip.protocol.
GossipNode`).
"""

from __future__ import annotations

import random

from p2psync.gossip.config import GossipConfig
from p2psync.gossip.coordinator_state import CoordinatorState
from p2psync.gossip.index import BucketIndex, hex32
from p2psync.gossip.items import BUCKETS, LEAVES, CoordEntry, MemberEntry, leaf_of
from p2psync.gossip.membership import MemberTable
from p2psync.gossip.messages import LEGACY_ACCEPT, Buckets, Delta, Digest, Leaves

LEAF_FROM = 32
"""Keys per differing bucket (on average) from which an exchange compares leaf hashes first: a
bucket's leaf hashes are 512 bytes, its keys and versions ~25 bytes each."""
MIN_ENTRY_BYTES = 100
"""A member entry's JSON is at least about this long: an answer of B bytes looks at most at B / 100
entries (a joiner's digest names every bucket; listing and sorting 4,096 keys to send 340 cost the
coordinator, every joiner's seed, 5x the time)."""


class Reconciler:
    """What one node answers in an exchange, from its tables as they are."""

    def __init__(self, node_id: str, members: MemberTable, coord: CoordinatorState, config: GossipConfig,
                 rng: random.Random) -> None:
        self.id = node_id
        self.members = members
        self.coord = coord
        self.config = config
        self.rng = rng

    @property
    def index(self) -> BucketIndex:
        return self.members.index

    def on_buckets(self, msg: Buckets) -> Leaves | Digest | None:
        """Answer a peer's bucket hashes: the keys and versions of the differing buckets, or, between large
        tables that differ in a few buckets, their leaf hashes."""
        diff = self.index.differing(msg.buckets)
        if not diff:
            return None
        far = 2 * len(diff) > BUCKETS
        if msg.accept and not far and sum(len(self.index.keys_in(b)) for b in diff) > LEAF_FROM * len(diff):
            # Large tables, few differences: the differing leaves' keys only (a peer of an older build,
            # which names no accept, does not know Leaves).
            diff.sort()
            hashes = "".join(hex32(h) for b in diff for h in self.leaf_hashes(b))
            return Leaves(self.id, tuple(diff), hashes, self.config.max_body_bytes)
        groups = [(b, self.index.keys_in(b)) for b in diff]
        chosen, items = self._digest_items(groups, msg.accept, far)
        return Digest(self.id, tuple(chosen), tuple(items), self.config.max_body_bytes)

    def on_leaves(self, msg: Leaves) -> Digest | None:
        """Answer a peer's leaf hashes with a Digest of the leaves that differ (the exchange then goes on
        with the roles swapped: the peer answers with a Delta and a ``want``)."""
        span = 8 * LEAVES
        groups: dict[int, list[str]] = {}
        seen: set[int] = set()
        for i, b in enumerate(msg.buckets):
            if b in seen:
                continue  # (a peer that lists a bucket twice: the first hashes count)
            seen.add(b)
            theirs = msg.hashes[span * i:span * (i + 1)]
            differ = {b * LEAVES + leaf for leaf, h in enumerate(self.leaf_hashes(b))
                      if hex32(h) != theirs[8 * leaf:8 * leaf + 8]}
            if differ:
                for k in self.index.keys_in(b):
                    g = b * LEAVES + leaf_of(k)
                    if g in differ:
                        groups.setdefault(g, []).append(k)
                groups.update((g, []) for g in differ if g not in groups)  # keys only the peer holds
        if not groups:
            return None
        far = 2 * len(groups) > LEAVES * len(seen)
        chosen, items = self._digest_items(list(groups.items()), msg.accept, far)
        return Digest(self.id, (), tuple(items), self.config.max_body_bytes, tuple(chosen))

    def leaf_hashes(self, bucket: int) -> list[int]:
        """XOR of the item hashes per leaf of ``bucket`` (computed when asked: an exchange between tables
        that differ asks for a few buckets, and per-leaf hashes kept up to date would cost every node
        4,096 more integers)."""
        acc = [0] * LEAVES
        members, coord = self.members.entries, self.coord.entries
        for k in self.index.keys_in(bucket):
            acc[leaf_of(k)] ^= (members[k[2:]] if k[0] == "m" else coord[k[2:]]).hash
        return acc

    def _digest_items(self, groups: list[tuple[int, list[str]]], accept: int,
                      far: bool) -> tuple[list[int], list[tuple[str, tuple[int, ...]]]]:
        """Whole groups (buckets or leaves) of keys, in random order, with their versions, while they fit
        the item cap and the peer's ``accept``: the groups taken, sorted, and their items."""
        self.rng.shuffle(groups)
        cap = self.config.max_digest_items_far if far else self.config.max_digest_items
        budget = self.config.message_budget(accept) - 200
        chosen: list[int] = []
        items: list[tuple[str, tuple[int, ...]]] = []
        size = 0
        members, coord = self.members.entries, self.coord.entries
        for g, keys in groups:
            if chosen and len(items) + len(keys) > cap:
                break
            # (inlined _item/item_version: a digest at 10,000 members lists ~500 items)
            more = [(k, members[k[2:]].version if k[0] == "m" else (coord[k[2:]].version,)) for k in keys]
            more_size = sum(len(k) + 6 + 4 * len(v) for k, v in more)  # '["m:id",12,0,3],' with room
            if chosen and size + more_size > budget:
                break
            chosen.append(g)
            items.extend(more)
            size += more_size
        return sorted(chosen), items

    def _item(self, key: str) -> MemberEntry | CoordEntry:
        if key.startswith("m:"):
            return self.members.entries[key[2:]]
        return self.coord.entries[key[2:]]

    def _has(self, key: str) -> tuple[int, ...] | None:
        if key.startswith("m:"):
            e = self.members.entries.get(key[2:])
            return None if e is None else e.version
        c = self.coord.entries.get(key[2:])
        return None if c is None else (c.version,)

    def on_digest(self, msg: Digest) -> Delta | None:
        """Answer a peer's digest: the entries it lacks or holds older, and a ``want`` for those it holds newer."""
        theirs = dict(msg.items)
        send: list[str] = []
        want: list[str] = []
        members, coord = self.members.entries, self.coord.entries
        for k, v in msg.items:
            if k[0] == "m":
                e = members.get(k[2:])
                mine = None if e is None else e.version
            else:
                c = coord.get(k[2:])
                mine = None if c is None else (c.version,)
            if mine is None or v > mine:
                if k[0] == "c" and not self.coord.holds(k[2:]):
                    continue  # another node's lease entry (a peer that still lists them): not kept here
                want.append(k)
            elif mine > v:
                send.append(k)
        limit = self._answer_limits(msg.accept)[0]
        for b in msg.buckets:
            if len(send) >= limit:
                break  # a Delta carries no more; the rest comes in a later round (a joiner's first
                # digest names every bucket: listing the whole table, 100,000 keys, and sorting it
                # cost the coordinator, every joiner's seed, a tenth of a second each)
            send.extend(k for k in self.index.keys_in(b) if k not in theirs)
        if msg.leaves and len(send) < limit:
            leaves = set(msg.leaves)
            for b in dict.fromkeys(g // LEAVES for g in msg.leaves):
                send.extend(k for k in self.index.keys_in(b) if b * LEAVES + leaf_of(k) in leaves and k not in theirs)
        return self.delta(send, msg.accept, tuple(want[: self.config.max_entries]))

    def on_want(self, msg: Delta) -> Delta | None:
        """The entries a peer's Delta asks for (its ``want``), those held here."""
        return self.delta([k for k in msg.want if self._has(k) is not None], msg.accept) if msg.want else None

    def _answer_limits(self, accept: int) -> tuple[int, int]:
        """(entries, JSON bytes) a Delta to a peer that takes ``accept`` bytes carries at most: the
        coordinator's, ``coordinator_max_entries`` and 64 KiB whatever the peer takes (see
        :class:`~p2psync.gossip.config.GossipConfig`)."""
        budget, entries = self.config.message_budget(accept), self.config.max_entries
        if self.coord.is_coordinator:
            budget = min(budget, self.config.message_budget(LEGACY_ACCEPT))
            entries = min(entries, self.config.coordinator_max_entries)
        return min(entries, budget // MIN_ENTRY_BYTES + 1), budget

    def delta(self, keys: list[str], accept: int, want: tuple[str, ...] = ()) -> Delta | None:
        """The entries of ``keys`` (member entries first) and ``want`` that fit a peer taking ``accept`` bytes."""
        members: list[MemberEntry] = []
        coord: list[CoordEntry] = []
        # Member status changes first: they are what the cluster waits on.
        limit, budget = self._answer_limits(accept)
        keys = sorted(keys, key=lambda k: (not k.startswith("m:"), k))[:limit]
        budget -= 200 + sum(len(k) + 3 for k in want)
        for k in keys:
            it = self._item(k)
            size = it.wire_bytes
            if size > budget:
                continue  # a later round, with a smaller item first
            budget -= size
            (members if isinstance(it, MemberEntry) else coord).append(it)  # type: ignore[arg-type]
        if not members and not coord and not want:
            return None
        return Delta(self.id, tuple(members), tuple(coord), want, self.config.max_body_bytes if want else 0)
