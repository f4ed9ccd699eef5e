"""Contract between the control plane and the two sides that use it.

Trainer side: the trainer node's coordinator is a :class:`WorkSink`
(``node.coordinator``): the training job submits prompt groups and consumes
results as they stream in, each work id exactly once.

Rollout side: a rollout node's :class:`WorkSource` (``node.work``) grants
leases on prompt groups, takes token-level progress, and takes results. While a
grant is held (until :meth:`WorkSource.complete` or :meth:`WorkSource.release`)
the source renews its lease in the background; a grant whose lease was lost
raises :class:`~p2psync.errors.LeaseExpired` from ``progress``/``complete``
and the worker drops that work.

Payloads are JSON-able dicts. The rollout request and result schemas below are
what the reference GRPO trainer (``trainer/``) and the rollout worker
(``rollout/``) exchange; the control plane treats them as opaque except for the
token streams it keeps for migration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RolloutRequest:
    """``WorkItem.payload`` of a prompt group: ``responses`` samples of one prompt."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    min_version: int = 0
    """Generate only with weights at least this version (the staleness bound, set by the trainer)."""
    seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p,
                "stop_token_ids": list(self.stop_token_ids), "min_version": self.min_version, "seed": self.seed}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RolloutRequest:
        return cls(prompt_ids=[int(t) for t in d["prompt_ids"]], max_new_tokens=int(d["max_new_tokens"]),
                   temperature=float(d.get("temperature", 1.0)), top_p=float(d.get("top_p", 1.0)),
                   stop_token_ids=[int(t) for t in d.get("stop_token_ids", [])],
                   min_version=int(d.get("min_version", 0)), seed=d.get("seed"))


@dataclass(frozen=True)
class ResponseResult:
    """One finished response: tokens after the prompt with the sampling log-probabilities.

    ``versions[i]`` is the weight version that produced ``tokens[i]`` (a response
    migrated mid-generation, or switched at a decode-step boundary, spans versions).
    """

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "versions": self.versions,
                "finish_reason": self.finish_reason}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ResponseResult:
        return cls([int(t) for t in d["tokens"]], [float(x) for x in d["logprobs"]],
                   [int(v) for v in d["versions"]], str(d["finish_reason"]))


@dataclass(frozen=True)
class Grant:
    """A lease on one prompt group, as the rollout worker sees it."""

    work_id: str
    lease_id: int
    payload: dict[str, Any]
    responses: int
    resume: dict[int, tuple[list[int], list[float], list[int]]]
    """Per response index already started elsewhere: (tokens, logprobs, versions) so far; continue after them."""
    done: dict[int, dict[str, Any]]
    """Responses finished by earlier holders (``ResponseResult.to_json()``): do not generate them again."""


@dataclass(frozen=True)
class ProgressReport:
    """Tokens ``offset..`` of one response of a held grant (one item of ``WorkSource.progress_many``)."""

    grant: Grant
    response: int
    offset: int
    tokens: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    finish_reason: str | None = None
    """Set on the last report of a response: it is finished (a later holder gets it in ``Grant.done``)."""


@dataclass(frozen=True)
class Result:
    """An accepted result, yielded once per work id by :meth:`WorkSink.results`."""

    work_id: str
    node: str
    payload: dict[str, Any]
    responses: list[ResponseResult]
    migrated: bool
    """True if more than one holder worked on it."""


class WorkSource(Protocol):
    """Rollout side (``node.work`` on a rollout node)."""

    async def request(self, max_items: int = 1, wait: float = 5.0, version: int | None = None) -> list[Grant]:
        """Up to ``max_items`` grants; waits up to ``wait`` s for work, else returns ``[]``.

        ``version``: the weights version the caller generates with now. The coordinator
        places work within the staleness bound by it, instead of by the caller's last
        gossip report, which can be a gossip round (a second by default) old."""
        ...

    async def progress(self, grant: Grant, response: int, offset: int, tokens: Sequence[int],
                       logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Tokens ``offset..`` of response ``response`` so far (called every few tokens).

        A source may also offer ``progress_many(reports) -> list[BaseException | None]``: every
        open response's report in one call (one request per node per report interval, not one
        per response); the worker uses it when present. Its outcome per report is ``None``
        (recorded, or kept to be re-sent) or the error ``progress`` would have raised."""
        ...

    async def complete(self, grant: Grant, responses: dict[int, ResponseResult]) -> bool:
        """Final responses (including ones taken from ``grant.done``); True if accepted, False if a duplicate."""
        ...

    async def release(self, grant: Grant) -> None:
        """Hand one grant back (its progress stays with the coordinator)."""
        ...

    async def release_all(self) -> None:
        """Preemption: hand back every grant at once."""
        ...


class WorkSink(Protocol):
    """Trainer side (``node.coordinator`` on the trainer node)."""

    def submit(self, work_id: str, payload: dict[str, Any], *, prompt_key: str = "", responses: int = 1) -> None:
        """Queue a prompt group (``payload``: a :class:`RolloutRequest` as JSON). Idempotent by ``work_id``."""
        ...

    def results(self) -> AsyncIterator[Result]:
        """Accepted results in completion order, each work id once; runs until the node stops."""
        ...

    def pending(self) -> int:
        """Submitted work not yet completed."""
        ...
