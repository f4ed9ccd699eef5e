"""The coordinator's plan step (``plan_gossip.PlanStep``) skips the walk over every member when
nothing the plan reads changed, and runs it again on every change that matters: a failure, a
reported bandwidth, a revocation, the periodic full plan."""

from __future__ import annotations

from p2psync.control import plan_gossip
from p2psync.control.live_plan import LivePlanner
from p2psync.gossip.sim import Sim, default_member


class _Counting(LivePlanner):
    """The real planner, counting how often the step called ``update``."""

    calls = 0

    def update(self, members, now=None, changed=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().update(members, now, changed)


def _setup(n: int = 30):
    sim = Sim.cluster(n, seed=11)
    trainer = sim.nodes[default_member(0).address]
    planner = _Counting(trainer.id, full_every_s=600.0)
    step = plan_gossip.PlanStep(planner)
    assert step.run(trainer, (), sim.now) is not None  # the first plan
    return sim, trainer, planner, step


def test_quiet_rounds_skip_the_planner_and_a_failure_replans():
    sim, trainer, planner, step = _setup()
    sim.run_until(sim.now + 3.0)
    step.run(trainer, (), sim.now)  # the reports of the first rounds
    calls = planner.calls
    for _ in range(10):
        sim.run_until(sim.now + 1.0)
        assert step.run(trainer, (), sim.now) is None
    assert planner.calls == calls and step.skipped >= 10

    victim = default_member(7)
    sim.crash(victim.address)
    for _ in range(60):
        sim.run_until(sim.now + 1.0)
        step.run(trainer, (), sim.now)
        if trainer.members.get(victim.id).status != "alive":
            break
    step.run(trainer, (), sim.now)
    assert planner.calls > calls
    assert planner.plan is not None and victim.id not in planner.plan.parents
    assert victim.id not in planner.plan.parents.values()


def test_a_reported_bandwidth_a_revocation_and_the_periodic_plan_each_run_the_step():
    sim, trainer, planner, step = _setup()
    node = sim.nodes[default_member(9).address]
    sim.run_until(sim.now + 3.0)
    step.run(trainer, (), sim.now)
    calls = planner.calls

    # A rise far past the modeled downlink: the plan is checked against it.
    node.update_self(sim.now, bandwidth=5e10)
    sim.run_until(sim.now + 2.0)
    step.run(trainer, (), sim.now)
    assert planner.calls == calls + 1
    assert planner.model_used is not None and planner.model_used.node(node.id).downlink_bps >= 5e10 * 8
    assert step.run(trainer, (), sim.now) is None and planner.calls == calls + 1  # and skipped again

    new = step.run(trainer, {node.id}, sim.now)  # revoked
    assert planner.calls == calls + 2
    assert new is not None and node.id not in new.parents

    step.run(trainer, {node.id}, sim.now + 601.0)  # the periodic full plan is due
    assert planner.calls == calls + 3
    assert step.run(trainer, {node.id}, sim.now + 602.0) is None and planner.calls == calls + 3


def test_the_members_kept_between_steps_are_those_a_full_walk_finds_through_churn():
    """The step reads only the members gossip names as changed; after joins, leaves, a crash, a
    tombstone dropped and a new bandwidth report it must plan for exactly the members a walk over
    the whole table finds (else a joiner is never placed, or a dead node stays a parent)."""
    from dataclasses import replace

    sim, trainer, planner, step = _setup(40)
    trainer.members.config = replace(trainer.members.config, tombstone_ttl=20.0)
    seen: list[list[str]] = []

    def check() -> None:
        got = step.inputs(trainer, (), sim.now)
        if got is not None:
            planner.update(got[1], sim.now)
            step.ran(got[0])
            assert sorted(got[1], key=lambda m: m.id) == sorted(plan_gossip.plan_members(trainer), key=lambda m: m.id)
            seen.append(sorted(m.id for m in got[1]))

    for i in range(3):
        sim.join(default_member(100 + i), seeds=(trainer.members.me.address,))
    sim.leave(default_member(5).address)
    sim.crash(default_member(7).address)
    for _ in range(60):
        sim.run_until(sim.now + 1.0)
        check()
    sim.nodes[default_member(9).address].update_self(sim.now, bandwidth=5e9)
    for _ in range(15):
        sim.run_until(sim.now + 1.0)
        check()
    assert seen and default_member(100).id in seen[-1] and default_member(7).id not in seen[-1]
    assert default_member(5).id not in seen[-1]
