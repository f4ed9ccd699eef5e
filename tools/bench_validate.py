"""Gossip message decode+validate: the msgspec schema p2psync uses vs the same schema in pydantic.

The figure behind choosing msgspec for :mod:`p2psync.validate` (vLLM already depends on both).
Each case is bytes -> checked public message (:func:`p2psync.gossip.messages.loads`); the
pydantic mirror declares the same wire schema (strict models, a discriminated union on
``type``) and builds the same public dataclasses, so the two differ only in the library.
``json.loads`` alone (no checks, no objects) is printed for scale.

    .venv/bin/python tools/bench_validate.py

A Heartbeat and a Report are what a node (the coordinator: one Report per member and version)
decodes most; a Delta of 10,000 members is a joining node's first full exchange at 10,000 nodes.
"""

from __future__ import annotations

import json
import platform
import sys
import timeit
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from p2psync.gossip.items import MAX_ADDRESS, MAX_ID, MAX_ITEMS, MAX_VERSIONS, CoordEntry, MemberEntry
from p2psync.gossip.messages import Delta, Heartbeat, Report, dumps, loads

_STRICT = ConfigDict(strict=True)
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
Count = Annotated[int, Field(ge=0)]
Figure = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Versions = Annotated[list[Count], Field(max_length=MAX_VERSIONS)]


class PMember(BaseModel):
    model_config = _STRICT
    id: Id
    address: Annotated[str, Field(min_length=1, max_length=MAX_ADDRESS)]
    role: Literal["trainer", "relay", "rollout"]
    region: Id
    node_class: Literal["reserved", "on-demand", "preemptible"] = Field(alias="class")
    inc: Count
    status: Literal["alive", "suspect", "dead", "left"]
    rev: Count
    tps: Figure
    bw: Figure
    at: Figure
    versions: Versions = []


class PCoord(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(min_length=1, max_length=MAX_ID + 7)]
    version: Annotated[int, Field(ge=1)]
    writer: Id
    value: Any
    sig: str | None = None


class PDelta(BaseModel):
    model_config = _STRICT
    format: Literal[1]
    type: Literal["delta"]
    sender: Id
    members: Annotated[list[PMember], Field(max_length=MAX_ITEMS)] = []
    coord: Annotated[list[PCoord], Field(max_length=MAX_ITEMS)] = []
    want: Annotated[list[Annotated[str, Field(max_length=2 * MAX_ID)]], Field(max_length=MAX_ITEMS)] = []


class PHeartbeat(BaseModel):
    model_config = _STRICT
    format: Literal[1]
    type: Literal["heartbeat"]
    sender: Id
    inc: Count
    hb: Count


class PReport(BaseModel):
    model_config = _STRICT
    format: Literal[1]
    type: Literal["report"]
    sender: Id
    inc: Count
    tps: Figure
    bw: Figure
    versions: Versions = []


_P = TypeAdapter(Annotated[Union[PDelta, PHeartbeat, PReport], Field(discriminator="type")])


def pydantic_loads(raw: bytes) -> object:
    w = _P.validate_json(raw)
    if isinstance(w, PHeartbeat):
        return Heartbeat(w.sender, w.inc, w.hb)
    if isinstance(w, PReport):
        return Report(w.sender, w.inc, tuple(w.versions), w.tps, w.bw)
    return Delta(w.sender, tuple(MemberEntry(m.id, m.address, m.role, m.region, m.node_class, m.inc, m.status, m.rev,
                                             tuple(m.versions), m.tps, m.bw, m.at) for m in w.members),
                 tuple(CoordEntry(c.name, c.version, c.writer, c.value, c.sig) for c in w.coord), tuple(w.want))


def member(i: int) -> MemberEntry:
    return MemberEntry(f"node-{i:05d}", f"https://10.{i // 65536}.{i // 256 % 256}.{i % 256}:7070", "rollout",
                       f"region-{i % 8}", "preemptible", 3, "alive", 17, (41, 42, 43), 1234.5, 1.25e8, 0.0)


def main() -> None:
    cases = {
        "Heartbeat": Heartbeat("node-00001", 3, 12345),
        "Report": Report("node-00001", 3, (41, 42, 43), 1234.5, 1.25e8),
        "Delta, 4 members": Delta("node-00001", tuple(member(i) for i in range(4)), (), ("m:node-00009",)),
        "Delta, 10000 members": Delta("node-00001", tuple(member(i) for i in range(10_000)), (), ()),
    }
    print(f"python {sys.version.split()[0]}, {platform.machine()}; best of 5, microseconds per message")
    print(f"{'message':22} {'bytes':>8} {'msgspec':>10} {'pydantic':>10} {'json.loads':>11}")
    for name, msg in cases.items():
        raw = dumps(msg)
        assert loads(raw) == msg and pydantic_loads(raw) == msg
        n = 10 if len(raw) > 100_000 else 20_000
        us = [min(timeit.repeat(lambda f=f: f(raw), number=n, repeat=5)) / n * 1e6  # type: ignore[misc]
              for f in (loads, pydantic_loads, json.loads)]
        print(f"{name:22} {len(raw):>8} {us[0]:>10.1f} {us[1]:>10.1f} {us[2]:>11.1f}")


if __name__ == "__main__":
    main()
