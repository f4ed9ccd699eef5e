"""Wire messages of the gossip control plane, as frozen dataclasses with a format version.

Every message turns into a JSON-able dict with :func:`encode` (compact JSON bytes:
:func:`dumps`) and back with :func:`decode` (from bytes: :func:`loads`, which parses and
checks in one pass). Both check the wire schema strictly (``msgspec`` structs, see
:mod:`p2psync.validate`) and raise :class:`~p2psync.errors.CodecError` naming the field
(``gossip: members.0.inc: must be an integer >= 0, got str '2'``), so a handler never sees
a half-valid message. The exchange (see :mod:`p2psync.gossip.protocol`):

``Syn`` (root hash) -> ``Buckets`` (bucket hashes, only when roots differ) ->
``Digest`` (keys and versions of the differing buckets) -> ``Delta`` (entries the
initiator lacks, plus keys it should send) -> ``Delta`` (the wanted entries).
``Heartbeat`` goes from a member to its watchers only. ``Report`` (versions held,
measured throughput and bandwidth) goes from a member to the coordinator only:
those change every version on every node, and only the coordinator (scheduler,
planner) reads them, so they stay out of the cluster-wide table; so do ``leases/<node>``
entries, sent to the node named only (see :mod:`p2psync.gossip.protocol`).

Items in the replicated table have a *key* (``m:<id>`` for a member,
``c:<name>`` for a coordinator entry) and a *version tuple*; for one key the
larger tuple wins, so a merge is commutative, associative and idempotent.
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
from p2psync.validate import FINITE, convert, decode_json

GOSSIP_VERSION = 1
BUCKETS = 64
"""Items are spread over this many buckets by a hash of their key; every node must agree."""
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


@lru_cache(maxsize=1 << 16)
def bucket_of(key: str) -> int:
    """The bucket of an item key: the same on every node."""
    return _h64(key) % BUCKETS


@lru_cache(maxsize=1 << 17)
def plan_shard(node_id: str) -> int:
    """The plan shard that holds the parent of ``node_id``: the same on every node."""
    return _h64("plan:" + node_id) % PLAN_SHARDS


def item_hash(key: str, version: tuple[int, ...]) -> int:
    """64-bit hash of one (key, version); bucket and root hashes are XORs of these."""
    return _h64(key + "|" + ",".join(map(str, version)))


# ---------------------------------------------------------------- wire schema
# What a message must look like on the wire, checked by msgspec (p2psync.validate) while the JSON
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
Format = Literal[1]
"""GOSSIP_VERSION (a Literal cannot name the constant; checked below)."""
assert get_args(Format) == (GOSSIP_VERSION,)


class _Member(msgspec.Struct):
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


class _Coord(msgspec.Struct):
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


class _Syn(msgspec.Struct, tag="syn", tag_field="type"):
    format: Format
    sender: Id
    root: Annotated[str, Meta(pattern="^[0-9a-f]{16}$")]
    count: Count


class _Buckets(msgspec.Struct, tag="buckets", tag_field="type"):
    format: Format
    sender: Id
    buckets: Annotated[str, Meta(pattern=f"^[0-9a-f]{{{8 * BUCKETS}}}$")]


class _Digest(msgspec.Struct, tag="digest", tag_field="type"):
    format: Format
    sender: Id
    buckets: Annotated[list[Annotated[int, Meta(ge=0, lt=BUCKETS)]], Meta(max_length=MAX_ITEMS)] = []
    items: Annotated[list[Annotated[list[ItemKey | Count], Meta(min_length=2, max_length=4)]],
                     Meta(max_length=MAX_ITEMS)] = []
    """``[key, *version]``: a key, then 1 to 3 integers (checked in :func:`_message`)."""


class _Delta(msgspec.Struct, tag="delta", tag_field="type"):
    format: Format
    sender: Id
    members: Annotated[list[_Member], Meta(max_length=MAX_ITEMS)] = []
    coord: Annotated[list[_Coord], Meta(max_length=MAX_ITEMS)] = []
    want: Annotated[list[ItemKey], Meta(max_length=MAX_ITEMS)] = []


class _Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="type"):
    format: Format
    sender: Id
    inc: Count
    hb: Count


class _Report(msgspec.Struct, tag="report", tag_field="type"):
    format: Format
    sender: Id
    inc: Count
    tps: Figure
    bw: Figure
    versions: Versions = []
    leases: Count = 0


_Wire = Union[_Syn, _Buckets, _Digest, _Delta, _Heartbeat, _Report]


def _refused(field: str, message: str) -> CodecError:
    return CodecError(f"gossip: {field}: {message}" if field else f"gossip: {message}")


# ---------------------------------------------------------------- table items


@dataclass(frozen=True)
class MemberEntry:
    """One member as its owner last published it (status fields may be set by others).

    Owned by the member: only it changes ``address``/``versions``/``throughput``/
    ``bandwidth`` (bumping ``rev``) and ``incarnation``. Another node may only mark
    it ``suspect`` or ``dead`` at the incarnation it knows; the member refutes by
    publishing a higher incarnation. ``status_at`` is when the status was set, on
    the loosely synchronized clock the nodes share; it only times tombstone removal.
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

    @property
    def key(self) -> str:
        return "m:" + self.id

    @cached_property
    def version(self) -> tuple[int, ...]:
        return (self.incarnation, STATUS_RANK[self.status], self.rev)

    @cached_property
    def hash(self) -> int:
        return item_hash(self.key, self.version)

    @property
    def live(self) -> bool:
        return self.status in ("alive", "suspect")

    @cached_property
    def wire_bytes(self) -> int:
        """Bytes of this entry in a message's compact JSON (what message budgets count)."""
        return len(json.dumps(self.to_dict(), separators=(",", ":"))) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "address": self.address, "role": self.role, "region": self.region,
            "class": self.node_class, "inc": self.incarnation, "status": self.status, "rev": self.rev,
            "versions": list(self.versions), "tps": self.throughput, "bw": self.bandwidth,
            "at": self.status_at,
        }

    @classmethod
    def from_dict(cls, d: Any) -> MemberEntry:
        return cls._of(convert(d, _Member, error=_refused, where="member"))

    @classmethod
    def _of(cls, w: _Member) -> MemberEntry:
        return cls(w.id, w.address, w.role, w.region, w.node_class, w.inc, w.status, w.rev, tuple(w.versions),
                   w.tps, w.bw, w.at)


