"""The live plan on gossip, sans-IO: what the coordinator plans from and publishes, and the parent a
node follows. :class:`~p2psync.control.gossip_service.GossipService` runs these on the node;
``tools/gossip_scale.py`` runs the same functions on simulated nodes.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from p2psync.gossip import GossipNode
from p2psync.gossip.items import CoordEntry

if TYPE_CHECKING:
    from p2psync.control.live_plan import LivePlanner, PlanMember
    from topology.tree import Plan

Signature = tuple[int, int, int, frozenset[str]]


def plan_members(g: GossipNode, revoked: Collection[str] = ()) -> list[PlanMember]:
    """The members the coordinator plans for: alive (not suspect) and not revoked, with the download
    bandwidth each last reported."""
    return [m for m in (plan_member(g, mid, revoked) for mid in g.members.entries) if m is not None]


def plan_member(g: GossipNode, member_id: str, revoked: Collection[str] = ()) -> PlanMember | None:
    """``member_id`` as :func:`plan_members` lists it, or None if it is not planned for."""
    from p2psync.control.live_plan import PlanMember

    e = g.members.get(member_id)
    if e is None or e.status != "alive" or e.id in revoked:
        return None
    rep = g.report_of(e.id)
    return PlanMember(e.id, e.role, e.region, rep.bandwidth if rep else 0.0)


class PlanStep:
    """The coordinator's plan step after a gossip change: the members to plan for, then
    :meth:`LivePlanner.update <p2psync.control.live_plan.LivePlanner.update>`.

    Most rounds change nothing the step reads. So it first compares a signature of its inputs (the
    member table's change count, the count of reports whose bandwidth changed, the revoked set) with
    the one of the last step that ran; when they are equal and the planner is :meth:`settled
    <p2psync.control.live_plan.LivePlanner.settled>` (a plan exists, no probe figures wait, the
    periodic full plan is not due), ``update`` would return None again, and the step is skipped.
    :attr:`skipped` counts those. When it runs, the members are kept from the last step and only those
    the gossip node names as changed (:meth:`~p2psync.gossip.protocol.GossipNode.track_changes`) are
    read again: under churn a change comes every round, and walking 10,000 members each time cost
    ~20 ms of the coordinator's round.
    """

    def __init__(self, planner: LivePlanner) -> None:
        self.planner = planner
        self.skipped = 0
        self._last: Signature | None = None
        self._g: GossipNode | None = None
        self._revoked: frozenset[str] = frozenset()
        self._changed: set[str] = set()
        self._members: dict[str, PlanMember] = {}
        self._delta: dict[str, PlanMember | None] | None = None

    def inputs(self, g: GossipNode, revoked: Collection[str], now: float | None
               ) -> tuple[Signature, list[PlanMember]] | None:
        """(signature, members to plan for), or None when the step can be skipped (see the class)."""
        rev = frozenset(revoked)
        sig: Signature = (id(g), g.members.changes, g.report_changes, rev)
        if sig == self._last and self.planner.settled(now):
            self.skipped += 1
            return None
        if g is not self._g or rev != self._revoked:
            self._changed = g.track_changes()
            self._changed.clear()
            self._members = {m.id: m for m in plan_members(g, rev)}
            self._g, self._revoked = g, rev
            self._delta = None
        else:
            for mid in self._changed:
                m = plan_member(g, mid, rev)
                if m is None:
                    self._members.pop(mid, None)
                else:
                    self._members[mid] = m
                if self._delta is not None:
                    self._delta[mid] = m
            self._changed.clear()
        return sig, list(self._members.values())

    @property
    def changed(self) -> dict[str, PlanMember | None] | None:
        """The members changed since the last :meth:`ran` (None: all of them), for ``update``'s
        ``changed`` (it then skips passes over every member)."""
        return self._delta

    def ran(self, sig: Signature) -> None:
        """Record that ``planner.update`` ran on the members of ``sig`` (and :attr:`changed`)."""
        self._last = sig
        self._delta = {}

    def run(self, g: GossipNode, revoked: Collection[str], now: float | None) -> Plan | None:
        """The whole step in one call: a new plan to publish, or None."""
        got = self.inputs(g, revoked, now)
        if got is None:
            return None
        new = self.planner.update(got[1], now, self._delta)
        self.ran(got[0])
        return new


def publish(g: GossipNode, new: Plan, now: float) -> list[CoordEntry]:
    """Gossip ``new``: the plan shards whose parents changed (coordinator only)."""
    return g.publish_plan(new.epoch, new.root, new.parents, now)  # read only: no copy


def planned_parent(g: GossipNode, node: str) -> tuple[int, str | None, str | None] | None:
    """(version of the plan shard, parent's address, parent's id) that ``node`` should follow, or
    None while its shard has not arrived or its planned parent is not known alive here (keep the
    current parent until gossip catches up). No parent in the plan: address and id are None."""
    e = g.coord.plan_entry_of(node)
    if e is None:
        return None
    parent_id = e.value["parents"].get(node)
    if parent_id is None:
        return e.version, None, None
    m = g.members.get(parent_id)
    if m is None or not m.live:
        return None
    return e.version, m.address, parent_id
