"""Lease table for rollout work, owned by the coordinator (sans-IO: every call takes ``now``).

Contract of :class:`LeaseTable`:

- Every submitted work item is, at any time, exactly one of: queued, leased to
  one holder, or completed. Nothing else moves it.
- A lease is time-bounded; its holder renews it (``renew``, or implicitly with
  each ``progress`` report). :meth:`LeaseTable.expire` returns expired work to
  the front of the queue; :meth:`LeaseTable.release_all` does the same at once
  for a node that got a preemption notice (SIGTERM).
- Token-level progress: a holder reports the tokens of each unfinished response
  every few tokens, with their log-probabilities and the weight version that
  produced each token. Re-queued work keeps all three, and the next lease
  carries them (``resume``, ``resume_logprobs``, ``resume_versions``) so the
  next holder continues from there, not from scratch, and the finished
  response carries its full history.
- Results are idempotent by work id: the first result for a work id is counted
  (even a late one from a holder whose lease expired, as long as nobody finished
  first; the lease then in force is revoked), every later one is dropped and
  reported in ``duplicates``. A holder whose lease was revoked or moved gets
  :class:`~p2psync.errors.LeaseExpired` on renew and progress, and stops.
- Lease ids grow monotonically across the table, so a node that gets the same
  work back is not confused with its own earlier lease.

``now`` is the coordinator's clock; holders only need to renew well within
``ttl`` of their own clocks (every ``ttl / 3`` is the intent).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from typing import Any, TypeVar

from p2psync.errors import LeaseExpired, ProgressGap, UnknownWork

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _put_column(col: list[_T], offset: int, extra: Sequence[_T] | None) -> None:
    """Write ``extra`` at ``offset`` of one response's column. A column stays a contiguous prefix
    of known values: a range reported without it (or after a hole in it) cuts it there."""
    if extra is not None and len(col) >= offset:
        del col[offset:]
        col.extend(extra)
    else:
        del col[min(offset, len(col)):]


@dataclass(frozen=True)
class WorkItem:
    """A prompt group: ``responses`` completions of one prompt, idempotent by ``work_id``."""

    work_id: str
    prompt_key: str = ""
    """Key for output-length history (e.g. a hash of the prompt)."""
    payload: Any = None
    """What the holder needs to generate (opaque here)."""
    responses: int = 1


@dataclass(frozen=True)
class Lease:
    """A grant: ``holder`` may work on ``work_id`` until ``expires_at`` unless it renews."""

    work_id: str
    holder: str
    lease_id: int
    expires_at: float
    resume: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Tokens already generated per response index: continue from them."""
    done: frozenset[int] = frozenset()
    """Responses already finished by earlier holders: do not generate them again."""
    resume_logprobs: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """Log-probabilities of the ``resume`` tokens (same length, when the holders reported them)."""
    resume_versions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Weight version that produced each ``resume`` token (same length, when reported)."""
    finish: dict[int, str] = field(default_factory=dict)
    """Finish reason of each ``done`` response, when its holder reported one."""


@dataclass(frozen=True)
class Completion:
    """What happened to a result: ``accepted`` once per work id, else a dropped duplicate."""

    work_id: str
    node: str
    accepted: bool
    reason: str


@dataclass
class _Work:
    item: WorkItem
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    versions: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    lease: Lease | None = None
    grants: dict[int, str] = field(default_factory=dict)
    """lease id -> holder, for every lease ever granted on this work."""
    result: Any = None
    completed: bool = False
    attempts: int = 0

    @property
    def tokens_done(self) -> int:
        return sum(len(t) for t in self.tokens.values())


@dataclass(frozen=True)
class QueuedWork:
    """A queued item as the scheduler sees it."""

    work_id: str
    prompt_key: str
    tokens_done: int
    attempts: int


class LeaseTable:
    """Queue, leases and results of rollout work (see the module docstring for the contract)."""

    def __init__(self, ttl: float = 30.0) -> None:
        if not ttl > 0:
            raise ValueError("ttl must be > 0")
        self.ttl = ttl
        self._work: dict[str, _Work] = {}
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._by_holder: dict[str, set[str]] = {}
        self._next_lease = 0
        self.duplicates: list[Completion] = []
        self.requeued = 0

    # ------------------------------------------------------------ queue

    def submit(self, item: WorkItem) -> None:
        """Queue new work; submitting a known work id again is a no-op (idempotent)."""
        if item.work_id in self._work:
            return
        self._work[item.work_id] = _Work(item)
        self._queue[item.work_id] = None

    def queued(self) -> list[QueuedWork]:
        """Queued work, oldest (or returned) first."""
        return [QueuedWork(w, (s := self._work[w]).item.prompt_key, s.tokens_done, s.attempts) for w in self._queue]

    def item(self, work_id: str) -> WorkItem:
        return self._state(work_id).item

    def _state(self, work_id: str) -> _Work:
        s = self._work.get(work_id)
        if s is None:
            raise UnknownWork(work_id)
        return s

    # ------------------------------------------------------------ leases

    def grant(self, now: float, node: str, work_id: str | None = None) -> Lease:
        """Lease ``work_id`` (or the oldest queued work) to ``node``; :class:`UnknownWork` if it is not queued."""
        if work_id is None:
            if not self._queue:
                raise UnknownWork("<empty queue>")
            work_id = next(iter(self._queue))
        s = self._state(work_id)
        if work_id not in self._queue:
            raise UnknownWork(work_id)
        del self._queue[work_id]
        self._next_lease += 1
        open_ = [r for r in s.tokens if r not in s.done]
        lease = Lease(work_id, node, self._next_lease, now + self.ttl,
                      {r: tuple(s.tokens[r]) for r in open_}, frozenset(s.done),
                      {r: tuple(s.logprobs.get(r, ())) for r in open_},
                      {r: tuple(s.versions.get(r, ())) for r in open_}, dict(s.finish))
        s.lease = lease
        s.grants[lease.lease_id] = node
        s.attempts += 1
        self._by_holder.setdefault(node, set()).add(work_id)
        return lease

    def _current(self, node: str, work_id: str, lease_id: int) -> _Work:
        s = self._state(work_id)
        if s.lease is None or s.lease.lease_id != lease_id or s.lease.holder != node:
            raise LeaseExpired(work_id)
        return s

    def renew(self, now: float, node: str, work_id: str, lease_id: int) -> Lease:
        """Extend a lease by ``ttl`` from ``now``; :class:`LeaseExpired` if it is no longer this node's."""
        s = self._current(node, work_id, lease_id)
        assert s.lease is not None
        s.lease = replace(s.lease, expires_at=now + self.ttl)
        return s.lease

    def progress(self, now: float, node: str, work_id: str, lease_id: int, response: int, offset: int,
                 tokens: tuple[int, ...] | list[int], finished: bool = False, *,
                 logprobs: tuple[float, ...] | list[float] | None = None,
                 versions: tuple[int, ...] | list[int] | None = None, finish_reason: str | None = None) -> int:
        """Record tokens ``[offset, offset + len(tokens))`` of one response and renew the lease.

        ``logprobs`` and ``versions``, when given, run parallel to ``tokens`` and are
        kept beside them (a report without them keeps only tokens for that range).
        A report may overlap what is recorded (a retry); the holder's tokens replace
        the overlap. ``finished`` (or a ``finish_reason``) marks the response done.
        Returns the number of tokens recorded for that response. Raises
        :class:`ProgressGap` (nothing recorded) if the report starts past the
        recorded tokens or names no response of the work, and ``ValueError`` if
        ``logprobs``/``versions`` do not match ``tokens`` in length.
        """
        s = self._current(node, work_id, lease_id)
        if not 0 <= response < s.item.responses:
            raise ProgressGap(work_id, response, offset, 0)
        for name, extra in (("logprobs", logprobs), ("versions", versions)):
            if extra is not None and len(extra) != len(tokens):
                raise ValueError(f"{name}: {len(extra)} values for {len(tokens)} tokens")
        have = s.tokens.setdefault(response, [])
        if offset > len(have) or offset < 0:
            raise ProgressGap(work_id, response, offset, len(have))
        del have[offset:]
        have.extend(tokens)
        _put_column(s.logprobs.setdefault(response, []), offset, logprobs)
        _put_column(s.versions.setdefault(response, []), offset, versions)
        if finished or finish_reason is not None:
            s.done.add(response)
            if finish_reason is not None:
                s.finish[response] = finish_reason
        self.renew(now, node, work_id, lease_id)
        return len(have)

    def _requeue(self, s: _Work, why: str) -> None:
        assert s.lease is not None
        self._by_holder.get(s.lease.holder, set()).discard(s.item.work_id)
        logger.info("work %s back to the queue (%s from %s, %d tokens kept)", s.item.work_id, why,
                    s.lease.holder, s.tokens_done)
        s.lease = None
        self._queue[s.item.work_id] = None
        self._queue.move_to_end(s.item.work_id, last=False)
        self.requeued += 1

    def expire(self, now: float) -> list[str]:
        """Return work whose lease ran out to the front of the queue; the work ids."""
        out = [w for w, s in self._work.items() if s.lease is not None and s.lease.expires_at <= now]
        for w in out:
            self._requeue(self._work[w], "lease expired")
        return out

    def release_all(self, now: float, node: str) -> list[str]:
        """A node hands back every lease at once (preemption notice): the work, with its
        tokens, goes back to the front of the queue. Returns the work ids."""
        out = sorted(self._by_holder.get(node, ()))
        for w in out:
            self._requeue(self._work[w], "released")
        return out

    def next_expiry(self) -> float | None:
        """When :meth:`expire` next has something to do (for the host's timer)."""
        times = [s.lease.expires_at for s in self._work.values() if s.lease is not None]
        return min(times, default=None)

    # ------------------------------------------------------------ results

    def complete(self, now: float, node: str, work_id: str, lease_id: int, result: Any = None) -> Completion:
        """Take the result of ``work_id`` once; later results are dropped and reported."""
        s = self._state(work_id)
        if s.grants.get(lease_id) != node:
            raise LeaseExpired(work_id)
        if s.completed:
            c = Completion(work_id, node, False, "duplicate: already completed")
            self.duplicates.append(c)
            logger.warning("dropping duplicate result for %s from %s", work_id, node)
            return c
        late = s.lease is None or s.lease.lease_id != lease_id
        if s.lease is not None:
            self._by_holder.get(s.lease.holder, set()).discard(work_id)
            s.lease = None
        self._queue.pop(work_id, None)
        s.completed = True
        s.result = result
        return Completion(work_id, node, True, "late result of an expired lease" if late else "completed")

    def result(self, work_id: str) -> Any:
        return self._state(work_id).result

    def tokens(self, work_id: str) -> dict[int, tuple[int, ...]]:
        """Tokens recorded so far per response."""
        return {r: tuple(t) for r, t in self._state(work_id).tokens.items()}

    def history(self, work_id: str) -> dict[int, tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]]:
        """(tokens, logprobs, versions) recorded so far per response; a column a holder did not
        report is shorter than the tokens."""
        s = self._state(work_id)
        return {r: (tuple(t), tuple(s.logprobs.get(r, ())), tuple(s.versions.get(r, ()))) for r, t in s.tokens.items()}

    def holders_of(self, work_id: str) -> list[str]:
        """Every node that ever held a lease on ``work_id``, in grant order, each once."""
        return list(dict.fromkeys(self._state(work_id).grants.values()))

    def is_completed(self, work_id: str) -> bool:
        return self._state(work_id).completed

    def release(self, now: float, node: str, work_id: str, lease_id: int) -> None:
        """The holder hands one lease back: the work, with its tokens, goes to the front of the queue.

        :class:`LeaseExpired` if the lease is no longer this node's (nothing changes)."""
        s = self._current(node, work_id, lease_id)
        self._requeue(s, "released")

    # ------------------------------------------------------------ views

    def holders(self) -> dict[str, list[tuple[str, float]]]:
        """node -> [(work id, expires_at)]: what the coordinator publishes as ``leases/<node>``."""
        out: dict[str, list[tuple[str, float]]] = {}
        for node, works in self._by_holder.items():
            leases = [(w, self._work[w].lease.expires_at) for w in sorted(works)]  # type: ignore[union-attr]
            out[node] = leases
        return out

    def leases_of(self, node: str) -> list[Lease]:
        return [self._work[w].lease for w in sorted(self._by_holder.get(node, ()))]  # type: ignore[misc]

    def pending(self) -> int:
        """Submitted work not completed yet."""
        return sum(1 for s in self._work.values() if not s.completed)

    def counts(self) -> dict[str, int]:
        c = {"queued": len(self._queue), "leased": 0, "completed": 0, "duplicates": len(self.duplicates)}
        for s in self._work.values():
            if s.completed:
                c["completed"] += 1
            elif s.lease is not None:
                c["leased"] += 1
        return c

    def all_completed(self) -> bool:
        return all(s.completed for s in self._work.values())
