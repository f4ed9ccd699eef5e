"""The rollout side of the coordinator: :class:`WorkClient` (``node.work``), a
:class:`~p2psync.control.api.WorkSource` over the coordinator's HTTP API
(:mod:`p2psync.control.coordinator`).

Contracts:

- While a grant is held (from :meth:`WorkClient.request` until ``complete`` or
  ``release``) one background task renews its lease every ``ttl / 3``; a lease
  the coordinator says is gone (409) is marked lost, and the next ``progress``
  on it raises :class:`~p2psync.errors.LeaseExpired` (the worker drops it).
- Progress is kept locally in full per response and sent from what the
  coordinator acknowledged, so a report lost to the network is re-sent with the
  next one (and a ``gap`` answer makes the client re-send from there): the
  coordinator's copy is always a prefix of the worker's, never has holes.
- ``complete`` is retried on network errors (the result is what the work was
  for) and returns the coordinator's verdict: True once per work id, False for
  a duplicate.
- :meth:`stop` (node shutdown, e.g. SIGTERM) hands back every grant still held
  with one ``release_all``, so their work moves on at once, with its tokens.

The coordinator's URL is ``control.coordinator_url`` if set, else the trainer's
address learned from gossip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from p2psync.control.api import Grant, ProgressReport, ResponseResult
from p2psync.control.bodies import CONTROL, MAX_REPORTS
from p2psync.errors import LeaseExpired, P2PSyncError, PeerUnreachable, UnknownWork
from p2psync.retry import Backoff
from p2psync.transport.client import cancel_quietly

LEASE_RETRY = Backoff(first=0.5, cap=5.0, jitter=0.5)
"""Pause after a lease request that found the coordinator unreachable (within the request's wait),
growing while it stays so: a fleet that lost the coordinator does not come back as one wave."""
COMPLETE_RETRY = Backoff(first=0.5, cap=4.0, jitter=0.5)
"""Pauses between the tries of delivering a result."""

if TYPE_CHECKING:
    from p2psync.control.gossip_service import GossipService
    from p2psync.host import Host

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    grant: Grant
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    versions: dict[int, list[int]] = field(default_factory=dict)
    acked: dict[int, int] = field(default_factory=dict)
    lost: bool = False
    renewed_at: float = field(default_factory=time.monotonic)
    """When the coordinator last extended this lease (a grant, renewal or progress report)."""


class WorkClient:
    """Leases on rollout work for one rollout node (``node.work``).

    ``gossip``: the node's gossip service when gossip is on (finds the coordinator; carries this
    node's measured throughput)."""

    def __init__(self, host: Host, gossip: GossipService | None = None) -> None:
        self.host = host
        self.gossip = gossip
        self.settings = host.config.control
        self.ttl = 30.0
        self._lease_failures = 0
        self._held: dict[tuple[str, int], _Held] = {}
        self._session: aiohttp.ClientSession | None = None
        self._renewer: asyncio.Task | None = None
        self._tokens_window: list[tuple[float, int]] = []
        self.throughput = 0.0

    # --- service ---------------------------------------------------------------------------------
    def routes(self) -> list:
        return []

    async def start(self) -> None:
        cfg = self.host.config
        self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {cfg.token()}",
                                                       "Content-Type": "application/json"},
                                              connector=self.host.tls.connector())
        self._renewer = asyncio.create_task(self._renew_loop(), name=f"{cfg.id}:lease-renewal")

    async def stop(self) -> None:
        """Hand back every grant still held, then stop renewing."""
        if self._held:
            try:
                await self.release_all()
            except P2PSyncError as exc:
                self.host.log.warning("could not hand back %d leases on stop: %s", len(self._held), exc)
        await cancel_quietly(self._renewer)
        if self._session is not None:
            await self._session.close()

    # --- wire ----------------------------------------------------------------------------------
    def coordinator_url(self) -> str | None:
        if self.settings.coordinator_url:
            return self.settings.coordinator_url.rstrip("/")
        g = self.gossip
        return g.coordinator_address() if g is not None else None

    async def _call(self, verb: str, body: dict[str, Any], extra_time: float = 0.0) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to ``/v1/control/<verb>``: (status, JSON answer). :class:`PeerUnreachable`
        if the coordinator is unknown, unreachable, or answers something other than JSON."""
        url = self.coordinator_url()
        if url is None:
            raise PeerUnreachable("coordinator", "address not known yet (no control.coordinator_url, not in gossip)")
        assert self._session is not None
        body = {"node": self.host.config.id, **body}
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout + extra_time)
        try:
            async with self._session.post(f"{url}{CONTROL}/{verb}", data=json.dumps(body), timeout=timeout) as resp:
                data = await resp.json(content_type=None)
                if not isinstance(data, dict):
                    raise PeerUnreachable(url, f"{verb}: answer is not a JSON object")
                if resp.status in (400, 413):
                    raise P2PSyncError(f"coordinator refused {verb}: {data.get('error')}")
                if resp.status >= 500 or resp.status == 401:
                    raise PeerUnreachable(url, f"{verb}: HTTP {resp.status} {data.get('error', '')}")
                return resp.status, data
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise PeerUnreachable(url, f"{verb}: {type(exc).__name__}: {exc}") from None

    def _key(self, grant: Grant) -> tuple[str, int]:
        return (grant.work_id, grant.lease_id)

    # --- WorkSource ----------------------------------------------------------------------------
    async def request(self, max_items: int = 1, wait: float = 5.0, version: int | None = None) -> list[Grant]:
        """Up to ``max_items`` grants; waits up to ``wait`` s for work, else returns ``[]``.
        ``version``: the weights version this node generates with now (see :class:`~p2psync.control.api.WorkSource`)."""
        deadline = time.monotonic() + wait
        body: dict[str, Any] = {"max_items": max_items, "wait": wait}
        if version is not None:
            body["version"] = int(version)
        try:
            status, data = await self._call("lease", body, extra_time=wait)
        except PeerUnreachable as exc:
            self.host.log.info("no lease: %s", exc)
            await asyncio.sleep(max(0.0, min(LEASE_RETRY.delay(self._lease_failures), deadline - time.monotonic())))
            self._lease_failures += 1
            return []
        self._lease_failures = 0
        self.ttl = float(data.get("ttl", self.ttl))
        grants = []
        for g in data.get("grants", []):
            resume = {int(r): ([int(t) for t in v["tokens"]], [float(x) for x in v["logprobs"]],
                               [int(x) for x in v["versions"]]) for r, v in g["resume"].items()}
            grant = Grant(g["work_id"], int(g["lease_id"]), g["payload"], int(g["responses"]), resume,
                          {int(r): d for r, d in g["done"].items()})
            held = _Held(grant)
            for r, (t, lp, vs) in resume.items():
                held.tokens[r], held.logprobs[r], held.versions[r] = list(t), list(lp), list(vs)
                held.acked[r] = len(t)
            self._held[self._key(grant)] = held
            grants.append(grant)
        return grants

    async def progress(self, grant: Grant, response: int, offset: int, tokens: Sequence[int],
                       logprobs: Sequence[float], versions: Sequence[int], finish_reason: str | None = None) -> None:
        """Tokens ``offset..`` of response ``response`` so far (called every few tokens).

        ``finish_reason`` (an addition to the contract) marks the response finished, so
        that a later holder gets it in ``Grant.done`` instead of continuing it."""
        h = self._keep(ProgressReport(grant, response, offset, tokens, logprobs, versions, finish_reason))
        await self._send_progress(h, response, finish_reason)

    def _keep(self, r: ProgressReport) -> _Held:
        """Record a report locally (what the coordinator has not acknowledged is re-sent from here)."""
        h = self._held.get(self._key(r.grant))
        if h is None or h.lost:
            self._held.pop(self._key(r.grant), None)
            raise LeaseExpired(r.grant.work_id)
        if not len(r.tokens) == len(r.logprobs) == len(r.versions):
            raise ValueError("progress: tokens, logprobs and versions differ in length")
        response, offset = r.response, r.offset
        have = h.tokens.setdefault(response, [])
        if offset > len(have) or offset < 0:
            raise ValueError(f"progress: offset {offset} but only {len(have)} tokens of response {response} given")
        new = len(r.tokens) - (len(have) - offset)
        del have[offset:], h.logprobs.setdefault(response, [])[offset:], h.versions.setdefault(response, [])[offset:]
        have.extend(int(t) for t in r.tokens)
        h.logprobs[response].extend(float(x) for x in r.logprobs)
        h.versions[response].extend(int(v) for v in r.versions)
        h.acked[response] = min(h.acked.get(response, 0), offset)
        self._measure(new)
        return h

    async def progress_many(self, reports: Sequence[ProgressReport]) -> list[BaseException | None]:
        """Several responses' progress in as few requests as fit ``control.max_body_bytes`` (one,
        usually): per report ``None`` (recorded, or kept locally and re-sent with the next report
        if the coordinator was unreachable) or the error :meth:`progress` would raise for it
        (:class:`LeaseExpired` for a lost lease, ``ValueError`` for a malformed report)."""
        out: list[BaseException | None] = [None] * len(reports)
        todo: list[tuple[int, _Held, int, str | None]] = []
        for i, r in enumerate(reports):
            try:
                todo.append((i, self._keep(r), r.response, r.finish_reason))
            except (LeaseExpired, ValueError) as exc:
                out[i] = exc
        for _ in range(3):  # a "gap" answer is re-sent from what the coordinator has
            if not todo:
                break
            again: list[tuple[int, _Held, int, str | None]] = []
            for part, bodies in self._batches(todo):
                try:
                    status, data = await self._call("progress_many", {"reports": bodies})
                    answers = data.get("results")
                    if status != 200 or not isinstance(answers, list) or len(answers) != len(part):
                        raise PeerUnreachable("coordinator", f"progress_many: HTTP {status}, "
                                                             f"{len(answers or [])} answers for {len(part)}")
                except (PeerUnreachable, P2PSyncError) as exc:
                    # Kept locally; the next report (or the renewal) carries on from the acknowledged part.
                    self.host.log.warning("progress of %d responses not delivered: %s", len(part), exc)
                    continue
                now = time.monotonic()
                for (i, h, response, reason), ans in zip(part, answers):
                    code = ans.get("status", 200) if isinstance(ans, dict) else 0
                    if code == 200 and "have" in ans:
                        h.acked[response] = int(ans["have"])
                        h.renewed_at = now  # a progress report renews the lease
                    elif code == 409 and ans.get("kind") == "gap":
                        h.acked[response] = int(ans["have"])
                        again.append((i, h, response, reason))
                    elif code in (404, 409):
                        h.lost = True
                        self._held.pop(self._key(h.grant), None)
                        out[i] = LeaseExpired(h.grant.work_id)
                    else:
                        out[i] = P2PSyncError(f"coordinator refused progress on {h.grant.work_id}: "
                                              f"{ans.get('error') if isinstance(ans, dict) else ans!r}")
            todo = again
        return out

    def _batches(self, todo: list[tuple[int, _Held, int, str | None]]):
        """``todo`` as request bodies within the coordinator's body and report limits (a report alone
        over the size limit still goes, alone, and gets the coordinator's refusal)."""
        limit = self.settings.max_body_bytes - 1024
        part: list[tuple[int, _Held, int, str | None]] = []
        bodies: list[dict[str, Any]] = []
        size = 0
        for item in todo:
            _, h, response, reason = item
            start = h.acked.get(response, 0)
            body = {"work_id": h.grant.work_id, "lease_id": h.grant.lease_id, "response": response,
                    "offset": start, "tokens": h.tokens[response][start:], "logprobs": h.logprobs[response][start:],
                    "versions": h.versions[response][start:], "finish_reason": reason}
            n = 200 + 48 * (len(h.tokens[response]) - start)  # JSON of a token, its log-prob and version: < 48 bytes
            if part and (size + n > limit or len(part) >= MAX_REPORTS):
                yield part, bodies
                part, bodies, size = [], [], 0
            part.append(item)
            bodies.append(body)
            size += n
        if part:
            yield part, bodies

    async def _send_progress(self, h: _Held, response: int, finish_reason: str | None) -> None:
        for _ in range(3):
            start = h.acked.get(response, 0)
            body = {"work_id": h.grant.work_id, "lease_id": h.grant.lease_id, "response": response, "offset": start,
                    "tokens": h.tokens[response][start:], "logprobs": h.logprobs[response][start:],
                    "versions": h.versions[response][start:], "finish_reason": finish_reason}
            try:
                status, data = await self._call("progress", body)
            except PeerUnreachable as exc:
                # Kept locally; the next report (or the renewal) carries on from the acknowledged part.
                self.host.log.warning("progress on %s not delivered: %s", h.grant.work_id, exc)
                return
            if status == 200:
                h.acked[response] = int(data["have"])
                h.renewed_at = time.monotonic()  # a progress report renews the lease
                return
            if status == 409 and data.get("kind") == "gap":
                h.acked[response] = int(data["have"])
                continue
            if status in (404, 409):
                h.lost = True
                self._held.pop(self._key(h.grant), None)
                raise LeaseExpired(h.grant.work_id)
            raise PeerUnreachable("coordinator", f"progress: HTTP {status}")

    def _measure(self, new_tokens: int) -> None:
        now = time.monotonic()
        w = self._tokens_window
        w.append((now, max(0, new_tokens)))
        while w and now - w[0][0] > 10.0:
            w.pop(0)
        span = now - w[0][0]
        if span >= 1.0:
            self.throughput = sum(n for _, n in w[1:]) / span
            if self.gossip is not None:
                self.gossip.update_self(throughput=self.throughput)

    async def complete(self, grant: Grant, responses: dict[int, ResponseResult]) -> bool:
        """Final responses; True if accepted, False if a duplicate. Raises
        :class:`LeaseExpired` if the coordinator never leased this work to this node."""
        body = {"work_id": grant.work_id, "lease_id": grant.lease_id,
                "responses": {str(i): r.to_json() for i, r in responses.items()}}
        delays = COMPLETE_RETRY.delays()
        for attempt in range(6):
            try:
                status, data = await self._call("complete", body)
                break
            except PeerUnreachable as exc:
                if attempt == 5:
                    raise
                self.host.log.warning("result of %s not delivered (%s); retrying", grant.work_id, exc)
                await asyncio.sleep(next(delays))
        self._held.pop(self._key(grant), None)
        if status == 200:
            return bool(data["accepted"])
        if status == 404:
            raise UnknownWork(grant.work_id)
        raise LeaseExpired(grant.work_id)

    async def release(self, grant: Grant) -> None:
        """Hand one grant back (its progress stays with the coordinator)."""
        if self._held.pop(self._key(grant), None) is None:
            return
        try:
            await self._call("release", {"work_id": grant.work_id, "lease_id": grant.lease_id})
        except PeerUnreachable as exc:
            self.host.log.warning("release of %s not delivered (its lease will expire): %s", grant.work_id, exc)

    async def release_all(self) -> None:
        """Preemption: hand back every grant at once."""
        held = len(self._held)
        self._held.clear()
        if not held:
            return
        try:
            _, data = await self._call("release_all", {})
            self.host.log.info("handed back %d leases: %s", held, data.get("released"))
        except PeerUnreachable as exc:
            self.host.log.warning("release_all not delivered (the leases will expire): %s", exc)

    @property
    def held(self) -> list[Grant]:
        """Grants held now (not lost, completed or released)."""
        return [h.grant for h in self._held.values() if not h.lost]

    # --- renewal -------------------------------------------------------------------------------
    async def _renew_loop(self) -> None:
        """Renew each held lease once a third of its ttl has passed since it was last extended."""
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.ttl / 6)))
            now = time.monotonic()
            for key, h in list(self._held.items()):
                if h.lost or now - h.renewed_at < self.ttl / 3:
                    continue
                try:
                    status, _ = await self._call("renew", {"work_id": h.grant.work_id, "lease_id": h.grant.lease_id})
                except PeerUnreachable as exc:
                    self.host.log.warning("renewal of %s failed: %s", h.grant.work_id, exc)
                    continue
                if status == 200:
                    h.renewed_at = now
                elif key in self._held:
                    self.host.log.warning("lease on %s lost (HTTP %d)", h.grant.work_id, status)
                    h.lost = True
