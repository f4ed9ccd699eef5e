"""The items of the replicated gossip table: member entries and coordinator entries, their keys,
versions and hashes, and the wire schema each is checked against.

Items have a *key* (``m:<id>`` for a member, ``c:<name>`` for a coordinator entry) and a *version
tuple*; for one key the larger tuple wins, so a merge is commutative, associative and idempotent.
Hashes (:func:`item_hash`, :func:`bucket_of`, :func:`ring_hash`, :func:`plan_shard`) are the same on
every node: the bucket index, the watcher ring and the plan shards are built from them. The messages
that carry items are in :mod:`p2psync.gossip.messages`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
from msgspec import Meta

from p2psync.errors import CodecError
from p2psync.validate import FINITE, convert

BUCKETS = 64
"""Items are spread over this many buckets by a hash of their key; every node must agree."""
LEAVES = 64
"""Each bucket is split into this many leaves by the next bits of the same hash (:func:`leaf_of`): an
exchange between tables that differ in a few entries compares a bucket's leaf hashes and lists the
keys of the differing leaves only (see :mod:`p2psync.gossip.protocol`)."""
Role = Literal["trainer", "relay", "rollout"]
NodeClass = Literal["reserved", "on-demand", "preemptible"]
Status = Literal["alive", "suspect", "dead", "left"]
ROLES: tuple[str, ...] = get_args(Role)
NODE_CLASSES: tuple[str, ...] = get_args(NodeClass)
STATUSES: tuple[str, ...] = get_args(Status)
STATUS_RANK = {s: i for i, s in enumerate(STATUSES)}
"""At one incarnation a later status in this order wins: alive < suspect < dead < left."""
MAX_ID = 128
MAX_ADDRESS = 256
MAX_VERSIONS = 16
MAX_ITEMS = 20_000
"""Upper bound on entries, digest items or wanted keys in one message (decode rejects more)."""
MAX_ENTRY_BYTES = 48_000
"""A coordinator entry's JSON at most: a bigger one could never ride a gossip message (a node's server
takes 64 KiB per body), so the coordinator refuses to write it."""
PLAN_SHARDS = 64
"""The plan rides gossip as ``plan/0`` .. ``plan/63``, each holding the parents of the nodes whose id
hashes there (:func:`plan_shard`): about 3 KB per shard at 10,000 nodes, 31 KB at 100,000, and a
re-plan that moves a few nodes rewrites only their shards."""


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@lru_cache(maxsize=1 << 16)
def ring_hash(member_id: str) -> int:
    """Position of a member on the watcher ring: the same on every node."""
    return _h64("ring:" + member_id)


@lru_cache(maxsize=1 << 18)
def ring_item(member_id: str) -> tuple[int, str]:
    """``(ring_hash(member_id), member_id)``, what a member table's ring holds: one tuple per member
    for every table in the process (the simulator's 10,000 tables of 10,000 members)."""
    return (ring_hash(member_id), member_id)


@lru_cache(maxsize=1 << 16)
def bucket_of(key: str) -> int:
    """The bucket of an item key: the same on every node."""
    return _h64(key) % BUCKETS


@lru_cache(maxsize=1 << 16)
def leaf_of(key: str) -> int:
    """The leaf of an item key within its bucket: the same on every node."""
    return _h64(key) // BUCKETS % LEAVES


@lru_cache(maxsize=1 << 18)
def plan_shard(node_id: str) -> int:
    """The plan shard that holds the parent of ``node_id``: the same on every node. (Cached: the
    coordinator shards every member each time it publishes a plan, at 100,000 members ~50 ms of
    hashing a round under churn.)"""
    return _h64("plan:" + node_id) % PLAN_SHARDS


def item_hash(key: str, version: tuple[int, ...]) -> int:
    """64-bit hash of one (key, version); bucket and root hashes are XORs of these."""
    return _h64(key + "|" + ",".join(map(str, version)))


# ---------------------------------------------------------------- wire schema of the items
# What an item must look like on the wire, checked by msgspec (p2psync.validate) while the JSON
# is parsed; the public dataclasses below are built from it. Unknown keys are ignored, so a later
# build may add a field within one format version.

Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID)]
Address = Annotated[str, Meta(min_length=1, max_length=MAX_ADDRESS)]
ItemKey = Annotated[str, Meta(max_length=2 * MAX_ID)]
Count = Annotated[int, Meta(ge=0)]
Figure = Annotated[float, Meta(ge=0, le=FINITE)]
"""A finite number >= 0."""
Finite = Annotated[float, Meta(ge=-FINITE, le=FINITE)]
Versions = Annotated[list[Count], Meta(max_length=MAX_VERSIONS)]