COORD_NAMES = ("head", "revoked")
LEASES_PREFIX = "leases/"
PLAN_PREFIX = "plan/"


def _check_coord_value(name: str, value: Any, where: str = "value") -> None:
    """Raise :class:`CodecError` naming the field unless ``value`` fits entry ``name`` (see :class:`CoordEntry`)."""
    if name.startswith(PLAN_PREFIX):
        shard = name[len(PLAN_PREFIX):]
        if not (shard.isdigit() and shard == str(int(shard)) and int(shard) < PLAN_SHARDS):
            raise CodecError(f"gossip: unknown coordinator entry {name!r} (plan shards are plan/0..plan/{PLAN_SHARDS - 1})")
        convert(value, _Plan, error=_refused, where=where)
    elif name == "head":
        convert(value, _Head, error=_refused, where=where)
    elif name == "revoked":
        convert(value, _Revoked, error=_refused, where=where)
    elif name.startswith(LEASES_PREFIX) and 0 < len(name) - len(LEASES_PREFIX) <= MAX_ID:
        convert(value, _Leases, error=_refused, where=where)
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
        return cls._of(convert(d, _Coord, error=_refused, where="coord"), "coord")

    @classmethod
    def _of(cls, w: _Coord, where: str) -> CoordEntry:
        _check_coord_value(w.name, w.value, f"{where}.value")
        return cls(w.name, w.version, w.writer, w.value, w.sig)


Item = Union[MemberEntry, CoordEntry]


def item_version(item: Item) -> tuple[int, ...]:
    return item.version if isinstance(item, MemberEntry) else (item.version,)


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class Syn:
    """Opens an exchange: the initiator's root hash (XOR of all item hashes) and item count."""

    sender: str
    root: str
    count: int


@dataclass(frozen=True)
class Buckets:
    """Reply to a ``Syn`` whose root differs: 8 hex digits per bucket, BUCKETS of them."""

    sender: str
    buckets: str


@dataclass(frozen=True)
class Digest:
    """Keys and versions the sender holds in ``buckets`` (complete for those buckets)."""

    sender: str
    buckets: tuple[int, ...]
    items: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Delta:
    """Entries the receiver lacks, and keys the sender wants back (answered by a ``Delta``)."""

    sender: str
    members: tuple[MemberEntry, ...] = ()
    coord: tuple[CoordEntry, ...] = ()
    want: tuple[str, ...] = ()


