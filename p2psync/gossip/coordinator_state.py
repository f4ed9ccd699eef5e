"""Coordinator-owned state that rides gossip: plan, head version, leases per holder.

Contract of :class:`CoordinatorState`:

- Only the coordinator (the trainer node) writes. Every write takes the next
  value of one counter on the coordinator, so for one entry name a higher
  version is a later write and merges never conflict: higher version wins.
- An entry whose ``writer`` is not the coordinator is refused with
  :class:`NotCoordinator`, whoever forwarded it. The writer field is a claim;
  ``verify`` (for example a check of a trainer-key signature) makes it a proof.
- A coordinator that restarts must first learn the largest version in the
  cluster (``max_version``, e.g. after one exchange with a seed) and continue
  from it, or its new writes would lose to its old ones.
"""

from __future__ import annotations

from typing import Any, Callable

from p2psync.errors import IntegrityError
from p2psync.gossip.index import BucketIndex
from p2psync.gossip.messages import LEASES_PREFIX, CoordEntry, _check_coord_value


class NotCoordinator(IntegrityError):
    """A coordinator entry was written, or claims to be written, by a node that is not the coordinator.

    Lives here until it moves to :mod:`p2psync.errors`.
    """

    def __init__(self, writer: str, coordinator: str | None, name: str) -> None:
        super().__init__(f"coordinator entry {name!r} written by {writer!r}, but the coordinator is {coordinator!r}")
        self.writer = writer
        self.coordinator = coordinator
        self.name = name


class CoordinatorState:
    """The coordinator entries this node holds, merged by version."""

    def __init__(self, my_id: str, coordinator: str | None, index: BucketIndex,
                 verify: Callable[[CoordEntry], bool] | None = None) -> None:
        self.my_id = my_id
        self.coordinator = coordinator
        self.index = index
        self.verify = verify
        self.entries: dict[str, CoordEntry] = {}
        self.max_version = 0
        self.rejected = 0
        """Entries refused because their writer is not the coordinator (or failed ``verify``)."""

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator is not None and self.coordinator == self.my_id

    def merge(self, e: CoordEntry) -> bool:
        """Take ``e`` if newer; True if it changed the state. Raises :class:`NotCoordinator`."""
        if self.coordinator is None or e.writer != self.coordinator or (self.verify and not self.verify(e)):
            self.rejected += 1
            raise NotCoordinator(e.writer, self.coordinator, e.name)
        cur = self.entries.get(e.name)
        if cur is not None and e.version <= cur.version:
            return False
        self.entries[e.name] = e
        self.index.replace(e.key, cur.hash if cur else None, e.hash)
        self.max_version = max(self.max_version, e.version)
        return True

    def write(self, name: str, value: Any) -> CoordEntry:
        """Write an entry (coordinator only): the next version, validated like a received one."""
        if not self.is_coordinator:
            raise NotCoordinator(self.my_id, self.coordinator, name)
        _check_coord_value(name, value)
        e = CoordEntry(name, self.max_version + 1, self.my_id, value)
        self.merge(e)
        return e

    # ------------------------------------------------------------ typed views

    def get(self, name: str) -> CoordEntry | None:
        return self.entries.get(name)

    @property
    def head(self) -> int | None:
        e = self.entries.get("head")
        return None if e is None else int(e.value["version"])

    @property
    def plan(self) -> tuple[int, str, dict[str, str]] | None:
        """(epoch, root, parents) of the current plan, or None."""
        e = self.entries.get("plan")
        return None if e is None else (e.value["epoch"], e.value["root"], dict(e.value["parents"]))

    def parent_of(self, node: str) -> str | None:
        p = self.plan
        return None if p is None else p[2].get(node)

    def leases_of(self, node: str) -> list[tuple[str, float]]:
        """(work id, expires_at) of the leases the coordinator last published for ``node``."""
        e = self.entries.get(LEASES_PREFIX + node)
        return [] if e is None else [(w, float(t)) for w, t in e.value]
