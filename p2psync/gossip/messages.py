"""Wire messages of the gossip control plane, as frozen dataclasses with a format version.

Every message turns into a JSON-able dict with :func:`encode` (compact JSON bytes:
:func:`dumps`) and back with :func:`decode` (from bytes: :func:`loads`, which parses and
checks in one pass). Both check the wire schema strictly (``msgspec`` structs, see
:mod:`p2psync.validate`) and raise :class:`~p2psync.errors.CodecError` naming the field
(``gossip: members.0.inc: must be an integer >= 0, got str '2'``), so a handler never sees
a half-valid message. The exchange (see :mod:`p2psync.gossip.protocol`):

``Syn`` (root hash) -> ``Buckets`` (bucket hashes, only when roots differ) ->
``Digest`` (keys and versions of the differing buckets) -> ``Delta`` (entries the
initiator lacks, plus keys it should send) -> ``Delta`` (the wanted entries). Between
large tables that differ in a few entries, ``Buckets`` is answered with ``Leaves`` (the
leaf hashes of the differing buckets), and that with a ``Digest`` of the differing
leaves, which goes on as above with the roles swapped.
``Heartbeat`` goes from a member to its watchers only. ``Report`` (versions held,
measured throughput and bandwidth) goes from a member to the coordinator only:
those change every version on every node, and only the coordinator (scheduler,
planner) reads them, so they stay out of the cluster-wide table; so do ``leases/<node>``
entries, sent to the node named only (see :mod:`p2psync.gossip.protocol`).

Items (members, coordinator entries) and their schema are in :mod:`p2psync.gossip.items`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
from msgspec import Meta

from p2psync.errors import CodecError
from p2psync.gossip.items import (
    BUCKETS, LEAVES, MAX_ITEMS, Count, CoordEntry, CoordWire, Figure, Id, ItemKey, MemberEntry, MemberWire, Versions,
    refused,
)
from p2psync.validate import convert, decode_json

GOSSIP_VERSION = 1
LEGACY_ACCEPT = 64 << 10
"""The gossip body a peer that names none (``accept`` 0: a build from before the field) takes: its
server's general body limit, ``limits.max_body_bytes``."""

# ---------------------------------------------------------------- wire schema of the messages
# Checked by msgspec while the JSON is parsed (see p2psync.gossip.items for the items' schema).

Format = Literal[1]
"""GOSSIP_VERSION (a Literal cannot name the constant; checked below)."""
assert get_args(Format) == (GOSSIP_VERSION,)


class _Syn(msgspec.Struct, tag="syn", tag_field="type"):
    format: Format
    sender: Id
    root: Annotated[str, Meta(pattern="^[0-9a-f]{16}$")]
    count: Count


class _Buckets(msgspec.Struct, tag="buckets", tag_field="type"):
    format: Format
    sender: Id
    buckets: Annotated[str, Meta(pattern=f"^[0-9a-f]{{{8 * BUCKETS}}}$")]
    accept: Count = 0


class _Digest(msgspec.Struct, tag="digest", tag_field="type"):
    format: Format
    sender: Id
    buckets: Annotated[list[Annotated[int, Meta(ge=0, lt=BUCKETS)]], Meta(max_length=MAX_ITEMS)] = []
    items: Annotated[list[Annotated[list[ItemKey | Count], Meta(min_length=2, max_length=4)]],
                     Meta(max_length=MAX_ITEMS)] = []
    """``[key, *version]``: a key, then 1 to 3 integers (checked in :func:`_message`)."""
    accept: Count = 0
    leaves: Annotated[list[Annotated[int, Meta(ge=0, lt=BUCKETS * LEAVES)]], Meta(max_length=MAX_ITEMS)] = []


class _Leaves(msgspec.Struct, tag="leaves", tag_field="type"):
    format: Format
    sender: Id
    buckets: Annotated[list[Annotated[int, Meta(ge=0, lt=BUCKETS)]], Meta(max_length=BUCKETS)]
    hashes: Annotated[str, Meta(pattern="^[0-9a-f]*$", max_length=8 * LEAVES * BUCKETS)]
    """8 hex digits per leaf, ``LEAVES`` per bucket, the buckets in the order listed (checked in
    :func:`_message`)."""
    accept: Count = 0


class _Delta(msgspec.Struct, tag="delta", tag_field="type"):
    format: Format
    sender: Id
    members: Annotated[list[MemberWire], Meta(max_length=MAX_ITEMS)] = []
    coord: Annotated[list[CoordWire], Meta(max_length=MAX_ITEMS)] = []
    want: Annotated[list[ItemKey], Meta(max_length=MAX_ITEMS)] = []
    accept: Count = 0


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


_Wire = Union[_Syn, _Buckets, _Digest, _Leaves, _Delta, _Heartbeat, _Report]


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
    accept: int = 0
    """The largest gossip body the sender takes (0: not said, an older build: ``LEGACY_ACCEPT``);
    on the three messages that are answered with entries or keys, so that the answer fits."""


@dataclass(frozen=True)
class Digest:
    """Keys and versions the sender holds in ``buckets`` (complete for those buckets)."""

    sender: str
    buckets: tuple[int, ...]
    items: tuple[tuple[str, tuple[int, ...]], ...]
    accept: int = 0
    """As on :class:`Buckets`."""
    leaves: tuple[int, ...] = ()
    """Leaves (``bucket * LEAVES + leaf``) whose keys ``items`` also lists completely: a Digest that
    answers :class:`Leaves`."""


