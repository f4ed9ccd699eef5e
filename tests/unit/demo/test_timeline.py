"""Dissemination times come from the nodes' own log timestamps; parents used, and why they differ from the plan."""

from __future__ import annotations

import pytest

from demo.summary import summarize, tree
from demo.timeline import Timeline

ROLES = {"trainer": "trainer", "relay": "relay", "a1": "rollout", "a2": "rollout"}
REGIONS = {"trainer": "r0", "relay": "r1", "a1": "r1", "a2": "r1"}


def _tl() -> Timeline:
    return Timeline(dict(ROLES), dict(REGIONS), {"http://h:1": "trainer", "http://h:2": "relay"},
                    configured={"relay": "trainer", "a1": "relay", "a2": "relay"})


def _feed(tl: Timeline, node: str, t: float, msg: str) -> None:
    tl.feed(node, {"t": t, "level": "INFO", "msg": f"[{node}@{REGIONS[node]}] {msg}", "node": node})


def test_delays_are_differences_of_node_timestamps() -> None:
    tl = _tl()
    aid = "delta-4-5-00112233aabbccdd"
    _feed(tl, "trainer", 100.0, f"published {aid}")
    _feed(tl, "relay", 100.25, f"holds {aid}: 1 chunks (1 held or pushed) 0.010 s after its manifest")
    _feed(tl, "relay", 100.5, f"applied {aid} (1000 bytes) -> version 5 fingerprint " + "ab" * 16)
    _feed(tl, "a1", 100.75, f"holds {aid}: 1 chunks (0 held or pushed) 0.010 s after its manifest")
    _feed(tl, "a1", 101.0, "engine serving version 5 (node-decoded; generation paused 0.001 s)")
    # a2 has not got it yet: region r1 is not complete, so it has no region time
    assert tl.region_delays(5) == {}
    assert tl.delays(5) == {"relay": {"held": 0.25, "applied": 0.5}, "a1": {"held": 0.75, "engine": 1.0}}
    _feed(tl, "a2", 101.5, f"holds {aid}: 1 chunks (1 held or pushed) 0.500 s after its manifest")
    assert tl.region_delays(5) == {"r1": 1.5}
    assert tl.region_delays(5, "engine") == {}  # a2's engine has not served it yet
    assert tl.deltas() == [5]
    assert tl.fingerprints == [("relay", 5, "ab" * 16)]


def test_a_version_the_trainer_did_not_announce_has_no_times() -> None:
    tl = _tl()
    _feed(tl, "a1", 5.0, "holds delta-0-1-00112233aabbccdd: 1 chunks (0 held or pushed) 0.0 s after its manifest")
    assert tl.delays(1) == {} and tl.region_delays(1) == {}
    # Lines that are not the node's own records (no time, no prefix) are ignored.
    tl.feed("a1", {"msg": "[a1@r1] holds delta-0-1-00112233aabbccdd: 1 chunks"})
    tl.feed("a1", {"t": 1.0, "msg": "published delta-0-1-00112233aabbccdd"})
    assert tl.announced == {}


def _snap(tl: Timeline, plan: dict[str, str]) -> dict:
    deltas = tl.deltas()
    return {"steps": [], "expected": {}, "checked": 0, "mismatches": [], "plans": [(0.0, plan)],
            "timings": {"deltas": deltas, "delays": {v: tl.delays(v) for v in tl.announced},
                        "region_held": {v: tl.region_delays(v) for v in deltas},
                        "region_engine": {v: tl.region_delays(v, "engine") for v in deltas},
                        "parents_used": {n: dict(c) for n, c in tl.parents_used().items()},
                        "parent_changes": [vars(c) for c in tl.parent_changes],
                        "roles": dict(tl.roles), "regions": dict(tl.regions), "configured": dict(tl.configured)}}


