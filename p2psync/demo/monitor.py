"""Watch a running :class:`~p2psync.demo.cluster.LocalCluster`: versions, fingerprints, timings, rewards.

Sources:

- every node's ``/v1/status`` polled in parallel threads (version, fingerprint,
  parent): the time a node is first seen at version v is its arrival time,
  good to the poll interval;
- the training job's metrics file (one JSON line per step, with the version it
  published and that version's fingerprint);
- each rollout worker's events file (one JSON line per version switch with the
  engine's own fingerprint, and per generated batch).

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

from p2psync.demo.cluster import LocalCluster, Proc


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
    interval: float = 0.1
    versions_path: Path | None = None
    """The trainer's (version, fingerprint) lines, version 0 included."""
    nodes: dict[str, NodeView] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    expected: dict[int, str] = field(default_factory=dict)
    """Trainer fingerprint per version."""
    arrivals: dict[int, dict[str, float]] = field(default_factory=dict)
    """version -> node -> first time seen holding it."""
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
        now = time.time()
        with self._lock:
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

    def _note_status(self, p: Proc, st: dict | None, now: float) -> None:
        v = self.nodes.setdefault(p.name, NodeView(p.name, p.role, p.region))
        v.reachable = st is not None
        if st is None:
            return
        v.version, v.fingerprint = st.get("version"), st.get("fingerprint")
        v.bytes_in, v.bytes_out = int(st.get("bytes_in") or 0), int(st.get("bytes_out") or 0)
        parent = st.get("parent")
        v.parent = self._url_to_name.get(str(parent).rstrip("/"), parent) if parent else None
        if v.version is not None:
            self.arrivals.setdefault(v.version, {}).setdefault(p.name, now)
            if v.fingerprint:
                self._observe(p.name, v.version, v.fingerprint, "node")

    def _note_step(self, row: dict) -> None:
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
                "expected": dict(self.expected),
                "arrivals": {k: dict(v) for k, v in self.arrivals.items()},
                "mismatches": list(self.mismatches),
                "checked": self.checked,
                "unchecked": len(self.observed),
                "switches": list(self.switches),
                "batches": list(self.batches),
            }

    def region_times(self, version: int) -> dict[str, float]:
        """Seconds from the trainer holding ``version`` to the last node of each region holding it."""
        with self._lock:
            arr = self.arrivals.get(version, {})
            roots = [t for n, t in arr.items() if self.nodes.get(n) and self.nodes[n].role == "trainer"]
            if not roots:
                return {}
            t0 = roots[0]
            out: dict[str, float] = {}
            for n, view in self.nodes.items():
                if view.role == "trainer":
                    continue
                if n not in arr:
                    return {}  # not everywhere yet
                out[view.region] = max(out.get(view.region, 0.0), arr[n] - t0)
            return out
