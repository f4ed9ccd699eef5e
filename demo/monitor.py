"""Watch a running :class:`~demo.cluster.LocalCluster`: versions, fingerprints, timings, rewards, plan.

Sources:

- every node's JSON log file (:class:`~demo.timeline.Timeline`): when
  the trainer announced each version and when each node held it, applied it and
  its engine served it, stamped by the nodes themselves; the parents they
  pulled from; the fingerprint of every version every node applied;
- every node's ``/v1/status``, polled (version, fingerprint, parent, bytes):
  the live table of the dashboard, and one more fingerprint source;
- the trainer's ``/v1/cluster``, polled: the coordinator's current plan;
- the training job's metrics file (one JSON line per step, with the version it
  published and that version's fingerprint) and versions file;
- each rollout worker's events file (one JSON line per version switch with the
  engine's own fingerprint, recomputed from its weights, and per batch).

The invariant checked: for every (node, version) seen, the fingerprint equals
the trainer's for that version. A mismatch is recorded, never overwritten.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.cluster import LocalCluster, Proc
from demo.timeline import Timeline


@dataclass
class NodeView:
    name: str
    role: str
    region: str
    version: int | None = None
    fingerprint: str | None = None
    parent: str | None = None
    reachable: bool = False
    engine_version: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class Mismatch:
    node: str
    version: int
    seen: str
    expected: str
    source: str  # "node" (the node's own copy) or "engine" (the rollout engine's weights)


class _Tail:
    """Reads JSON lines appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.partial = ""

    def read(self) -> list[dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return []
        data = self.partial + data
        lines = data.split("\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out


@dataclass
class Monitor:
    cluster: LocalCluster
    metrics_path: Path
    events_paths: dict[str, Path]
    interval: float = 0.5
    versions_path: Path | None = None
    """The trainer's (version, fingerprint) lines, version 0 included."""
    nodes: dict[str, NodeView] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    warm_start: dict | None = None
    expected: dict[int, str] = field(default_factory=dict)
    """Trainer fingerprint per version."""
    timeline: Timeline = field(default_factory=lambda: Timeline({}, {}))
    plans: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    """Each distinct plan the coordinator published (time first seen, child -> parent)."""
    observed: list[tuple[str, int, str, str]] = field(default_factory=list)
    """(node, version, fingerprint, source) as seen, checked once the trainer's is known."""
    mismatches: list[Mismatch] = field(default_factory=list)
    checked: int = 0
    switches: list[dict] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._metrics = _Tail(self.metrics_path)
        self._versions = _Tail(self.versions_path) if self.versions_path else None
        self._events = {n: _Tail(p) for n, p in self.events_paths.items()}
        self._logs: dict[str, _Tail] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="monitor")
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._url_to_name: dict[str, str] = {}
        self._seen: set[tuple[str, int, str, str]] = set()

    def _observe(self, name: str, version: int, fp: str, source: str) -> None:
        key = (name, version, fp, source)
        if key not in self._seen:
            self._seen.add(key)
            self.observed.append(key)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.poll()  # a last look, for what arrived at the very end
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a monitor glitch must not end the demo
                pass
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    # ------------------------------------------------------------------ one look
    def poll(self) -> None:
        procs = list(self.cluster.procs)
        for p in procs:
            self._url_to_name[p.url.rstrip("/")] = p.name
        statuses = list(self._pool.map(lambda p: (p, self.cluster.status(p, timeout=1.0)), procs))
        trainer = next((p for p in procs if p.role == "trainer"), None)
        plan = self._plan_of(trainer) if trainer is not None else None
        now = time.time()
        with self._lock:
            tl = self.timeline
            for p in procs:
                tl.roles[p.name], tl.regions[p.name] = p.role, p.region
                tl.url_names[p.url.rstrip("/")] = p.name
                if p.parents:
                    tl.configured[p.name] = tl.name_of(p.parents[0])
                tail = self._logs.setdefault(p.name, _Tail(p.log))
                for rec in tail.read():
                    tl.feed(p.name, rec)
            for name, version, fp in tl.fingerprints:
                if tl.roles.get(name) != "trainer":
                    self._observe(name, version, fp, "node")
            tl.fingerprints.clear()
            if plan and (not self.plans or self.plans[-1][1] != plan):
                self.plans.append((now, plan))
            for p, st in statuses:
                self._note_status(p, st, now)
            for row in self._metrics.read():
                self._note_step(row)
            for row in self._versions.read() if self._versions else ():
                if row.get("version") is not None and row.get("fingerprint"):
                    self.expected[int(row["version"])] = str(row["fingerprint"])
            for name, tail in self._events.items():
                for ev in tail.read():
                    self._note_event(name, ev)
            self._check()

    def _plan_of(self, trainer: Proc) -> dict[str, str] | None:
        """The coordinator's current plan (child -> parent), from the trainer's ``/v1/cluster``."""
        try:
            nodes = self.cluster.get_json(trainer.url + "/v1/cluster", timeout=1.0).get("nodes", [])
        except (OSError, ValueError, AttributeError):
            return None
        plan = {str(n["id"]): str(n["parent"]) for n in nodes if isinstance(n, dict) and n.get("parent")}
        return plan or None

    def _note_status(self, p: Proc, st: dict | None, now: float) -> None:
        v = self.nodes.setdefault(p.name, NodeView(p.name, p.role, p.region))
        v.reachable = st is not None
        if st is None:
            return
        v.version, v.fingerprint = st.get("version"), st.get("fingerprint")
        v.bytes_in, v.bytes_out = int(st.get("bytes_in") or 0), int(st.get("bytes_out") or 0)
        parent = st.get("parent")
        v.parent = self._url_to_name.get(str(parent).rstrip("/"), parent) if parent else None
        if v.version is not None and v.fingerprint:
            self._observe(p.name, v.version, v.fingerprint, "node")

    def _note_step(self, row: dict) -> None:
        if row.get("event") == "warm_start":
            self.warm_start = row
            return
        if "version" in row and row.get("fingerprint"):
            self.expected[int(row["version"])] = str(row["fingerprint"])
        if "step" in row:
            self.steps.append(row)

    def _note_event(self, name: str, ev: dict) -> None:
        kind = ev.get("event") or ("switch" if "fingerprint" in ev else "batch" if "batch_s" in ev else "")
        if kind == "switch" or "fingerprint" in ev:
            self.switches.append({"node": name, **ev})
            if ev.get("version") is not None and ev.get("fingerprint"):
                self._observe(name, int(ev["version"]), str(ev["fingerprint"]), "engine")
                self.nodes.get(name, NodeView(name, "rollout", "?")).engine_version = int(ev["version"])
        elif "batch_s" in ev:
            self.batches.append({"node": name, **ev})

    def _check(self) -> None:
        keep = []
        for name, version, fp, source in self.observed:
            want = self.expected.get(version)
            if want is None:
                keep.append((name, version, fp, source))
            elif want != fp:
                self.mismatches.append(Mismatch(name, version, fp, want, source))
            else:
                self.checked += 1
        self.observed = keep

    # ------------------------------------------------------------------ summaries
    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of everything, for the dashboard and the report."""
        with self._lock:
            return {
                "nodes": {k: NodeView(**vars(v)) for k, v in self.nodes.items()},
                "steps": list(self.steps),
                "warm_start": self.warm_start,
                "expected": dict(self.expected),
                "timings": self._timings(),
                "plans": list(self.plans),
                "mismatches": list(self.mismatches),
                "checked": self.checked,
                "unchecked": len(self.observed),
                "switches": list(self.switches),
                "batches": list(self.batches),
            }

    def _timings(self) -> dict[str, Any]:
        """What the nodes' logs say so far (see :func:`demo.timeline.Timeline`), as plain data."""
        tl = self.timeline
        return {
            "deltas": tl.deltas(),
            "delays": {v: tl.delays(v) for v in tl.announced},
            "region_held": {v: r for v in tl.deltas() if (r := tl.region_delays(v, "held"))},
            "region_engine": {v: r for v in tl.deltas() if (r := tl.region_delays(v, "engine"))},
            "parents_used": {n: dict(c) for n, c in tl.parents_used().items()},
            "parent_changes": [vars(c) for c in tl.parent_changes],
            "roles": dict(tl.roles), "regions": dict(tl.regions), "configured": dict(tl.configured),
        }