class MemberWire(msgspec.Struct):
    id: Id
    address: Address
    role: Role
    region: Id
    node_class: NodeClass = msgspec.field(name="class")
    inc: Count
    status: Status
    rev: Count
    tps: Figure
    bw: Figure
    at: Figure
    versions: Versions = []


class CoordWire(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1, max_length=MAX_ID + len("leases/"))]
    version: Annotated[int, Meta(ge=1)]
    writer: Id
    value: Any
    sig: str | None = None


class _Plan(msgspec.Struct, forbid_unknown_fields=True):
    epoch: Count
    root: Id
    parents: Annotated[dict[str, str], Meta(max_length=MAX_ITEMS)]


class _Head(msgspec.Struct, forbid_unknown_fields=True):
    version: Count


class _Revoked(msgspec.Struct, forbid_unknown_fields=True):
    ids: Annotated[list[Id], Meta(max_length=MAX_ITEMS)]


_Leases = Annotated[list[tuple[Id, Finite]], Meta(max_length=MAX_ITEMS)]
"""``leases/<node>``: ``[[work_id, expires_at], ...]``."""

def refused(field: str, message: str) -> CodecError:
    return CodecError(f"gossip: {field}: {message}" if field else f"gossip: {message}")


# ---------------------------------------------------------------- table items


@dataclass(frozen=True, slots=True)
class MemberEntry:
    """One member as its owner last published it (status fields may be set by others).

    Owned by the member: only it changes ``address``/``versions``/``throughput``/
    ``bandwidth`` (bumping ``rev``) and ``incarnation``. Another node may only mark
    it ``suspect`` or ``dead`` at the incarnation it knows; the member refutes by
    publishing a higher incarnation. ``status_at`` is when the status was set, on
    the loosely synchronized clock the nodes share; it only times tombstone removal.

    Slotted, with ``version``, ``hash`` and ``wire_bytes`` cached in slots of their own: every node
    holds an entry per member, and after a partition each one its own ``dead`` copy of every member
    across it (285 bytes an entry with its cached version and hash, against 1,020 with a ``__dict__`` and cached
    properties: ``tracemalloc`` over 1,000 ``dead`` copies).
    """

    id: str
    address: str
    role: str
    region: str
    node_class: str
    incarnation: int = 0
    status: str = "alive"
    rev: int = 0
    versions: tuple[int, ...] = ()
    """Versions of the weights this member holds (newest last), at most MAX_VERSIONS."""
    throughput: float = 0.0
    """Measured decode throughput, tokens/s (0 if not measured, or not a rollout node)."""
    bandwidth: float = 0.0
    """Measured download bandwidth, bytes/s (0 if unknown)."""
    status_at: float = 0.0
    _version: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)
    _wire_bytes: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def key(self) -> str:
        return "m:" + self.id

    @property
    def version(self) -> tuple[int, ...]:
        v = self._version
        if v is None:
            v = (self.incarnation, STATUS_RANK[self.status], self.rev)
            object.__setattr__(self, "_version", v)
        return v

    @property
    def hash(self) -> int:
        h = self._hash
        if h is None:
            h = item_hash(self.key, self.version)
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def live(self) -> bool:
        return self.status in ("alive", "suspect")

    @property
    def wire_bytes(self) -> int:
        """Bytes of this entry in a message's compact JSON (what message budgets count)."""
        n = self._wire_bytes
        if n is None:
            n = len(json.dumps(self.to_dict(), separators=(",", ":"))) + 1
            object.__setattr__(self, "_wire_bytes", n)
        return n

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "address": self.address, "role": self.role, "region": self.region,
            "class": self.node_class, "inc": self.incarnation, "status": self.status, "rev": self.rev,
            "versions": list(self.versions), "tps": self.throughput, "bw": self.bandwidth,
            "at": self.status_at,
        }

    @classmethod
    def from_dict(cls, d: Any) -> MemberEntry:
        return cls._of(convert(d, MemberWire, error=refused, where="member"))

    @classmethod
    def _of(cls, w: MemberWire) -> MemberEntry:
        return cls(w.id, w.address, w.role, w.region, w.node_class, w.inc, w.status, w.rev, tuple(w.versions),
                   w.tps, w.bw, w.at)


