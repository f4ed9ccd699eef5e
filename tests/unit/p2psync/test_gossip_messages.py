"""Gossip wire messages: every message round-trips, and malformed input raises CodecError."""

from __future__ import annotations

import json

import pytest

from p2psync.errors import CodecError
from p2psync.gossip.items import BUCKETS, LEAVES, CoordEntry, MemberEntry
from p2psync.gossip.messages import (
    Buckets, Delta, Digest, Heartbeat, Leaves, Report, Syn, decode, dumps, encode, loads, wire_size,
)

M = MemberEntry("n1", "10.0.0.1:7070", "rollout", "r01", "preemptible", 2, "suspect", 5, (3, 4), 1234.5, 1.25e8, 7.0)
C = CoordEntry("plan/7", 9, "trainer", {"epoch": 3, "root": "trainer", "parents": {"n1": "trainer"}})
MESSAGES = [
    Syn("n1", "0123456789abcdef", 10),
    Buckets("n1", "0" * 8 * BUCKETS, 1 << 20),  # with the largest body the sender takes
    Digest("n1", (0, 5), (("m:n1", (2, 1, 5)), ("c:head", (4,))), 1 << 20),
    Delta("n1", (M,), (C, CoordEntry("head", 4, "trainer", {"version": 12}),
                      CoordEntry("leases/n1", 5, "trainer", [["w1", 30.5]])), ("m:n2",), 1 << 20),
    Heartbeat("n1", 2, 99),
    Report("n1", 3, (41, 42), 900.0, 1e8, 1764331200123),  # with the version of its lease entry
    Buckets("n1", "0" * 8 * BUCKETS),  # from a build before ``accept``
    Leaves("n1", (3, 9), "0123abcd" * 2 * LEAVES, 1 << 20),
    Digest("n1", (), (("m:n1", (2, 1, 5)),), 1 << 20, (3 * LEAVES + 7, 9 * LEAVES)),  # answers Leaves
]


ODD = MemberEntry('n"é\\', "[::1]:7070", "relay", "r\u00e9", "reserved", 0, "alive", 0, (), 0.0, 0.0, 0.0)
SIZED = [*MESSAGES, Delta("n1"), Delta("n1", want=("m:n2", "c:head")), Delta("é", (M, ODD)), Digest("n1", (), ()),
         Digest("n1", (1,), (('m:n"é\\', (0, 0, 0)), ("m:n1", (10**12, 3, 7)))),
         Delta("n1", coord=(CoordEntry("head", 4, "trainer", {"version": 12}, "c2lnbg=="),))]


@pytest.mark.parametrize("msg", SIZED)
def test_wire_size_is_the_length_of_the_serialized_message(msg):
    """Traffic figures count wire_size: it must be the bytes the body carries, for any id."""
    assert wire_size(msg) == len(dumps(msg))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert loads(dumps(msg)) == msg
    assert decode(json.loads(json.dumps(encode(msg)))) == msg


def _delta_with(member=None, coord=None):
    d = encode(MESSAGES[3])
    if member is not None:
        d["members"][0].update(member)
    if coord is not None:
        d["coord"][0].update(coord)
    return d


