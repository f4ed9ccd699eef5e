"""Wire messages of the gossip control plane, as frozen dataclasses with a format version.

Every message turns into a JSON-able dict with :func:`encode` and back with
:func:`decode`; :func:`decode` validates strictly and raises
:class:`~p2psync.errors.CodecError` naming what is wrong, so a handler never sees
a half-valid message. The exchange (see :mod:`p2psync.gossip.protocol`):

``Syn`` (root hash) -> ``Buckets`` (bucket hashes, only when roots differ) ->
``Digest`` (keys and versions of the differing buckets) -> ``Delta`` (entries the
initiator lacks, plus keys it should send) -> ``Delta`` (the wanted entries).
``Heartbeat`` goes from a member to its watchers only. ``Report`` (versions held,
measured throughput and bandwidth) goes from a member to the coordinator only:
those change every version on every node, and only the coordinator (scheduler,
planner) reads them, so they stay out of the cluster-wide table.

Items in the replicated table have a *key* (``m:<id>`` for a member,
``c:<name>`` for a coordinator entry) and a *version tuple*; for one key the
larger tuple wins, so a merge is commutative, associative and idempotent.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Union

from p2psync.errors import CodecError

GOSSIP_VERSION = 1
BUCKETS = 64
"""Items are spread over this many buckets by a hash of their key; every node must agree."""
ROLES = ("trainer", "relay", "rollout")
NODE_CLASSES = ("reserved", "on-demand", "preemptible")
STATUSES = ("alive", "suspect", "dead", "left")
STATUS_RANK = {s: i for i, s in enumerate(STATUSES)}
"""At one incarnation a later status in this order wins: alive < suspect < dead < left."""
MAX_ID = 128
MAX_ADDRESS = 256
MAX_VERSIONS = 16
MAX_ITEMS = 20_000
"""Upper bound on entries, digest items or wanted keys in one message (decode rejects more)."""


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


def item_hash(key: str, version: tuple[int, ...]) -> int:
    """64-bit hash of one (key, version); bucket and root hashes are XORs of these."""
    return _h64(key + "|" + ",".join(map(str, version)))


# ---------------------------------------------------------------- validation helpers


def _want(cond: bool, what: str) -> None:
    if not cond:
        raise CodecError(f"gossip: {what}")


def _int(d: dict[str, Any], name: str, lo: int = 0) -> int:
    v = d.get(name)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        raise CodecError(f"gossip: {name} must be an integer >= {lo}, got {v!r}")
    return v


def _num(d: dict[str, Any], name: str) -> float:
    v = d.get(name)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
        raise CodecError(f"gossip: {name} must be a finite number >= 0, got {v!r}")
    return float(v)


def _str(d: dict[str, Any], name: str, limit: int = MAX_ID, choices: tuple[str, ...] | None = None) -> str:
    v = d.get(name)
    if not (isinstance(v, str) and 0 < len(v) <= limit):
        raise CodecError(f"gossip: {name} must be a non-empty string of at most {limit} chars")
    if choices is not None:
        _want(v in choices, f"{name} must be one of {', '.join(choices)}, got {v!r}")
    return v


def _list(d: dict[str, Any], name: str) -> list[Any]:
    v = d.get(name, [])
    if not (isinstance(v, list) and len(v) <= MAX_ITEMS):
        raise CodecError(f"gossip: {name} must be a list of at most {MAX_ITEMS} items")
    return v


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "address": self.address, "role": self.role, "region": self.region,
            "class": self.node_class, "inc": self.incarnation, "status": self.status, "rev": self.rev,
            "versions": list(self.versions), "tps": self.throughput, "bw": self.bandwidth,
            "at": self.status_at,
        }

    @classmethod
    def from_dict(cls, d: Any) -> MemberEntry:
        _want(isinstance(d, dict), "member entry must be an object")
        versions = _list(d, "versions")
        _want(len(versions) <= MAX_VERSIONS and all(type(v) is int and v >= 0 for v in versions),
              f"versions must be at most {MAX_VERSIONS} non-negative integers")
        return cls(
            id=_str(d, "id"), address=_str(d, "address", MAX_ADDRESS), role=_str(d, "role", choices=ROLES),
            region=_str(d, "region"), node_class=_str(d, "class", choices=NODE_CLASSES),
            incarnation=_int(d, "inc"), status=_str(d, "status", choices=STATUSES), rev=_int(d, "rev"),
            versions=tuple(versions), throughput=_num(d, "tps"), bandwidth=_num(d, "bw"), status_at=_num(d, "at"),
        )


COORD_NAMES = ("plan", "head", "revoked")
LEASES_PREFIX = "leases/"


def _check_coord_value(name: str, value: Any) -> None:
    if name == "plan":
        _want(isinstance(value, dict) and set(value) == {"epoch", "root", "parents"},
              "plan value must be {epoch, root, parents}")
        _int(value, "epoch")
        _str(value, "root")
        parents = value["parents"]
        _want(isinstance(parents, dict) and len(parents) <= MAX_ITEMS, "plan parents must be an object")
        _want(all(isinstance(c, str) and isinstance(p, str) for c, p in parents.items()),
              "plan parents must map node ids to node ids")
    elif name == "head":
        _want(isinstance(value, dict) and set(value) == {"version"}, "head value must be {version}")
        _int(value, "version")
    elif name == "revoked":
        _want(isinstance(value, dict) and set(value) == {"ids"}, "revoked value must be {ids}")
        ids = value["ids"]
        _want(isinstance(ids, list) and len(ids) <= MAX_ITEMS
              and all(isinstance(i, str) and 0 < len(i) <= MAX_ID for i in ids), "revoked ids must be node ids")
    elif name.startswith(LEASES_PREFIX) and 0 < len(name) - len(LEASES_PREFIX) <= MAX_ID:
        _want(isinstance(value, list) and len(value) <= MAX_ITEMS, "leases value must be a list")
        for item in value:
            ok = (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and 0 < len(item[0]) <= MAX_ID
                  and isinstance(item[1], (int, float)) and not isinstance(item[1], bool) and math.isfinite(item[1]))
            _want(ok, "a lease must be [work_id, expires_at]")
    else:
        raise CodecError(f"gossip: unknown coordinator entry {name!r}")


@dataclass(frozen=True)
class CoordEntry:
    """A coordinator-owned entry: ``plan``, ``head``, ``revoked`` (node ids cut off) or ``leases/<node id>``.

    ``leases/<node>`` with an empty list is a tombstone: the node holds nothing, and
    every node drops the entry ``tombstone_ttl`` after it was written (its version
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
        _want(isinstance(d, dict), "coordinator entry must be an object")
        name = _str(d, "name", MAX_ID + len(LEASES_PREFIX))
        _check_coord_value(name, d.get("value"))
        sig = d.get("sig")
        _want(sig is None or isinstance(sig, str), "sig must be a string")
        return cls(name, _int(d, "version", 1), _str(d, "writer"), d["value"], sig)


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
    else:
        d.update(inc=msg.incarnation, hb=msg.heartbeat)
    return d


def dumps(msg: Message) -> bytes:
    """Compact JSON bytes of a message (what the HTTP body carries; traffic figures count these)."""
    return json.dumps(encode(msg), separators=(",", ":")).encode()


def decode(d: Any) -> Message:
    """The message of a dict from :func:`encode`; :class:`CodecError` if it is malformed."""
    _want(isinstance(d, dict), "message must be a JSON object")
    _want(d.get("format") == GOSSIP_VERSION, f"unsupported format {d.get('format')!r} (this build reads {GOSSIP_VERSION})")
    kind = d.get("type")
    _want(kind in _TYPES, f"unknown message type {kind!r}")
    sender = _str(d, "sender")
    if kind == "syn":
        root = _str(d, "root", 16)
        _want(len(root) == 16 and all(c in "0123456789abcdef" for c in root), "root must be 16 hex digits")
        return Syn(sender, root, _int(d, "count"))
    if kind == "buckets":
        b = _str(d, "buckets", 8 * BUCKETS)
        _want(len(b) == 8 * BUCKETS and all(c in "0123456789abcdef" for c in b),
              f"buckets must be {8 * BUCKETS} hex digits")
        return Buckets(sender, b)
    if kind == "digest":
        buckets = _list(d, "buckets")
        _want(all(type(b) is int and 0 <= b < BUCKETS for b in buckets), f"bucket numbers must be in [0, {BUCKETS})")
        items = []
        for it in _list(d, "items"):
            _want(isinstance(it, list) and 2 <= len(it) <= 4 and isinstance(it[0], str) and len(it[0]) <= 2 * MAX_ID
                  and all(type(v) is int and v >= 0 for v in it[1:]), f"malformed digest item {it!r}")
            items.append((it[0], tuple(it[1:])))
        return Digest(sender, tuple(buckets), tuple(items))
    if kind == "delta":
        members = tuple(MemberEntry.from_dict(m) for m in _list(d, "members"))
        coord = tuple(CoordEntry.from_dict(c) for c in _list(d, "coord"))
        want = _list(d, "want")
        _want(all(isinstance(k, str) and len(k) <= 2 * MAX_ID for k in want), "want must be a list of keys")
        return Delta(sender, members, coord, tuple(want))
    if kind == "report":
        versions = _list(d, "versions")
        _want(len(versions) <= MAX_VERSIONS and all(type(v) is int and v >= 0 for v in versions),
              f"versions must be at most {MAX_VERSIONS} non-negative integers")
        return Report(sender, _int(d, "inc"), tuple(versions), _num(d, "tps"), _num(d, "bw"))
    return Heartbeat(sender, _int(d, "inc"), _int(d, "hb"))


def loads(data: bytes | str) -> Message:
    """Decode JSON bytes; :class:`CodecError` for bad JSON or a bad message."""
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CodecError(f"gossip: not JSON ({exc})") from None
    return decode(d)
