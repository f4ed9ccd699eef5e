"""The demo's verdict: a fingerprint that differs from the trainer's for the same version is caught."""

from __future__ import annotations

import json
from pathlib import Path

from demo.monitor import Monitor


class _NoCluster:
    procs: list = []

    def status(self, proc, timeout=1.0):  # pragma: no cover - no processes
        return None


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_engine_fingerprint_that_differs_from_the_trainers_is_a_mismatch(tmp_path: Path) -> None:
    versions, metrics, events = tmp_path / "v.jsonl", tmp_path / "m.jsonl", tmp_path / "e.jsonl"
    mon = Monitor(_NoCluster(), metrics, {"n1": events}, versions_path=versions)
    # The engine reports before the trainer's line is read: held back, then checked.
    _write(events, [{"event": "switch", "version": 1, "fingerprint": "aa" * 16}])
    mon.poll()
    assert mon.snapshot()["unchecked"] == 1 and not mon.mismatches
    _write(versions, [{"version": 0, "fingerprint": "00" * 16}, {"version": 1, "fingerprint": "aa" * 16},
                      {"version": 2, "fingerprint": "bb" * 16}])
    _write(events, [{"event": "switch", "version": 2, "fingerprint": "cc" * 16},
                    {"event": "batch", "batch_s": 0.5, "tokens": 10}])
    # A partial line (the writer has not finished it) is not read yet.
    with open(events, "a") as f:
        f.write('{"event": "switch", "version": 0, "finger')
    mon.poll()
    snap = mon.snapshot()
    assert snap["checked"] == 1
    assert [(m.node, m.version, m.source) for m in snap["mismatches"]] == [("n1", 2, "engine")]
    assert len(snap["batches"]) == 1
    with open(events, "a") as f:
        f.write('print": "' + "00" * 16 + '"}\n')
    mon.poll()
    assert mon.snapshot()["checked"] == 2 and len(mon.snapshot()["mismatches"]) == 1


def test_a_mismatch_is_kept_even_if_the_node_later_agrees(tmp_path: Path) -> None:
    versions, events = tmp_path / "v.jsonl", tmp_path / "e.jsonl"
    mon = Monitor(_NoCluster(), tmp_path / "m.jsonl", {"n1": events}, versions_path=versions)
    _write(versions, [{"version": 3, "fingerprint": "ab" * 16}])
    _write(events, [{"event": "switch", "version": 3, "fingerprint": "ff" * 16}])
    mon.poll()
    _write(events, [{"event": "switch", "version": 3, "fingerprint": "ab" * 16}])
    mon.poll()
    snap = mon.snapshot()
    assert len(snap["mismatches"]) == 1 and snap["checked"] == 1


def test_a_node_log_that_applied_other_bits_is_a_mismatch(tmp_path: Path) -> None:
    from types import SimpleNamespace

    log = tmp_path / "n1.log"
    node = SimpleNamespace(name="n1", role="rollout", region="r1", url="http://h:2", log=log, parents=[])
    trainer = SimpleNamespace(name="trainer", role="trainer", region="r0", url="http://h:1",
                              log=tmp_path / "trainer.log", parents=[])

    class _Cluster(_NoCluster):
        procs = [trainer, node]

    versions = tmp_path / "v.jsonl"
    mon = Monitor(_Cluster(), tmp_path / "m.jsonl", {}, versions_path=versions)
    _write(versions, [{"version": 1, "fingerprint": "aa" * 16}, {"version": 2, "fingerprint": "bb" * 16}])
    _write(log, [{"t": 1.0, "msg": "[n1@r1] applied delta-0-1-aaaaaaaaaaaaaaaa (10 bytes) -> version 1 "
                                   "fingerprint " + "aa" * 16},
                 {"t": 2.0, "msg": "[n1@r1] applied delta-1-2-bbbbbbbbbbbbbbbb (10 bytes) -> version 2 "
                                   "fingerprint " + "cc" * 16}])
    mon.poll()
    snap = mon.snapshot()
    assert snap["checked"] == 1
    assert [(m.node, m.version, m.source) for m in snap["mismatches"]] == [("n1", 2, "node")]
