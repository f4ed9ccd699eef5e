"""The fault schedule of the chaos soak, drawn from a seed (pure: no I/O, no clock).

The run is a sequence of *episodes*: inject one or two faults, hold them, heal them all, then
wait until every live node holds the trainer's newest version (the convergence the soak
measures). An episode pairs at most one process fault (a node killed, the trainer killed, a
relay's disk full) with at most one network fault (a partition between two regions, or loss,
extra delay, reordering or corruption on the links between two regions), so that what is
healed is known. Each fault's kind is drawn among the kinds of its class used least so far, so
that a short run meets every kind too. The one-off faults, a revocation and a late join, get episodes of their own
at fixed shares of the run (a third and a half), with no other fault at the same time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PROCESS_KINDS = ("kill", "restart_trainer", "disk_full")
NETWORK_KINDS = ("partition", "loss", "delay", "reorder", "corrupt")
ALL_KINDS = (*PROCESS_KINDS, *NETWORK_KINDS, "revoke", "late_join")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str = ""
    """A node id (kill, disk_full, revoke, late_join) or ``a|b``: a pair of regions (network faults)."""
    hold_s: float = 0.0
    """How long the fault stays in force (a killed node stays down) before it is healed."""
    level: float = 0.0
    """Loss / reorder / corrupt: share of packets; delay: extra one-way seconds; 0 otherwise."""

    def to_json(self) -> dict:
        return {"kind": self.kind, "target": self.target, "hold_s": round(self.hold_s, 2),
                **({"level": round(self.level, 4)} if self.level else {})}


@dataclass
class Cast:
    """Who may be hit: relays and rollout nodes (killable), the relay with a small disk, the node to
    revoke and the one that joins late (both rollout nodes, never killed), the regions."""

    relays: list[str]
    rollouts: list[str]
    disk_relay: str
    revoke: str
    late: str
    regions: list[str]
    killable: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.killable = [n for n in [*self.relays, *self.rollouts] if n not in (self.revoke, self.late)]


class Schedule:
    """Draws episodes from ``random.Random(seed)``; ``hold`` is the (min, max) hold time in seconds."""

    def __init__(self, cast: Cast, seed: int, hold: tuple[float, float] = (4.0, 10.0)) -> None:
        self.cast = cast
        self.rng = random.Random(seed)
        self.hold = hold
        self.revoked = False
        self.joined = False
        self.used: dict[str, int] = {k: 0 for k in ALL_KINDS}

    def _kind(self, kinds: tuple[str, ...]) -> str:
        least = min(self.used[k] for k in kinds)
        kind = self.rng.choice([k for k in kinds if self.used[k] == least])
        self.used[kind] += 1
        return kind

    def _hold(self) -> float:
        return self.rng.uniform(*self.hold)

    def _network(self) -> Fault:
        r = self.rng
        kind = self._kind(NETWORK_KINDS)
        a, b = r.sample(self.cast.regions, 2)
        level = {"partition": 0.0, "loss": r.uniform(0.02, 0.15), "delay": r.uniform(0.1, 0.4),
                 "reorder": r.uniform(0.2, 0.5), "corrupt": r.uniform(0.005, 0.03)}[kind]
        return Fault(kind, f"{a}|{b}", self._hold(), level)

    def _process(self) -> Fault:
        r = self.rng
        kind = self._kind(PROCESS_KINDS)
        if kind == "kill":
            return Fault(kind, r.choice(self.cast.killable), r.uniform(1.0, self.hold[1]))
        if kind == "restart_trainer":
            return Fault(kind, "trainer", r.uniform(0.5, 3.0))
        return Fault(kind, self.cast.disk_relay, self._hold())

    def next(self, progress: float) -> list[Fault]:
        """The faults of the next episode; ``progress`` is the share of the run's time spent (0..1)."""
        if not self.revoked and progress >= 1 / 3:
            self.revoked = True
            return [Fault("revoke", self.cast.revoke)]
        if not self.joined and progress >= 1 / 2:
            self.joined = True
            return [Fault("late_join", self.cast.late)]
        shape = self.rng.choices(("process", "network", "both"), weights=(3, 3, 4))[0]
        out = []
        if shape in ("process", "both"):
            out.append(self._process())
        if shape in ("network", "both"):
            out.append(self._network())
        return out
