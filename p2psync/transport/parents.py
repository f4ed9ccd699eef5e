"""Choice of the parent to pull from (sans-IO: takes ``now``, touches no socket).

Contract: :meth:`ParentSet.current` returns the most preferred candidate that is
neither resting after a failure nor avoided for serving corrupt data; when all
are out, the one that comes back first. Chunks already held are never tied to a
parent, so switching loses nothing. The candidates are the planned parent (from
the live plan, :meth:`ParentSet.plan`) first, then the configured ones; a new
plan changes the order, never the failure and corruption records.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from p2psync.retry import Backoff


@dataclass
class ParentSet:
    candidates: list[str]
    """Candidate parent URLs, most preferred first."""
    retry_after: float
    """Seconds a failed parent rests."""
    avoid_seconds: float
    """Seconds a parent that served corrupt data is avoided."""
    max_rest: float = 30.0
    """Longest rest after repeated failures (the rest's ceiling doubles per consecutive failure)."""
    jitter: float = 0.5
    """Share of each rest drawn at random (:class:`p2psync.retry.Backoff`), so that the children of a
    parent that failed do not all come back to it at one moment."""
    rng: random.Random = field(default_factory=random.Random, repr=False)
    _down_until: dict[str, float] = field(default_factory=dict)
    _fails: dict[str, int] = field(default_factory=dict)
    _avoid_until: dict[str, float] = field(default_factory=dict)
    _last: str | None = None
    switches: int = 0

    planned: str | None = None
    """The parent the live plan gives this node (first candidate), if any."""
    configured: list[str] = field(default_factory=list)
    """The candidates from the node's configuration, in their order."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("parents: at least one candidate is needed")
        self.candidates = [c.rstrip("/") for c in self.candidates]
        if not self.configured:
            self.configured = list(self.candidates)

    def plan(self, url: str | None) -> bool:
        """Make ``url`` (the planned parent; None: no plan) the first candidate, the configured
        ones after it. Returns True if the candidate list changed."""
        url = url.rstrip("/") if url else None
        cands = list(dict.fromkeys(([url] if url else []) + self.configured))
        self.planned = url
        if cands == self.candidates:
            return False
        self.candidates = cands
        return True

    def _out_until(self, url: str) -> float:
        return max(self._down_until.get(url, 0.0), self._avoid_until.get(url, 0.0))

    def current(self, now: float) -> str:
        for url in self.candidates:
            if self._out_until(url) <= now:
                return self._note(url)
        return self._note(min(self.candidates, key=self._out_until))

    def wait_time(self, now: float) -> float:
        """Seconds until :meth:`current` has a candidate that is not out (0 if one is ready)."""
        return max(0.0, min(self._out_until(u) for u in self.candidates) - now)

    def _note(self, url: str) -> str:
        if self._last is not None and url != self._last:
            self.switches += 1
        self._last = url
        return url

    def failed(self, url: str, now: float) -> None:
        """``url`` errored, stalled or lacked what we asked for: rest it (longer each time in a row)."""
        n = self._fails.get(url, 0) + 1
        self._fails[url] = n
        rest = Backoff(first=self.retry_after, cap=max(self.max_rest, self.retry_after), jitter=self.jitter)
        self._down_until[url] = now + rest.delay(n - 1, self.rng)

    def refused(self, url: str, now: float) -> None:
        """``url`` refused this node for a reason only an operator fixes (wrong token, another CA,
        revoked): rest it ``max_rest`` at once, and count it as a failure in a row."""
        self._fails[url] = self._fails.get(url, 0) + 1
        self._down_until[url] = now + self.max_rest

    def corrupt(self, url: str, now: float) -> None:
        """``url`` served data that failed verification: avoid it for longer."""
        self._avoid_until[url] = now + self.avoid_seconds

    def ok(self, url: str) -> None:
        """``url`` delivered: forget its failures."""
        self._down_until.pop(url, None)
        self._fails.pop(url, None)

    def avoided(self, now: float) -> list[str]:
        return [u for u in self.candidates if self._avoid_until.get(u, 0.0) > now]
