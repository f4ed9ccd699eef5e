"""The checks of the chaos soak, fed with what the tool saw (pure: no I/O; times are the caller's).

Truth is what the trainer published: the fingerprint of every version, computed from the
checkpoint before it was handed to ``p2psync publish`` (:meth:`Ledger.published`). Every round
of node statuses (:mod:`p2psync.testbed.observe` ``--poll``) goes through :meth:`Ledger.observe`:

- ``wrong_bits``: distinct (node, version, fingerprint) a node reported that is not the
  trainer's fingerprint of that version (a version the trainer never published counts too);
- ``revoked_received_after``: distinct versions newer than the newest one published before the
  revocation took effect that the revoked node held, applied or was fetching;
- ``leases_double_held``: distinct work ids the coordinator's lease table listed under two
  holders in one snapshot; ``results_accepted_twice``: work ids whose result was accepted twice;
- ``versions_lost``: versions the trainer held before it was killed and did not hold when it
  answered again with its weights loaded, plus versions published that it never reached;
- convergence: :meth:`converged` says whether every live node holds the newest version
  bit-exact in a round.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ledger:
    trainer: str = "trainer"
    truth: dict[int, str] = field(default_factory=dict)
    latest: int = -1
    """The newest version the trainer's publish folder holds (confirmed by ``p2psync publish``)."""
    wrong: set[tuple[str, int, str]] = field(default_factory=set)
    revoked: str | None = None
    revoked_upto: int | None = None
    """The newest version published before the revocation took effect at every node."""
    revoked_seen: set[int] = field(default_factory=set)
    double_held: set[str] = field(default_factory=set)
    lease_snapshots: int = 0
    trainer_max: int | None = None
    """The newest version the running trainer reported (reset when it is killed)."""
    lost: dict[int, int] = field(default_factory=dict)
    """Per trainer restart (its index): versions it held before and not after."""
    _restart: tuple[int, int] | None = None
    """(restart index, version before the kill) until the restarted trainer reports its weights."""
    restarts: int = 0
    bad_chunks: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per node (chunks counted by earlier processes, the last count seen): chunks that failed
    verification against the signed manifest (``bad_chunks`` of its status; a restart resets it)."""

    def publishing(self, version: int, fingerprint: str) -> None:
        """``version`` is about to be published with ``fingerprint`` (before any node can see it)."""
        self.truth[version] = fingerprint

    def published(self, version: int) -> None:
        self.latest = max(self.latest, version)

    def withdrawn(self, version: int) -> None:
        """Publishing ``version`` failed: it never reached the publish folder."""
        if version > self.latest:
            self.truth.pop(version, None)

    def trainer_killed(self) -> None:
        if self.trainer_max is not None:
            self._restart = (self.restarts, self.trainer_max)
        self.restarts += 1
        self.trainer_max = None

    def observe(self, nodes: dict[str, dict], leases: dict | None = None) -> None:
        for name, s in nodes.items():
            if "error" in s:
                continue
            v, fp = s.get("version"), s.get("fingerprint")
            earlier, last = self.bad_chunks.get(name, (0, 0))
            now = int(s.get("bad_chunks", 0))
            self.bad_chunks[name] = (earlier + last, now) if now < last else (earlier, now)
            if v is not None and self.truth.get(v) != fp:
                self.wrong.add((name, v, str(fp)))
            if name == self.trainer and s.get("loaded") and v is not None:
                if self._restart is not None:
                    i, before = self._restart
                    self.lost[i] = max(0, before - v)
                    self._restart = None
                self.trainer_max = v if self.trainer_max is None else max(self.trainer_max, v)
            if name == self.revoked and self.revoked_upto is not None:
                held = {a["target"] for a in s.get("versions", [])}
                if v is not None:
                    held.add(v)
                self.revoked_seen |= {x for x in held if x > self.revoked_upto}
        if leases and isinstance(leases.get("holders"), dict):
            self.lease_snapshots += 1
            seen: dict[str, str] = {}
            for node, works in leases["holders"].items():
                for w in works:
                    if w in seen and seen[w] != node:
                        self.double_held.add(w)
                    seen[w] = node

    def converged(self, nodes: dict[str, dict], live: set[str], target: int) -> bool:
        """Every node of ``live`` answered, at ``target`` or later, with the trainer's bits of its version."""
        for name in live:
            s = nodes.get(name)
            if s is None or "error" in s:
                return False
            v = s.get("version")
            if v is None or v < target or self.truth.get(v) != s.get("fingerprint"):
                return False
        return True

    def laggards(self, nodes: dict[str, dict], live: set[str], target: int) -> dict[str, object]:
        """Why each node of ``live`` is not converged (for the report)."""
        out: dict[str, object] = {}
        for name in sorted(live):
            s = nodes.get(name)
            if s is None or "error" in s:
                out[name] = (s or {}).get("error", "no answer")
            elif s.get("version") is None or s["version"] < target or self.truth.get(s["version"]) != s.get("fingerprint"):
                out[name] = {"version": s.get("version"), "head": s.get("head"), "parent": s.get("parent")}
        return out

    def bad_chunks_total(self) -> int:
        return sum(a + b for a, b in self.bad_chunks.values())

    def versions_lost(self, trainer_final: int | None) -> int:
        """Lost across restarts, plus published versions the trainer never reached by the end."""
        at_end = max(0, self.latest - (trainer_final if trainer_final is not None else -1))
        return sum(self.lost.values()) + at_end
