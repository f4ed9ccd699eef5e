"""One retry policy for every loop that asks again: capped exponential backoff with jitter.

Many rollout nodes that lose the same parent, or poll the same coordinator, at the same moment
must not come back in step: each delay is drawn at random below its exponential ceiling (the
"jitter" share of it), so the retries of a fleet spread out instead of arriving as one wave.
Pure: the policy gives delays; the caller sleeps (``await asyncio.sleep(d)``) or hands them to a
fake clock in tests.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays ``first, first*factor, ...`` up to ``cap`` seconds, each lowered by a random share
    of at most ``jitter`` of itself (0: no jitter; 1: anywhere in ``(0, ceiling]``)."""

    first: float = 0.2
    """The first delay's ceiling, seconds."""
    cap: float = 5.0
    """The largest ceiling, seconds."""
    factor: float = 2.0
    """Growth of the ceiling per attempt."""
    jitter: float = 0.5
    """Share of each ceiling drawn at random."""

    def __post_init__(self) -> None:
        if not (self.first > 0 and self.cap >= self.first and self.factor >= 1 and 0 <= self.jitter <= 1):
            raise ValueError(f"backoff needs first > 0, cap >= first, factor >= 1 and 0 <= jitter <= 1: {self}")

    def ceiling(self, attempt: int) -> float:
        """The ceiling of the delay after failed attempt ``attempt`` (0-based)."""
        return min(self.cap, self.first * self.factor ** min(attempt, 64))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The delay after failed attempt ``attempt``: its ceiling less a random share of it."""
        c = self.ceiling(attempt)
        return c * (1.0 - self.jitter * (rng or random).random())

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The delays of attempts 0, 1, 2, ... (endless: the caller decides when to stop)."""
        attempt = 0
        while True:
            yield self.delay(attempt, rng)
            attempt += 1