def test_a_node_that_left_its_planned_parent_is_marked_with_the_reason() -> None:
    tl = _tl()
    plan = {"relay": "trainer", "a1": "relay", "a2": "relay"}
    for v in (1, 2, 3):
        aid = f"delta-{v - 1}-{v}-00112233aabbccd{v}"
        _feed(tl, "trainer", 10.0 * v, f"published {aid}")
        if v == 2:
            _feed(tl, "a2", 10.0 * v, "parent http://h:2 failed: peer http://h:2 unreachable: stream closed")
            _feed(tl, "a2", 10.0 * v, "parent is now http://h:1")
        for n, d in (("relay", 0.1), ("a1", 0.2), ("a2", 0.3)):
            _feed(tl, n, 10.0 * v + d, f"holds {aid}: 1 chunks (0 held or pushed) 0.0 s after its manifest")
    t = tree(_snap(tl, plan))
    assert t["nodes"]["a1"] == {"planned": "relay", "used": "relay", "used_counts": {"relay": 3}, "differs": False,
                                "reason": None}
    a2 = t["nodes"]["a2"]
    assert a2["used_counts"] == {"relay": 1, "trainer": 2} and a2["differs"]
    assert a2["reason"] == "failover: relay failed (peer http://h:2 unreachable: stream closed)"
    assert t["entries_planned"] == {"r1": ["relay"]}
    assert t["entries_used"] == {"r1": ["a2", "relay"]}  # a2 entered its region from the trainer


def test_summary_keeps_the_keys_other_programs_read() -> None:
    tl = _tl()
    aid = "delta-0-1-00112233aabbccdd"
    _feed(tl, "trainer", 0.0, f"published {aid}")
    for n, d in (("relay", 0.1), ("a1", 0.2), ("a2", 0.4)):
        _feed(tl, n, d, f"holds {aid}: 1 chunks (0 held or pushed) 0.0 s after its manifest")
    snap = _snap(tl, {"relay": "trainer", "a1": "relay", "a2": "relay"})
    snap["steps"] = [{"step": i, "reward_mean": r, "changed_fraction": c, "payload_bytes": 100, "full_bytes": 10_000}
                     for i, (r, c) in enumerate([(0.1, 0.01), (0.2, 0.03), (0.3, 0.02)], 1)]
    s = summarize(snap, problems=[], wall_s=12.0, regime={})
    assert s["ok"] is True
    assert s["payload_bytes_total"] == 300 and s["full_bytes_total"] == 30_000
    assert (s["reward_first"], s["reward_last"]) == (pytest.approx(0.1), pytest.approx(0.3))
    assert s["changed_fraction_median"] == 0.02
    assert s["median_region_s"] == {"r1": pytest.approx(0.4)}
    bad = summarize(snap, problems=["1 fingerprint mismatches"], wall_s=12.0, regime={})
    assert bad["ok"] is False and bad["verdict"] == "FAILED: 1 fingerprint mismatches"


def test_the_dashboard_shows_the_reports_headline() -> None:
    from rich.console import Console

    from demo import dashboard
    from demo.monitor import NodeView
    from demo.summary import headline

    tl = _tl()
    aid = "delta-0-1-00112233aabbccdd"
    _feed(tl, "trainer", 0.0, f"published {aid}")
    for n, d in (("relay", 0.1), ("a1", 0.2), ("a2", 0.4)):
        _feed(tl, n, d, f"holds {aid}: 1 chunks (0 held or pushed) 0.0 s after its manifest")
    snap = _snap(tl, {"relay": "trainer", "a1": "relay", "a2": "relay"})
    snap["steps"] = [{"step": 1, "reward_mean": 0.25, "changed_fraction": 0.02, "payload_bytes": 400_000,
                      "full_bytes": 38_000_000}]
    snap["nodes"] = {n: NodeView(n, r, REGIONS[n], 1, "ab" * 16, None, True) for n, r in ROLES.items()}
    s = summarize(snap, problems=[], wall_s=65.0, regime={})
    con = Console(record=True, width=200)
    con.print(dashboard.render(snap, s, 60, "nodes"))
    text = con.export_text()
    for label, value in headline(s, 60, running=True):
        assert label in text and value in text
    assert "1 of 60 GRPO steps" in text and "95x smaller" in text and "region r1" in text