@dataclass(frozen=True)
class Leaves:
    """Answers a ``Buckets`` between large tables that differ in few entries: for each differing
    bucket, 8 hex digits per leaf (``LEAVES`` of them), so that the answer, a ``Digest``, lists the
    keys of the differing leaves only. Only sent to a peer that named ``accept`` (an older build does
    not know it)."""

    sender: str
    buckets: tuple[int, ...]
    hashes: str
    accept: int = 0
    """As on :class:`Buckets`."""


@dataclass(frozen=True)
class Delta:
    """Entries the receiver lacks, and keys the sender wants back (answered by a ``Delta``)."""

    sender: str
    members: tuple[MemberEntry, ...] = ()
    coord: tuple[CoordEntry, ...] = ()
    want: tuple[str, ...] = ()
    accept: int = 0
    """As on :class:`Buckets` (set when ``want`` is)."""


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


Message = Union[Syn, Buckets, Digest, Leaves, Delta, Heartbeat, Report]
_TYPES = {"syn": Syn, "buckets": Buckets, "digest": Digest, "leaves": Leaves, "delta": Delta, "heartbeat": Heartbeat,
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
        if msg.leaves:
            d["leaves"] = list(msg.leaves)
    elif isinstance(msg, Leaves):
        d.update(buckets=list(msg.buckets), hashes=msg.hashes)
    elif isinstance(msg, Delta):
        d.update(members=[m.to_dict() for m in msg.members], coord=[c.to_dict() for c in msg.coord],
                 want=list(msg.want))
    elif isinstance(msg, Report):
        d.update(inc=msg.incarnation, versions=list(msg.versions), tps=msg.throughput, bw=msg.bandwidth)
        if msg.leases:
            d["leases"] = msg.leases
    else:
        d.update(inc=msg.incarnation, hb=msg.heartbeat)
    if isinstance(msg, (Buckets, Digest, Leaves, Delta)) and msg.accept:
        d["accept"] = msg.accept
    return d


def dumps(msg: Message) -> bytes:
    """Compact JSON bytes of a message (what the HTTP body carries; traffic figures count these)."""
    return json.dumps(encode(msg), separators=(",", ":")).encode()


def _json_str_bytes(s: str) -> int:
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return len(s) + 2
    return len(json.dumps(s))


def wire_size(msg: Message) -> int:
    """``len(dumps(msg))``, without serializing the entries of a ``Delta`` (each entry caches its
    ``wire_bytes``) or the items of a ``Digest``: what a traffic figure counts for every message, at a
    fraction of the cost of :func:`dumps` (the simulator counts millions)."""
    if isinstance(msg, Delta):
        size = len(dumps(Delta(msg.sender, want=msg.want, accept=msg.accept)))
        for entries in (msg.members, msg.coord):
            if entries:
                size += sum(e.wire_bytes for e in entries) - 1  # wire_bytes counts a separating comma
        return size
    if isinstance(msg, Digest):
        size = len(dumps(Digest(msg.sender, msg.buckets, (), msg.accept, msg.leaves)))
        if msg.items:  # '["m:id",3,1,0]' per item, commas between
            size += sum(_json_str_bytes(k) + 2 + sum(len(str(v)) + 1 for v in version)
                        for k, version in msg.items) + len(msg.items) - 1
        return size
    return len(dumps(msg))


def _message(w: _Wire) -> Message:
    """The public message of a checked wire message."""
    if isinstance(w, _Heartbeat):
        return Heartbeat(w.sender, w.inc, w.hb)
    if isinstance(w, _Report):
        return Report(w.sender, w.inc, tuple(w.versions), w.tps, w.bw, w.leases)
    if isinstance(w, _Delta):
        return Delta(w.sender, tuple(MemberEntry._of(m) for m in w.members),
                     tuple(CoordEntry._of(c, f"coord.{i}") for i, c in enumerate(w.coord)), tuple(w.want), w.accept)
    if isinstance(w, _Syn):
        return Syn(w.sender, w.root, w.count)
    if isinstance(w, _Buckets):
        return Buckets(w.sender, w.buckets, w.accept)
    if isinstance(w, _Leaves):
        if len(w.hashes) != 8 * LEAVES * len(w.buckets):
            raise refused("hashes", f"must be {8 * LEAVES} hex digits per bucket listed, {8 * LEAVES * len(w.buckets)} "
                          f"for {len(w.buckets)}, got {len(w.hashes)}")
        return Leaves(w.sender, tuple(w.buckets), w.hashes, w.accept)
    items = []
    for i, it in enumerate(w.items):
        key, version = it[0], it[1:]
        if not isinstance(key, str) or not all(isinstance(v, int) for v in version):
            raise refused(f"items.{i}", f"must be [key, *version] (a string, then 1 to 3 integers >= 0), got {it!r}")
        items.append((key, tuple(v for v in version if isinstance(v, int))))
    return Digest(w.sender, tuple(w.buckets), tuple(items), w.accept, tuple(w.leaves))


def _format_refused(d: Any) -> None:
    # Checked first: a message of another format may differ in any field, and this is what to say.
    if isinstance(d, dict) and d.get("format") != GOSSIP_VERSION:
        raise CodecError(f"gossip: unsupported format {d.get('format')!r} (this build reads {GOSSIP_VERSION})")


def decode(d: Any) -> Message:
    """The message of a dict from :func:`encode`; :class:`CodecError` naming the field if it is malformed."""
    _format_refused(d)
    wire: _Wire = convert(d, _Wire, error=refused)
    return _message(wire)


def loads(data: bytes | str) -> Message:
    """Decode and check JSON bytes in one pass; :class:`CodecError` for bad JSON or a bad message."""
    try:
        wire: _Wire = decode_json(data, _Wire, error=refused, not_json=lambda why: CodecError(f"gossip: not JSON ({why})"))
    except CodecError:
        try:
            _format_refused(json.loads(data))
        except ValueError:
            pass
        raise
    return _message(wire)
