"""The live plan: re-planning from membership moves few nodes, relays become the interior; a node's
candidate parents follow the plan while keeping its failure records."""

from __future__ import annotations

from p2psync.control.live_plan import LivePlanner, PlanMember
from p2psync.transport.parents import ParentSet
from topology.fallbacks import moved_nodes


def _members(n_rollout: int, relays: int = 2, regions: int = 1) -> list[PlanMember]:
    out = [PlanMember("trainer", "trainer", "r0")]
    out += [PlanMember(f"relay-{i}", "relay", f"r{i % regions}") for i in range(relays)]
    out += [PlanMember(f"x{i:02d}", "rollout", f"r{i % regions}") for i in range(n_rollout)]
    return out


def _reaches_root(parents: dict[str, str], root: str) -> bool:
    for n in parents:
        seen = set()
        while n != root:
            if n in seen or n not in parents:
                return False
            seen.add(n)
            n = parents[n]
    return True


def test_plan_covers_members_and_replans_only_on_membership_change():
    lp = LivePlanner("trainer")
    members = _members(12, relays=2, regions=2)
    p0 = lp.update(members)
    assert set(p0.parents) == {m.id for m in members} - {"trainer"} and _reaches_root(p0.parents, "trainer")
    # Relays (10x the uplink of rollout nodes by default) carry rollout nodes.
    assert all(p0.children().get(f"relay-{i}") for i in range(2))
    assert lp.update(list(reversed(members))) is None  # same membership: no new plan
    assert lp.update([m for m in members if m.id != "x03"]).epoch == 1


def test_a_dead_relay_moves_only_its_children():
    lp = LivePlanner("trainer")
    members = _members(16, relays=3)
    p0 = lp.update(members)
    gone = max(p0.children().items(), key=lambda kv: len(kv[1]) if kv[0].startswith("relay") else -1)[0]
    orphans = set(p0.children()[gone])
    p1 = lp.update([m for m in members if m.id != gone])
    assert gone not in p1.parents and gone not in p1.parents.values() and _reaches_root(p1.parents, "trainer")
    assert set(moved_nodes(p0, p1)) <= orphans  # nobody else was moved


def test_without_the_root_there_is_no_plan():
    assert LivePlanner("trainer").update(_members(3)[1:]) is None


def test_parent_set_follows_the_plan_and_keeps_failure_records():
    ps = ParentSet(["http://a:1", "http://t:1"], retry_after=1.0, avoid_seconds=60.0, jitter=0.0)
    ps.corrupt("http://r:1", 0.0)
    assert ps.plan("http://r:1/") and ps.candidates == ["http://r:1", "http://a:1", "http://t:1"]
    assert ps.current(1.0) == "http://a:1"  # the planned parent served corrupt data: still avoided
    assert not ps.plan("http://r:1")  # unchanged
    ps.failed("http://a:1", 1.0)
    assert ps.plan("http://t:1") and ps.candidates == ["http://t:1", "http://a:1"]
    assert ps.current(1.5) == "http://t:1"
    assert ps.plan(None) and ps.candidates == ["http://a:1", "http://t:1"]
    assert ps.current(1.5) == "http://t:1"  # a still rests after its failure
