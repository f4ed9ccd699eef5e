"""The coordinator's HTTP wire format: the route prefix and limits, request bodies checked field by
field (:class:`BadRequest`, answered 400, names the field), and the grant a rollout node receives.

Shared by the coordinator (:mod:`p2psync.control.coordinator`) and its client
(:mod:`p2psync.control.work_client`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2psync.control.api import ResponseResult
from p2psync.lease import Lease, WorkItem
from p2psync.transport.messages import API

CONTROL = f"{API}/control"
MAX_ITEMS = 64
MAX_REPORTS = 1024
MAX_WAIT = 60.0


class BadRequest(ValueError):
    """A request body that does not follow the schema (400)."""


def body_field(body: dict, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    if name not in body or body[name] is None:
        if optional:
            return None
        raise BadRequest(f"{name}: required")
    v = body[name]
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise BadRequest(f"{name}: wrong type {type(v).__name__}")
    return v


def _ints(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise BadRequest(f"{name}: must be a list of integers")
    return v


def _floats(v: Any, name: str) -> list[float]:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise BadRequest(f"{name}: must be a list of numbers")
    return [float(x) for x in v]


@dataclass(frozen=True)
class Report:
    work_id: str
    lease_id: int
    response: int
    offset: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None


def parse_report(body: dict[str, Any], where: str) -> Report:
    """One progress report's fields, checked against the schema (:class:`BadRequest` names the field)."""
    try:
        tokens = _ints(body.get("tokens"), "tokens")
        logprobs = _floats(body.get("logprobs"), "logprobs")
        versions = _ints(body.get("versions"), "versions")
        if not len(tokens) == len(logprobs) == len(versions):
            raise BadRequest("tokens, logprobs and versions differ in length")
        reason = body_field(body, "finish_reason", str, optional=True)
        if reason is not None and not 0 < len(reason) <= 32:
            raise BadRequest("finish_reason: must be a short string")
        return Report(body_field(body, "work_id", str), body_field(body, "lease_id", int), body_field(body, "response", int),
                       body_field(body, "offset", int), tokens, logprobs, versions, reason)
    except BadRequest as exc:
        raise BadRequest(f"{where}{exc}") from None


def parse_response(d: Any, where: str) -> ResponseResult:
    """A :class:`ResponseResult` from JSON, checked (400 on anything off)."""
    if not isinstance(d, dict):
        raise BadRequest(f"{where}: must be an object")
    tokens = _ints(d.get("tokens"), f"{where}.tokens")
    logprobs = _floats(d.get("logprobs"), f"{where}.logprobs")
    versions = _ints(d.get("versions"), f"{where}.versions")
    if not len(tokens) == len(logprobs) == len(versions):
        raise BadRequest(f"{where}: tokens, logprobs and versions differ in length")
    reason = d.get("finish_reason")
    if not isinstance(reason, str) or not reason or len(reason) > 32:
        raise BadRequest(f"{where}.finish_reason: must be a short string")
    return ResponseResult(tokens, logprobs, versions, reason)


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

