"""The pure parts of the chaos soak (tools/soak): its fault schedule and its ledger of checks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from soak.ledger import Ledger  # noqa: E402
from soak.schedule import NETWORK_KINDS, PROCESS_KINDS, Cast, Schedule  # noqa: E402


def _cast() -> Cast:
    return Cast(relays=["a-0", "b-0", "c-0"], rollouts=["a-1", "b-1", "c-1"], disk_relay="c-0", revoke="b-1",
                late="c-1", regions=["a", "b", "c"])


def test_schedule_repeats_with_its_seed_and_meets_every_kind_early():
    def run(seed: int) -> list[list[dict]]:
        s = Schedule(_cast(), seed)
        return [[f.to_json() for f in s.next(i / 20)] for i in range(20)]

    a = run(5)
    assert a == run(5) and a != run(6)
    kinds = [f["kind"] for ep in a for f in ep]
    assert kinds.count("revoke") == 1 and kinds.count("late_join") == 1
    first = [f["kind"] for ep in a[:12] for f in ep]
    assert set(PROCESS_KINDS) <= set(first) and set(NETWORK_KINDS) <= set(first)
    for ep in a:
        assert len([f for f in ep if f["kind"] in PROCESS_KINDS]) <= 1
        assert len([f for f in ep if f["kind"] in NETWORK_KINDS]) <= 1
        if any(f["kind"] in ("revoke", "late_join") for f in ep):
            assert len(ep) == 1  # alone in its episode
        for f in ep:
            if f["kind"] == "kill":
                assert f["target"] not in ("b-1", "c-1")  # never the revoked node or the late joiner
            if f["kind"] in NETWORK_KINDS:
                x, y = f["target"].split("|")
                assert x != y and {x, y} <= {"a", "b", "c"}


def _st(version, fp, **kw) -> dict:
    return {"version": version, "fingerprint": fp, "loaded": True, "versions": [], **kw}


def test_ledger_counts_wrong_bits_revoked_data_double_leases_and_lost_versions():
    led = Ledger()
    for v in range(4):
        led.publishing(v, f"fp{v}")
        led.published(v)
    led.observe({"trainer": _st(3, "fp3"), "n1": _st(2, "fp2"), "n2": _st(2, "bad"), "n3": {"error": "down"}})
    assert led.wrong == {("n2", 2, "bad")}
    assert not led.converged({"trainer": _st(3, "fp3"), "n1": _st(2, "fp2")}, {"trainer", "n1"}, 3)
    assert led.converged({"trainer": _st(3, "fp3"), "n1": _st(3, "fp3")}, {"trainer", "n1"}, 3)
    assert not led.converged({"n1": {"error": "x"}}, {"n1"}, 0)
    # A revoked node holding (or fetching) anything newer than the versions before its revocation.
    led.revoked, led.revoked_upto = "n1", 3
    led.observe({"n1": _st(3, "fp3", versions=[{"target": 3}])})
    assert not led.revoked_seen
    led.publishing(4, "fp4")
    led.published(4)
    led.observe({"n1": _st(3, "fp3", versions=[{"target": 4, "complete": False}])})
    assert led.revoked_seen == {4}
    # One work id under two holders in one snapshot of the lease table.
    led.observe({}, {"holders": {"n1": ["w1"], "n2": ["w2"]}})
    led.observe({}, {"holders": {"n1": ["w2"], "n2": ["w3"]}})  # moved between snapshots: fine
    assert not led.double_held
    led.observe({}, {"holders": {"n1": ["w4"], "n2": ["w4", "w5"]}})
    assert led.double_held == {"w4"} and led.lease_snapshots == 3
    # The trainer held 4 before its kill and 2 when it answered again: two versions lost.
    led.observe({"trainer": _st(4, "fp4")})
    led.trainer_killed()
    led.observe({"trainer": {**_st(None, None), "loaded": False}})
    led.observe({"trainer": _st(2, "fp2")})
    assert led.lost == {0: 2}
    assert led.versions_lost(4) == 2 and led.versions_lost(3) == 3
    # A failed publish leaves no truth behind.
    led.publishing(5, "fp5")
    led.withdrawn(5)
    assert 5 not in led.truth and led.latest == 4


def test_ledger_sums_bad_chunks_across_a_nodes_restarts():
    led = Ledger()
    for n in (1, 3, 0, 2):  # 3 counted, the node restarted, 2 more
        led.observe({"r": {"version": None, "bad_chunks": n}})
    assert led.bad_chunks_total() == 5