BAD = {
    "not an object": [1, 2],
    "wrong format": {**encode(MESSAGES[0]), "format": 99},
    "unknown type": {**encode(MESSAGES[0]), "type": "gossip-bomb"},
    "no sender": {k: v for k, v in encode(MESSAGES[0]).items() if k != "sender"},
    "root not hex": {**encode(MESSAGES[0]), "root": "z" * 16},
    "negative count": {**encode(MESSAGES[0]), "count": -1},
    "short buckets": {**encode(MESSAGES[1]), "buckets": "00"},
    "negative accept": {**encode(MESSAGES[1]), "accept": -1},
    "leaf hashes short of the buckets listed": {**encode(MESSAGES[7]), "hashes": "00" * 4 * LEAVES},
    "leaf hashes not hex": {**encode(MESSAGES[7]), "hashes": "z" * 16 * LEAVES},
    "leaves of a bucket out of range": {**encode(MESSAGES[7]), "buckets": [BUCKETS, 1]},
    "leaf out of range": {**encode(MESSAGES[8]), "leaves": [BUCKETS * LEAVES]},
    "accept not an integer": {**encode(MESSAGES[3]), "accept": "1MiB"},
    "bucket out of range": {**encode(MESSAGES[2]), "buckets": [BUCKETS]},
    "digest item not a list": {**encode(MESSAGES[2]), "items": ["m:n1"]},
    "digest version negative": {**encode(MESSAGES[2]), "items": [["m:n1", -1]]},
    "bad role": _delta_with(member={"role": "king"}),
    "bad class": _delta_with(member={"class": "spot"}),
    "bad status": _delta_with(member={"status": "zombie"}),
    "bool incarnation": _delta_with(member={"inc": True}),
    "nan throughput": _delta_with(member={"tps": float("nan")}),
    "versions not ints": _delta_with(member={"versions": ["1"]}),
    "empty id": _delta_with(member={"id": ""}),
    "unknown coordinator entry": _delta_with(coord={"name": "root-password"}),
    "plan without parents": _delta_with(coord={"value": {"epoch": 1, "root": "t"}}),
    "plan shard out of range": _delta_with(coord={"name": "plan/64"}),
    "plan shard not canonical": _delta_with(coord={"name": "plan/07"}),
    "unsharded plan": _delta_with(coord={"name": "plan"}),
    "zero version": _delta_with(coord={"version": 0}),
    "want not strings": {**encode(MESSAGES[3]), "want": [1]},
    "heartbeat string": {**encode(MESSAGES[4]), "hb": "7"},
    "negative lease version": {**encode(MESSAGES[5]), "leases": -1},
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_raises_codec_error(name):
    with pytest.raises(CodecError):
        decode(BAD[name])


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"null", b'"syn"'])
def test_not_json_raises_codec_error(data):
    with pytest.raises(CodecError):
        loads(data)


# Bytes the hand-written decoder's build wrote (before msgspec checked the wire): what goes on the
# wire stays byte for byte the same, non-ASCII escaped and floats as Python writes them.
WIRE = [
    b'{"format":1,"type":"delta","sender":"n1","members":[{"id":"n1","address":"10.0.0.1:7070","role":"rollout",'
    b'"region":"r01","class":"preemptible","inc":2,"status":"suspect","rev":5,"versions":[3,4],"tps":1234.5,'
    b'"bw":125000000.0,"at":7.0},{"id":"n\\u0153ud-\\u00e9","address":"https://[::1]:1","role":"trainer",'
    b'"region":"r\\u00e9","class":"reserved","inc":0,"status":"alive","rev":0,"versions":[],"tps":0.0,"bw":0.0,'
    b'"at":0.0}],"coord":[{"name":"leases/n1","version":5,"writer":"trainer","value":[["w1",30.5],["w2",-1]],'
    b'"sig":"c2ln"}],"want":["m:n2"]}',
    b'{"format":1,"type":"report","sender":"n1","inc":3,"versions":[41,42],"tps":1e-07,"bw":1e+22}',
    b'{"format":1,"type":"digest","sender":"n1","buckets":[0,63],"items":[["m:n1",2,1,5],["c:head",4]]}',
]


@pytest.mark.parametrize("raw", WIRE, ids=["delta", "report", "digest"])
def test_wire_bytes_are_unchanged(raw):
    assert dumps(loads(raw)) == raw


@pytest.mark.parametrize("change, text", [
    ({"inc": "2"}, "gossip: members.0.inc: must be an integer >= 0, got str '2'"),
    ({"versions": [1, -1]}, "gossip: members.0.versions.1: must be an integer >= 0, got int -1"),
    ({"class": "spot"}, "gossip: members.0.class: must be one of on-demand, preemptible, reserved, got str 'spot'"),
])
def test_a_nested_bad_value_is_named_by_its_path(change, text):
    raw = json.dumps(_delta_with(member=change)).encode()
    for decoded in (lambda: loads(raw), lambda: decode(json.loads(raw))):
        with pytest.raises(CodecError) as err:
            decoded()
        assert str(err.value) == text
    with pytest.raises(CodecError, match=r"^gossip: coord\.0\.value\.epoch: must be an integer >= 0, got bool True$"):
        decode(_delta_with(coord={"value": {"epoch": True, "root": "t", "parents": {}}}))
    with pytest.raises(CodecError, match=r"^gossip: unsupported format 2 \(this build reads 1\)$"):
        loads(json.dumps({**encode(MESSAGES[4]), "format": 2, "hb": "changed shape"}))
