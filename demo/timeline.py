"""When each version reached each node, from the nodes' own log records (pure: no I/O, no clock).

The demo starts every node with ``--log-json``, so each log line is a JSON
object with the wall-clock time ``t`` the node stamped on it. The records read:

- the trainer's ``published <artifact>``: the version is announced (children may
  fetch it from now on);
- every node's ``holds <artifact>: ...``: it holds every chunk, verified;
- every node's ``applied <artifact> (...) -> version V fingerprint F``: its own
  copy is at V (the fingerprint is also checked against the trainer's);
- a rollout worker's ``engine serving version V (...)``: the engine generates
  with V from now on;
- ``parent is now URL`` / ``parent URL failed: reason`` / ``planned parent: ID (URL)``:
  the parent a node pulls from, why it changed.

All nodes run on one machine, so their clocks agree: a delay is the difference
of two nodes' timestamps, measured by the nodes, not by polling them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_AID = r"((?:delta|snapshot)-[^-\s]+-(\d+)-[0-9a-f]+)"
_PUBLISHED = re.compile(r"\] published " + _AID + r"$")
_HOLDS = re.compile(r"\] holds " + _AID + r":")
_APPLIED = re.compile(r"\] applied " + _AID + r" \((\d+) bytes\) -> version (\d+) fingerprint ([0-9a-f]+)")
_ENGINE = re.compile(r"\] engine serving version (\d+) \(([\w-]+)")
_PARENT_NOW = re.compile(r"\] parent is now (\S+)$")
_PARENT_FAILED = re.compile(r"\] parent (\S+) failed: (.*)$")
_PLANNED = re.compile(r"\] planned parent: (\S+) \((\S+)\)")
_CORRUPT = re.compile(r"\] peer (\S+) served (.*?); dropped it")


@dataclass(frozen=True)
class ParentChange:
    time: float
    node: str
    parent: str
    """Name of the new parent (its URL where no node has it)."""
    reason: str
    """``"plan"`` (the coordinator's plan named it), ``"failover: <why the previous one failed>"``, or ``"parent list"`` (the node went back to a
    higher-ranked parent of its list, e.g. after that one's rest)."""


@dataclass
class Timeline:
    """Per version and node: when it was held, applied and served by the engine; parents used."""

    roles: dict[str, str]
    regions: dict[str, str]
    url_names: dict[str, str] = field(default_factory=dict)
    """Node URL (no trailing slash) -> node name."""
    announced: dict[int, float] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    held: dict[int, dict[str, float]] = field(default_factory=dict)
    applied: dict[int, dict[str, float]] = field(default_factory=dict)
    engine: dict[int, dict[str, float]] = field(default_factory=dict)
    held_from: dict[int, dict[str, str]] = field(default_factory=dict)
    """version -> node -> the parent it had when it held the version."""
    parent_changes: list[ParentChange] = field(default_factory=list)
    configured: dict[str, str] = field(default_factory=dict)
    """Each node's configured first parent: its parent until a plan or a failure moves it."""
    parent_now: dict[str, str] = field(default_factory=dict)
    fingerprints: list[tuple[str, int, str]] = field(default_factory=list)
    """(node, version, fingerprint) from ``applied`` records, for the bit-exact check."""
    _pending_reason: dict[str, str] = field(default_factory=dict)

    def name_of(self, url: str) -> str:
        return self.url_names.get(url.rstrip("/"), url)

    def feed(self, node: str, rec: dict) -> None:
        """One JSON log record of ``node``."""
        msg, t = rec.get("msg"), rec.get("t")
        if not isinstance(msg, str) or not isinstance(t, (int, float)) or "] " not in msg:
            return
        if m := _HOLDS.search(msg):
            v = int(m.group(2))
            self.held.setdefault(v, {}).setdefault(node, t)
            parent = self.parent_now.get(node, self.configured.get(node))
            if parent is not None:
                self.held_from.setdefault(v, {}).setdefault(node, parent)
        elif m := _APPLIED.search(msg):
            v = int(m.group(4))
            self.applied.setdefault(v, {}).setdefault(node, t)
            self.kinds.setdefault(v, m.group(1).split("-", 1)[0])
            self.fingerprints.append((node, v, m.group(5)))
        elif m := _ENGINE.search(msg):
            self.engine.setdefault(int(m.group(1)), {}).setdefault(node, t)
        elif m := _PUBLISHED.search(msg):
            if self.roles.get(node) == "trainer":
                v = int(m.group(2))
                self.announced.setdefault(v, t)
                self.kinds.setdefault(v, m.group(1).split("-", 1)[0])
        elif m := _PARENT_NOW.search(msg):
            parent = self.name_of(m.group(1))
            reason = self._pending_reason.pop(node, "parent list")
            self.parent_now[node] = parent
            self.parent_changes.append(ParentChange(t, node, parent, reason))
        elif m := _PARENT_FAILED.search(msg):
            self._pending_reason[node] = f"failover: {self.name_of(m.group(1))} failed ({m.group(2)[:120]})"
        elif m := _CORRUPT.search(msg):
            self._pending_reason[node] = f"failover: {self.name_of(m.group(1))} served {m.group(2)[:80]}"
        elif _PLANNED.search(msg):
            self._pending_reason[node] = "plan"

    # --- figures ---------------------------------------------------------------------------------
    def followers(self) -> list[str]:
        return sorted(n for n, r in self.roles.items() if r != "trainer")

    def delays(self, version: int) -> dict[str, dict[str, float]]:
        """node -> {"held": s, "applied": s, "engine": s} after the trainer announced ``version``
        (only the stages seen so far)."""
        t0 = self.announced.get(version)
        if t0 is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for stage, table in (("held", self.held), ("applied", self.applied), ("engine", self.engine)):
            for node, t in table.get(version, {}).items():
                if self.roles.get(node) != "trainer":
                    out.setdefault(node, {})[stage] = max(0.0, t - t0)
        return out

    def region_delays(self, version: int, stage: str = "held") -> dict[str, float]:
        """region -> seconds from the announcement until the region's last node reached ``stage``;
        only regions where every node did (engines: rollout nodes only)."""
        d = self.delays(version)
        out: dict[str, float] = {}
        incomplete: set[str] = set()
        for node in self.followers():
            if stage == "engine" and self.roles.get(node) != "rollout":
                continue
            region = self.regions.get(node, "?")
            s = d.get(node, {}).get(stage)
            if s is None:
                incomplete.add(region)
            else:
                out[region] = max(out.get(region, 0.0), s)
        return {r: s for r, s in out.items() if r not in incomplete}

    def deltas(self) -> list[int]:
        """Versions announced as deltas, in order."""
        return sorted(v for v in self.announced if self.kinds.get(v) == "delta")

    def parents_used(self) -> dict[str, Counter]:
        """node -> how many versions it held from each parent."""
        out: dict[str, Counter] = {}
        for per in self.held_from.values():
            for node, parent in per.items():
                out.setdefault(node, Counter())[parent] += 1
        return out
