"""The live plan on gossip, sans-IO: what the coordinator plans from and publishes, and the parent a
node follows. :class:`~p2psync.control.gossip_service.GossipService` runs these on the node;
``tools/gossip_scale.py`` runs the same functions on simulated nodes.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from p2psync.gossip import GossipNode
from p2psync.gossip.messages import CoordEntry

if TYPE_CHECKING:
    from p2psync.control.live_plan import PlanMember
    from topology.tree import Plan


def plan_members(g: GossipNode, revoked: Collection[str] = ()) -> list[PlanMember]:
    """The members the coordinator plans for: alive (not suspect) and not revoked, with the download
    bandwidth each last reported."""
    from p2psync.control.live_plan import PlanMember

    out = []
    for e in g.members.entries.values():
        if e.status != "alive" or e.id in revoked:
            continue
        rep = g.report_of(e.id)
        out.append(PlanMember(e.id, e.role, e.region, rep.bandwidth if rep else 0.0))
    return out


def publish(g: GossipNode, new: Plan, now: float) -> list[CoordEntry]:
    """Gossip ``new``: the plan shards whose parents changed (coordinator only)."""
    return g.publish_plan(new.epoch, new.root, dict(new.parents), now)


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
