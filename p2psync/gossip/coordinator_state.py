"""Coordinator-owned state that rides gossip: plan (in shards), head version, leases per holder.

Contract of :class:`CoordinatorState`:

- Only the coordinator (the trainer node) writes. Every write takes the next
  value of one counter on the coordinator, so for one entry name a higher
  version is a later write and merges never conflict: higher version wins.
- An entry whose ``writer`` is not the coordinator is refused with
  :class:`NotCoordinator`, whoever forwarded it. The writer field is a claim;
  ``verify`` (for example a check of a trainer-key signature) makes it a proof.
- ``verify`` (for example a check of a trainer-key signature, see
  :mod:`p2psync.gossip.signing`) turns the claim into a proof: an entry that
  fails it is refused too, so a relay can neither forge nor alter a plan, head
  or lease entry. ``sign`` is the coordinator's side of the same check.
- Versions follow the coordinator's clock: a write given ``now`` takes
  ``max(max_version + 1, now in milliseconds)``, so a coordinator that restarts
  with no state still writes versions above its old ones, and an entry's
  version tells when it was written.
- The plan is :data:`~p2psync.gossip.items.PLAN_SHARDS` entries ``plan/<k>``, each with the
  parents of the nodes that hash to shard ``k``; :meth:`write_plan` rewrites only the shards whose
  parents (or root) changed, so a re-plan that moves a few nodes gossips a few small entries, not
  the whole parent map. A node follows the shard that holds its own parent; shards of different
  epochs may be seen side by side while a re-plan spreads, as any change does.
- No entry is written whose JSON exceeds :data:`~p2psync.gossip.items.MAX_ENTRY_BYTES`
  (:class:`~p2psync.errors.CodecError`, nothing changed): it could never ride a message.
- ``leases/<node>`` is private (:func:`is_private`): only the
  coordinator and the node it names store it, and it is not in the bucket index, so anti-entropy
  never lists or carries it (every node holding every node's leases made lease traffic grow with
  the cluster). Any other node drops one it is offered (after the writer check) and leaves its
  state as it was. :meth:`holds` says which names a node keeps.
- ``leases/<node>`` with an empty list is a tombstone: the coordinator and the holder remove it
  ``tombstone_ttl`` after it was written (:meth:`expire`) and refuse it from
  then on, so the keys of nodes that left do not pile up.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable

from p2psync.errors import CodecError, NotCoordinator
from p2psync.gossip.index import BucketIndex
from p2psync.gossip.items import (
    LEASES_PREFIX, MAX_ENTRY_BYTES, PLAN_PREFIX, PLAN_SHARDS, CoordEntry, check_coord_value, plan_shard,
)


def is_private(name: str) -> bool:
    """Whether coordinator entry ``name`` is held only by the coordinator and the node it names
    (``leases/<node>``), outside the replicated table: no anti-entropy carries it."""
    return name.startswith(LEASES_PREFIX)


def is_tombstone(e: CoordEntry) -> bool:
    return e.name.startswith(LEASES_PREFIX) and not e.value


class CoordinatorState:
    """The coordinator entries this node holds, merged by version."""

    def __init__(self, my_id: str, coordinator: str | None, index: BucketIndex,
                 verify: Callable[[CoordEntry], bool] | None = None,
                 sign: Callable[[CoordEntry], CoordEntry] | None = None, tombstone_ttl: float = 300.0) -> None:
        self.my_id = my_id
        self.coordinator = coordinator
        self.index = index
        self.verify = verify
        self.sign = sign
        self.tombstone_ttl = tombstone_ttl
        self.entries: dict[str, CoordEntry] = {}
        self.max_version = 0
        self._expiry: list[tuple[float, str]] = []
        """(removal time, name) of lease tombstones, a heap: a round checks only the ones due."""
        self.rejected = 0
        """Entries refused because their writer is not the coordinator (or failed ``verify``)."""
        self._plan_sent: tuple[str, dict[str, str], list[CoordEntry | None]] | None = None
        """(root, parents, shard entries) of the last :meth:`write_plan`: while every shard entry is
        still the one it left, the next plan is shards of the parents that differ from these only."""

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator is not None and self.coordinator == self.my_id

    def holds(self, name: str) -> bool:
        """Whether this node keeps entry ``name``: every shared one; a private one (``leases/<node>``)
        only on the coordinator and on the node it names."""
        return not is_private(name) or self.is_coordinator or name == LEASES_PREFIX + self.my_id

    def merge(self, e: CoordEntry, now: float | None = None, *, _own: bool = False) -> bool:
        """Take ``e`` if newer; True if it changed the state. Raises :class:`NotCoordinator`
        (and changes nothing) if its writer is not the coordinator or ``verify`` refuses it.
        (``_own``: an entry :meth:`write` just signed here; its signature is not checked again.)"""
        if self.coordinator is None or e.writer != self.coordinator:
            self.rejected += 1
            raise NotCoordinator(e.writer, self.coordinator, e.name)
        if not self.holds(e.name):
            return False  # another node's lease entry: not kept here (see the module doc)
        cur = self.entries.get(e.name)
        if cur is not None and e.version <= cur.version:
            return False  # not newer: nothing to check (the signature costs ~0.1 ms)
        if self.verify is not None and not _own and not self.verify(e):
            self.rejected += 1
            raise NotCoordinator(e.writer, self.coordinator, e.name, "but its signature does not verify")
        if now is not None and is_tombstone(e) and self._expired(e, now):
            return False
        self.entries[e.name] = e
        if not is_private(e.name):
            self.index.replace(e.key, cur.hash if cur else None, e.hash)
        self.max_version = max(self.max_version, e.version)
        if is_tombstone(e):
            heapq.heappush(self._expiry, (e.version / 1000.0 + self.tombstone_ttl, e.name))
        return True

    def restore(self, e: CoordEntry) -> bool:
        """Take an entry this node kept in its data dir before a restart (``revoked``): it must
        verify like a received one (:class:`NotCoordinator` if not). When no coordinator is known
        yet, the entry's writer becomes it: the trainer key's signature proves who wrote it."""
        if self.verify is not None and not self.verify(e):
            self.rejected += 1
            raise NotCoordinator(e.writer, self.coordinator, e.name, "but its signature does not verify")
        if self.coordinator is None:
            self.coordinator = e.writer
        return self.merge(e, _own=True)

    def _expired(self, e: CoordEntry, now: float) -> bool:
        return e.version / 1000.0 + self.tombstone_ttl <= now

    def write(self, name: str, value: Any, now: float | None = None) -> CoordEntry:
        """Write an entry (coordinator only): the next version, validated like a received one, signed
        with ``sign`` if given. With ``now`` the version is at least ``now`` in milliseconds."""
        if not self.is_coordinator:
            raise NotCoordinator(self.my_id, self.coordinator, name)
        check_coord_value(name, value)
        version = self.max_version + 1
        if now is not None:
            version = max(version, int(now * 1000))
        e = CoordEntry(name, version, self.my_id, value)
        if e.wire_bytes > MAX_ENTRY_BYTES:
            raise CodecError(f"gossip: coordinator entry {name!r} would be {e.wire_bytes} bytes of JSON, over "
                             f"{MAX_ENTRY_BYTES}: it could not ride a gossip message")
        if self.sign is not None:
            e = self.sign(e)
        self.merge(e, _own=True)
        return e

    def write_plan(self, epoch: int, root: str, parents: dict[str, str], now: float | None = None) -> list[CoordEntry]:
        """Publish a plan (coordinator only): rewrite the shards whose parents or root differ from
        what this node holds; the entries written. Every shard is checked before any is written."""
        if not self.is_coordinator:
            raise NotCoordinator(self.my_id, self.coordinator, PLAN_PREFIX)
        held = [self.entries.get(f"{PLAN_PREFIX}{k}") for k in range(PLAN_SHARDS)]
        sent = self._plan_sent
        shards: dict[int, dict[str, str]] = {}
        if sent is not None and sent[0] == root and all(a is b for a, b in zip(held, sent[2])):
            # Only the shards of children whose parent differs from the last plan's (at 100,000 members
            # sharding every child cost ~70 ms a round under churn). Their key order may differ from a
            # full rebuild's; the parent maps are equal.
            diff = {c for c, _ in parents.items() ^ sent[1].items()}
            for c in diff:
                k = plan_shard(c)
                if k not in shards:
                    e = held[k]
                    shards[k] = dict(e.value["parents"]) if e is not None else {}
                if c in parents:
                    shards[k][c] = parents[c]
                else:
                    shards[k].pop(c, None)
        else:
            shards = {k: {} for k in range(PLAN_SHARDS)}
            for child, parent in parents.items():
                shards[plan_shard(child)][child] = parent
        todo = []
        for k, part in sorted(shards.items()):
            cur = held[k]
            if cur is None and not part:
                continue
            if cur is not None and cur.value["root"] == root and cur.value["parents"] == part:
                continue
            value = {"epoch": epoch, "root": root, "parents": part}
            check_coord_value(f"{PLAN_PREFIX}{k}", value)
            size = CoordEntry(f"{PLAN_PREFIX}{k}", 1, self.my_id, value).wire_bytes + 200  # + version, signature
            if size > MAX_ENTRY_BYTES:
                raise CodecError(f"gossip: plan shard {k} would be {size} bytes of JSON, over {MAX_ENTRY_BYTES} "
                                 f"({len(part)} nodes): too many nodes for {PLAN_SHARDS} shards")
            todo.append((k, value))
        written = [self.write(f"{PLAN_PREFIX}{k}", value, now) for k, value in todo]
        self._plan_sent = (root, parents.copy(), [self.entries.get(f"{PLAN_PREFIX}{k}") for k in range(PLAN_SHARDS)])
        return written

    def expire(self, now: float) -> list[str]:
        """Remove lease tombstones older than ``tombstone_ttl``; the names removed."""
        gone = []
        while self._expiry and self._expiry[0][0] <= now:
            _, n = heapq.heappop(self._expiry)
            e = self.entries.get(n)
            if e is not None and is_tombstone(e) and self._expired(e, now):
                del self.entries[n]
                if not is_private(n):
                    self.index.replace(e.key, e.hash, None)
                gone.append(n)
        return gone

    # ------------------------------------------------------------ typed views

    def get(self, name: str) -> CoordEntry | None:
        return self.entries.get(name)

    def own_lease_version(self) -> int:
        """Version of this node's ``leases/<id>`` entry held here (0: none): what its reports say."""
        e = self.entries.get(LEASES_PREFIX + self.my_id)
        return 0 if e is None else e.version

    @property
    def head(self) -> int | None:
        e = self.entries.get("head")
        return None if e is None else int(e.value["version"])

    @property
    def plan(self) -> tuple[int, str, dict[str, str]] | None:
        """(epoch, root, parents) of the plan as the shards held here give it (the newest epoch
        among them, and its root), or None if no shard arrived yet."""
        shards = [e for k in range(PLAN_SHARDS) if (e := self.entries.get(f"{PLAN_PREFIX}{k}")) is not None]
        if not shards:
            return None
        newest = max(shards, key=lambda e: (e.value["epoch"], e.version))
        parents: dict[str, str] = {}
        for e in shards:
            parents.update(e.value["parents"])
        return newest.value["epoch"], newest.value["root"], parents

    def plan_entry_of(self, node: str) -> CoordEntry | None:
        """The plan shard entry that holds ``node``'s parent (None if not arrived)."""
        return self.entries.get(f"{PLAN_PREFIX}{plan_shard(node)}")

    def parent_of(self, node: str) -> str | None:
        e = self.plan_entry_of(node)
        return None if e is None else e.value["parents"].get(node)

    def leases_of(self, node: str) -> list[tuple[str, float]]:
        """(work id, expires_at) of the leases the coordinator last published for ``node`` (on the
        coordinator and on ``node`` itself; elsewhere always empty, see :meth:`holds`)."""
        e = self.entries.get(LEASES_PREFIX + node)
        return [] if e is None else [(w, float(t)) for w, t in e.value]
