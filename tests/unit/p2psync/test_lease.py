"""Lease table: expiry re-queues with tokens, duplicates are dropped, release_all on
preemption, exactly-once completion under randomized preemption. Fake clock."""

from __future__ import annotations

import pytest

from p2psync.errors import LeaseExpired
from p2psync.lease import LeaseTable, ProgressGap, UnknownWork, WorkItem
from p2psync.schedule import FifoScheduler, Scheduler, Workload, default_cluster, simulate


def _table(n: int = 3, ttl: float = 30.0) -> LeaseTable:
    t = LeaseTable(ttl)
    for i in range(n):
        t.submit(WorkItem(f"w{i}", prompt_key=f"p{i}", responses=2))
    return t


def test_expired_lease_requeues_work_with_its_tokens():
    t = _table()
    lease = t.grant(0.0, "a", "w0")
    t.progress(5.0, "a", "w0", lease.lease_id, 0, 0, [1, 2, 3, 4])
    t.progress(10.0, "a", "w0", lease.lease_id, 1, 0, [9, 9], finished=True)
    assert t.expire(39.0) == []  # progress renewed the lease until 40
    assert t.expire(40.0) == ["w0"]
    assert t.queued()[0].work_id == "w0" and t.queued()[0].tokens_done == 6
    with pytest.raises(LeaseExpired):
        t.renew(41.0, "a", "w0", lease.lease_id)
    with pytest.raises(LeaseExpired):
        t.progress(41.0, "a", "w0", lease.lease_id, 0, 4, [5])
    again = t.grant(41.0, "b", "w0")
    assert again.resume == {0: (1, 2, 3, 4)} and again.done == frozenset({1})
    assert again.lease_id > lease.lease_id
    t.progress(42.0, "b", "w0", again.lease_id, 0, 4, [5, 6], finished=True)
    assert t.tokens("w0")[0] == (1, 2, 3, 4, 5, 6)
    assert t.complete(43.0, "b", "w0", again.lease_id, "result").accepted


def test_late_duplicate_is_dropped_and_reported():
    t = _table()
    first = t.grant(0.0, "a", "w1")
    t.expire(31.0)
    second = t.grant(31.0, "b", "w1")
    assert t.complete(40.0, "b", "w1", second.lease_id, "from b").accepted
    dup = t.complete(45.0, "a", "w1", first.lease_id, "from a")
    assert not dup.accepted and t.duplicates == [dup]
    assert t.result("w1") == "from b" and t.counts()["completed"] == 1


def test_late_result_first_wins_and_revokes_the_current_lease():
    t = _table()
    first = t.grant(0.0, "a", "w2")
    t.expire(31.0)
    second = t.grant(31.0, "b", "w2")
    c = t.complete(35.0, "a", "w2", first.lease_id, "from a")
    assert c.accepted and "late" in c.reason
    with pytest.raises(LeaseExpired):
        t.renew(36.0, "b", "w2", second.lease_id)
    assert not t.complete(50.0, "b", "w2", second.lease_id).accepted
    assert t.counts() == {"queued": 2, "leased": 0, "completed": 1, "duplicates": 1}


def test_release_all_on_preemption_notice():
    t = _table(4)
    leases = [t.grant(0.0, "a") for _ in range(3)]
    t.progress(1.0, "a", leases[0].work_id, leases[0].lease_id, 0, 0, [7, 7, 7])
    assert t.holders() == {"a": [(lz.work_id, 30.0 + (1.0 if lz is leases[0] else 0.0)) for lz in leases]}
    released = t.release_all(2.0, "a")
    assert released == sorted(lz.work_id for lz in leases)
    assert {q.work_id for q in t.queued()[:3]} == set(released) and len(t.queued()) == 4  # at the front
    assert t.leases_of("a") == [] and t.holders() == {"a": []}
    assert t.grant(3.0, "b", leases[0].work_id).resume == {0: (7, 7, 7)}


def test_migration_carries_logprobs_versions_and_finished_responses():
    t = _table()
    a = t.grant(0.0, "a", "w0")
    t.progress(1.0, "a", "w0", a.lease_id, 0, 0, [1, 2, 3], logprobs=[-0.1, -0.2, -0.3], versions=[4, 4, 5])
    t.progress(2.0, "a", "w0", a.lease_id, 0, 2, [9, 4], logprobs=[-0.9, -0.4], versions=[5, 5])  # a retry
    t.progress(3.0, "a", "w0", a.lease_id, 1, 0, [7], logprobs=[-0.7], versions=[5], finish_reason="stop")
    with pytest.raises(ValueError):
        t.progress(3.0, "a", "w0", a.lease_id, 0, 4, [5, 6], logprobs=[-0.5], versions=[5, 5])
    assert t.history("w0")[0] == ((1, 2, 9, 4), (-0.1, -0.2, -0.9, -0.4), (4, 4, 5, 5))  # nothing half-applied
    t.release(4.0, "a", "w0", a.lease_id)
    b = t.grant(5.0, "b", "w0")
    assert b.resume == {0: (1, 2, 9, 4)} and b.done == frozenset({1})
    assert b.resume_logprobs == {0: (-0.1, -0.2, -0.9, -0.4)} and b.resume_versions == {0: (4, 4, 5, 5)}
    assert b.finish == {1: "stop"} and t.history("w0")[1] == ((7,), (-0.7,), (5,))
    # A range reported without the extra columns cuts them there: they stay a gap-free prefix.
    t.progress(6.0, "b", "w0", b.lease_id, 0, 4, [5, 6])
    assert t.history("w0")[0] == ((1, 2, 9, 4, 5, 6), (-0.1, -0.2, -0.9, -0.4), (4, 4, 5, 5))
    with pytest.raises(LeaseExpired):
        t.release(7.0, "a", "w0", a.lease_id)
    assert t.holders_of("w0") == ["a", "b"] and t.pending() == 3


def test_bad_calls_raise_typed_errors():
    t = _table()
    lease = t.grant(0.0, "a", "w0")
    with pytest.raises(UnknownWork):
        t.grant(0.0, "a", "nope")
    with pytest.raises(UnknownWork):
        t.grant(0.0, "b", "w0")  # not queued: leased already
    with pytest.raises(ProgressGap):
        t.progress(1.0, "a", "w0", lease.lease_id, 0, 5, [1])
    with pytest.raises(LeaseExpired):
        t.renew(1.0, "b", "w0", lease.lease_id)
    with pytest.raises(LeaseExpired):
        t.complete(1.0, "b", "w0", lease.lease_id)
    t.submit(WorkItem("w0"))  # idempotent: the leased item is not queued twice
    assert [q.work_id for q in t.queued()] == ["w1", "w2"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", [Scheduler, FifoScheduler])
def test_exactly_once_with_30_percent_preempted(seed, policy):
    work = Workload(steps=6)
    r = simulate(policy(), default_cluster(seed), work, seed=seed, preempt_share=0.3, stall_share=0.15)
    assert r.preemptions == round(0.3 * 16)
    assert r.submitted == 6 * work.batch
    assert r.completed == r.submitted and r.lost == 0  # nothing lost, each counted once
    assert r.requeued > 0 and r.carried_tokens > 0  # work moved, with its tokens