@dataclass(frozen=True)
class Heartbeat:
    """A member's liveness counter, sent each round to the members that watch it."""

    sender: str
    incarnation: int
    heartbeat: int


@dataclass(frozen=True)
class Report:
    """A member's fast-changing figures, sent to the coordinator only (when they change, and
    every ``report_interval`` as a keep-alive)."""

    sender: str
    incarnation: int
    versions: tuple[int, ...] = ()
    """Weight versions the sender holds, newest last (at most MAX_VERSIONS)."""
    throughput: float = 0.0
    """Measured decode throughput, tokens/s (0: not measured)."""
    bandwidth: float = 0.0
    """Measured download bandwidth, bytes/s (0: unknown)."""
    leases: int = 0
    """Version of the sender's own ``leases/<sender>`` entry it holds (0: none)."""


Message = Union[Syn, Buckets, Digest, Delta, Heartbeat, Report]
_TYPES = {"syn": Syn, "buckets": Buckets, "digest": Digest, "delta": Delta, "heartbeat": Heartbeat,
          "report": Report}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def encode(msg: Message) -> dict[str, Any]:
    """The JSON-able dict of a message, with ``format`` and ``type``."""
    d: dict[str, Any] = {"format": GOSSIP_VERSION, "type": _NAMES[type(msg)], "sender": msg.sender}
    if isinstance(msg, Syn):
        d.update(root=msg.root, count=msg.count)
    elif isinstance(msg, Buckets):
        d["buckets"] = msg.buckets
    elif isinstance(msg, Digest):
        d["buckets"] = list(msg.buckets)
        d["items"] = [[k, *v] for k, v in msg.items]
    elif isinstance(msg, Delta):
        d.update(members=[m.to_dict() for m in msg.members], coord=[c.to_dict() for c in msg.coord],
                 want=list(msg.want))
    elif isinstance(msg, Report):
        d.update(inc=msg.incarnation, versions=list(msg.versions), tps=msg.throughput, bw=msg.bandwidth)
        if msg.leases:
            d["leases"] = msg.leases
    else:
        d.update(inc=msg.incarnation, hb=msg.heartbeat)
    return d


def dumps(msg: Message) -> bytes:
    """Compact JSON bytes of a message (what the HTTP body carries; traffic figures count these)."""
    return json.dumps(encode(msg), separators=(",", ":")).encode()


def _message(w: _Wire) -> Message:
    """The public message of a checked wire message."""
    if isinstance(w, _Heartbeat):
        return Heartbeat(w.sender, w.inc, w.hb)
    if isinstance(w, _Report):
        return Report(w.sender, w.inc, tuple(w.versions), w.tps, w.bw, w.leases)
    if isinstance(w, _Delta):
        return Delta(w.sender, tuple(MemberEntry._of(m) for m in w.members),
                     tuple(CoordEntry._of(c, f"coord.{i}") for i, c in enumerate(w.coord)), tuple(w.want))
    if isinstance(w, _Syn):
        return Syn(w.sender, w.root, w.count)
    if isinstance(w, _Buckets):
        return Buckets(w.sender, w.buckets)
    items = []
    for i, it in enumerate(w.items):
        key, version = it[0], it[1:]
        if not isinstance(key, str) or not all(isinstance(v, int) for v in version):
            raise _refused(f"items.{i}", f"must be [key, *version] (a string, then 1 to 3 integers >= 0), got {it!r}")
        items.append((key, tuple(v for v in version if isinstance(v, int))))
    return Digest(w.sender, tuple(w.buckets), tuple(items))


def _format_refused(d: Any) -> None:
    # Checked first: a message of another format may differ in any field, and this is what to say.
    if isinstance(d, dict) and d.get("format") != GOSSIP_VERSION:
        raise CodecError(f"gossip: unsupported format {d.get('format')!r} (this build reads {GOSSIP_VERSION})")


def decode(d: Any) -> Message:
    """The message of a dict from :func:`encode`; :class:`CodecError` naming the field if it is malformed."""
    _format_refused(d)
    wire: _Wire = convert(d, _Wire, error=_refused)
    return _message(wire)


def loads(data: bytes | str) -> Message:
    """Decode and check JSON bytes in one pass; :class:`CodecError` for bad JSON or a bad message."""
    try:
        wire: _Wire = decode_json(data, _Wire, error=_refused, not_json=lambda why: CodecError(f"gossip: not JSON ({why})"))
    except CodecError:
        try:
            _format_refused(json.loads(data))
        except ValueError:
            pass
        raise
    return _message(wire)
