"""The coordinator's HTTP wire format: the route prefix and limits, request bodies as typed schemas
checked by :func:`parse` (:mod:`p2psync.validate`; :class:`BadRequest`, answered 400, names the
field), and the grant a rollout node receives.

Shared by the coordinator (:mod:`p2psync.control.coordinator`) and its client
(:mod:`p2psync.control.work_client`); :func:`read_body` also by the gossip endpoint
(:mod:`p2psync.control.gossip_service`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from aiohttp import web
from msgspec import Meta

from p2psync.control.api import ResponseResult
from p2psync.lease import Lease, WorkItem
from p2psync.transport.messages import API
from p2psync.validate import convert

T = TypeVar("T")

CONTROL = f"{API}/control"
MAX_ITEMS = 64
MAX_REPORTS = 1024
MAX_WAIT = 60.0


class BadRequest(ValueError):
    """A request body that does not follow the schema (400)."""


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body of a request whose endpoint has a limit of its own (``limit`` bytes) rather than
    the node's general one (aiohttp's ``client_max_size``, which ``request.read()`` applies): the
    transport guard already refused a declared length over it unread; :class:`BadRequest` for a
    body without a length, one shorter than its length, or one over ``limit``."""
    n = request.content_length
    if request.body_exists and n is None:
        raise BadRequest("Content-Length required")
    try:
        raw = await request.content.readexactly(n) if n else b""
    except asyncio.IncompleteReadError:
        raise BadRequest("body shorter than its Content-Length") from None
    if len(raw) > limit:
        raise BadRequest(f"body over {limit} bytes")
    return raw


def _bad(field: str, message: str) -> BadRequest:
    return BadRequest(f"{field}: {message}" if field else message)


def parse(body: Any, tp: type[T], where: str = "") -> T:
    """``body`` (decoded JSON) as a ``tp`` of this module; :class:`BadRequest` naming the field
    (``reports.1.tokens: must be a list, each an integer, got str 'x'``). Keys a body type does not
    declare are ignored."""
    return convert(body, tp, error=_bad, where=where)


NodeId = Annotated[str, Meta(min_length=1, max_length=128)]
ShortText = Annotated[str, Meta(min_length=1, max_length=32)]


@dataclass(frozen=True)
class NodeBody:
    """What every control request carries: the calling node (checked against its certificate)."""

    node: NodeId


@dataclass(frozen=True)
class LeaseBody(NodeBody):
    """``lease``: up to ``max_items`` grants, waiting up to ``wait`` seconds for them."""

    max_items: Annotated[int, Meta(ge=1, le=MAX_ITEMS)] | None = None
    wait: Annotated[float, Meta(ge=0, le=MAX_WAIT)] | None = None
    version: Annotated[int, Meta(ge=0)] | None = None
    """The weight version the caller holds now (fresher than its last gossip report)."""


@dataclass(frozen=True)
class LeaseRef(NodeBody):
    """``renew`` and ``release``: one lease of the caller."""

    work_id: str
    lease_id: int


@dataclass(frozen=True)
class Report:
    """One progress report (the body of ``progress``, an item of ``progress_many``)."""

    work_id: str
    lease_id: int
    response: int
    offset: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: ShortText | None = None


@dataclass(frozen=True)
class ProgressMany(NodeBody):
    reports: Annotated[list[Report], Meta(max_length=MAX_REPORTS)]


@dataclass(frozen=True)
class CompleteBody(LeaseRef):
    responses: dict[str, Any]
    """``{"0": response, ...}``: every index of the work item, each read by :func:`parse_response`."""


@dataclass(frozen=True)
class _Response:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: ShortText


def check_report(r: Report, where: str = "") -> Report:
    """``r`` if its per-token lists agree in length; :class:`BadRequest` (prefixed ``where``) if not."""
    if not len(r.tokens) == len(r.logprobs) == len(r.versions):
        raise _bad(where, "tokens, logprobs and versions differ in length")
    return r


def parse_response(d: Any, where: str) -> ResponseResult:
    """A :class:`ResponseResult` from JSON, checked (400 on anything off)."""
    r = parse(d, _Response, where)
    if not len(r.tokens) == len(r.logprobs) == len(r.versions):
        raise _bad(where, "tokens, logprobs and versions differ in length")
    return ResponseResult(r.tokens, r.logprobs, r.versions, r.finish_reason)


def grant_json(lease: Lease, item: WorkItem, history: dict[int, tuple[tuple[int, ...], tuple[float, ...],
                                                                       tuple[int, ...]]]) -> dict[str, Any]:
    """What a rollout node receives for one lease (see :class:`~p2psync.control.api.Grant`)."""
    resume = {str(r): {"tokens": list(t), "logprobs": list(lease.resume_logprobs.get(r, ())),
                       "versions": list(lease.resume_versions.get(r, ()))} for r, t in lease.resume.items()}
    done = {}
    for r in sorted(lease.done):
        tokens, logprobs, versions = history.get(r, ((), (), ()))
        done[str(r)] = ResponseResult(list(tokens), list(logprobs), list(versions),
                                      lease.finish.get(r, "stop")).to_json()
    return {"work_id": lease.work_id, "lease_id": lease.lease_id, "payload": item.payload,
            "responses": item.responses, "resume": resume, "done": done, "expires_at": lease.expires_at}