COORD_NAMES = ("head", "revoked")
LEASES_PREFIX = "leases/"
PLAN_PREFIX = "plan/"


def check_coord_value(name: str, value: Any, where: str = "value") -> None:
    """Raise :class:`CodecError` naming the field unless ``value`` fits entry ``name`` (see :class:`CoordEntry`)."""
    if name.startswith(PLAN_PREFIX):
        shard = name[len(PLAN_PREFIX):]
        if not (shard.isdigit() and shard == str(int(shard)) and int(shard) < PLAN_SHARDS):
            raise CodecError(f"gossip: unknown coordinator entry {name!r} (plan shards are plan/0..plan/{PLAN_SHARDS - 1})")
        convert(value, _Plan, error=refused, where=where)
    elif name == "head":
        convert(value, _Head, error=refused, where=where)
    elif name == "revoked":
        convert(value, _Revoked, error=refused, where=where)
    elif name.startswith(LEASES_PREFIX) and 0 < len(name) - len(LEASES_PREFIX) <= MAX_ID:
        convert(value, _Leases, error=refused, where=where)
    else:
        raise CodecError(f"gossip: unknown coordinator entry {name!r}")


@dataclass(frozen=True)
class CoordEntry:
    """A coordinator-owned entry: ``plan/<shard>`` (``{epoch, root, parents}`` of the nodes in that
    shard, see :data:`PLAN_SHARDS`), ``head``, ``revoked`` (node ids cut off) or ``leases/<node id>``.

    ``leases/<node>`` is held by the coordinator and that node only.
    With an empty list it is a tombstone: the node holds nothing, and
    both drop the entry ``tombstone_ttl`` after it was written (its version
    is the coordinator's write time in milliseconds, see
    :meth:`~p2psync.gossip.coordinator_state.CoordinatorState.write`).

    ``version`` comes from one counter on the coordinator, so two entries with the
    same name and version are the same write. ``writer`` names the node that
    wrote it; receivers drop entries whose writer is not the coordinator.
    ``signature`` is the trainer-key signature over :meth:`signed_bytes` (base64),
    checked by receivers that were given the trainer's public key.
    """

    name: str
    version: int
    writer: str
    value: Any = field(compare=False)
    signature: str | None = None

    @property
    def key(self) -> str:
        return "c:" + self.name

    @cached_property
    def hash(self) -> int:
        return item_hash(self.key, (self.version,))

    @cached_property
    def wire_bytes(self) -> int:
        """Bytes of this entry in a message's compact JSON (what message budgets count)."""
        return len(json.dumps(self.to_dict(), separators=(",", ":"))) + 1

    def signed_bytes(self) -> bytes:
        """What the trainer signs: canonical JSON of name, version, writer and value."""
        body = {"name": self.name, "version": self.version, "writer": self.writer, "value": self.value}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "version": self.version, "writer": self.writer, "value": self.value}
        if self.signature is not None:
            d["sig"] = self.signature
        return d

    @classmethod
    def from_dict(cls, d: Any) -> CoordEntry:
        return cls._of(convert(d, CoordWire, error=refused, where="coord"), "coord")

    @classmethod
    def _of(cls, w: CoordWire, where: str) -> CoordEntry:
        check_coord_value(w.name, w.value, f"{where}.value")
        return cls(w.name, w.version, w.writer, w.value, w.sig)


Item = Union[MemberEntry, CoordEntry]


def item_version(item: Item) -> tuple[int, ...]:
    return item.version if isinstance(item, MemberEntry) else (item.version,)
