"""The live dissemination plan: the coordinator re-plans from gossip membership (pure, no I/O).

Contract of :class:`LivePlanner`: :meth:`LivePlanner.update` returns a new
parent map only when the set of planned members (id, role, region) changed, and
then moves as few nodes as it can (:func:`topology.replan.replan`): a member
whose parent is still there keeps it. The map always covers every member given
except the root, and following parents from any member reaches the root.

What the model knows: the live members with their role and region, and the
download bandwidth a member reported (bytes/s), used for its links. Members
that reported nothing get role defaults: relays and the trainer are assumed to
have ten times the uplink of a rollout node, so that dedicated relays, not GPU
machines, become the interior of the tree. Probed pairwise figures
(``topology.model.model_from_measurements``) can replace these once probes run
live.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from topology.model import NetworkModel, NodeSpec
from topology.planner import PlannerConfig, plan
from topology.replan import replan
from topology.tree import Plan

ROLE_UPLINK_BPS = {"trainer": 10e9, "relay": 10e9, "rollout": 1e9}


@dataclass(frozen=True)
class PlanMember:
    """A member as the planner needs it."""

    id: str
    role: str
    region: str
    bandwidth: float = 0.0
    """Reported download bandwidth, bytes/s (0: unknown, use the role default)."""


class LivePlanner:
    """Keeps the current :class:`~topology.tree.Plan` and re-plans on membership changes."""

    def __init__(self, root: str, config: PlannerConfig | None = None) -> None:
        self.root = root
        self.config = config or PlannerConfig()
        self.plan: Plan | None = None
        self._key: frozenset[tuple[str, str, str]] = frozenset()

    @staticmethod
    def model(members: Iterable[PlanMember]) -> NetworkModel:
        specs = []
        for m in members:
            default = ROLE_UPLINK_BPS.get(m.role, 1e9)
            down = m.bandwidth * 8 if m.bandwidth > 0 else default
            specs.append(NodeSpec(m.id, m.region, m.role, uplink_bps=default, downlink_bps=down))
        return NetworkModel(specs)

    def update(self, members: Iterable[PlanMember]) -> Plan | None:
        """A new plan if the planned membership changed (None if not, or if the root is absent)."""
        members = [m for m in members if m.role != "trainer" or m.id == self.root]
        if not any(m.id == self.root for m in members):
            return None
        key = frozenset((m.id, m.role, m.region) for m in members)
        if key == self._key and self.plan is not None:
            return None
        model = self.model(members)
        epoch = 0 if self.plan is None else self.plan.epoch + 1
        new = plan(model, self.config, epoch) if self.plan is None else replan(self.plan, model, self.config)
        self.plan, self._key = new, key
        return new
