"""The live dissemination plan: the coordinator re-plans from gossip membership and measured figures (pure, no I/O).

Contract of :class:`LivePlanner`: :meth:`LivePlanner.update` returns a new
parent map when the set of planned members (id, role, region) changed, or when
the figures the plan was made with moved enough that a repaired tree is
estimated clearly faster (see below); otherwise None. Either way it moves as
few nodes as it can (:func:`topology.replan.replan`). The map always covers
every member given except the root, and following parents from any member
reaches the root.

What the model knows, per member, best source first:

1. **Reported bandwidth**: the download bandwidth (bytes/s) the member reports
   through gossip (``Node.update_self(bandwidth=...)``, or the rate its
   gossip service samples from the bytes it receives), which reaches the
   coordinator in the member's ``Report`` (``GossipNode.report_of``). It is
   what the node actually gets, so it sets the member's downlink. It does not
   touch the uplink: a sampled receive rate says little about what the node
   can send (an idle node reports little), and a weak downlink alone already
   keeps a node out of the interior (its children could not get more than it).
2. **Probe figures** (:meth:`use_measurements`, e.g. the file
   ``p2psync plan --probe --save-measurements`` writes, named by the node
   config's ``probe.measurements``): the member's uplink and downlink from
   the probe, every measured pair between live members, and the region-level
   figures that estimate the unmeasured pairs.
3. **Role defaults**: relays and the trainer are assumed to have ten times
   the uplink of a rollout node, so that dedicated relays, not GPU machines,
   become the interior of the tree.

Membership changes take the incremental path (:class:`topology.incremental.Replanner`): members
that left (a failure, a region cut off) are removed and their children placed again with their
subtrees, each joiner is placed under its best offer, nobody else moves, and the cost is that of the
part of the tree touched (a failure at 100,000 members re-plans in a fraction of a second). One
measured link (:meth:`LivePlanner.link_measured`) takes the same path: only the child of that edge
may move. A full plan runs every ``full_every_s`` seconds (given ``now``) and is taken only if it
beats the current tree by ``min_gain``; :attr:`LivePlanner.last_moved` names the members whose
parent a returned plan changed (what followers act on).

Figures re-plan only on a real move: when some member's capacity differs
from the one the current plan was made with by more than ``change_factor``
(2x by default: a sampled rate wobbles), the current tree is scored on the new
figures, the members whose figures moved are re-placed together with their
children (everyone else keeps their parent), and the result is taken only if
it beats the current tree by ``min_gain`` (see :meth:`LivePlanner._better`). New probe
figures (:meth:`LivePlanner.use_measurements`) are a deliberate, rare event:
the next update plans afresh and takes that plan if it beats the current tree
by ``min_gain``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import math

from topology.incremental import Replanner
from topology.model import Measurement, NetworkModel, NodeSpec
from topology.planner import PlannerConfig, plan
from topology.replan import replan
from topology.tree import Estimate, Plan, estimate

ROLE_UPLINK_BPS = {"trainer": 10e9, "relay": 10e9, "rollout": 1e9}


@dataclass(frozen=True)
class PlanMember:
    """A member as the planner needs it."""

    id: str
    role: str
    region: str
    bandwidth: float = 0.0
    """Reported download bandwidth, bytes/s (0: unknown, use the probe figure or the role default)."""


class LivePlanner:
    """Keeps the current :class:`~topology.tree.Plan` and re-plans on membership and figure changes."""

    def __init__(self, root: str, config: PlannerConfig | None = None, *, change_factor: float = 2.0,
                 min_gain: float = 0.05, full_every_s: float = 600.0) -> None:
        if not change_factor > 1.0 or not 0.0 <= min_gain < 1.0:
            raise ValueError("change_factor must be > 1 and min_gain in [0, 1)")
        if not full_every_s > 0:
            raise ValueError("full_every_s must be > 0")
        self.full_every_s = full_every_s
        self._last_full = -math.inf
        self._replanner: Replanner | None = None
        self._links: dict[tuple[str, str], Measurement] = {}
        self._members: dict[str, PlanMember] = {}
        self.last_moved: frozenset[str] = frozenset()
        """Members present before and after whose parent the last returned plan changed."""
        self.root = root
        self.config = config or PlannerConfig()
        self.change_factor = change_factor
        self.min_gain = min_gain
        self.plan: Plan | None = None
        self.model_used: NetworkModel | None = None
        """The model the current plan was made with (or last checked against)."""
        self._probed: NetworkModel | None = None
        self._probe_fresh = False
        self._synced = False
        """Whether the last :meth:`update` returned with ``_members`` matching (by id, role and region)
        the members it was given: only then is a ``changed`` hint relative to them."""
        self._rootless = False

    def use_measurements(self, measured: NetworkModel) -> None:
        """Take node capacities, pair figures and region figures from a probe run for the next updates.

        Members the probe did not see keep role defaults; measured pairs whose ends are not both
        live members are ignored. The next :meth:`update` re-checks the plan against them.
        """
        self._probed = measured
        self._probe_fresh = True

    # --- the model ---------------------------------------------------------------------------------
    def model(self, members: Iterable[PlanMember]) -> NetworkModel:
        """The network model of ``members`` from the figures this planner has (see the module doc)."""
        members = list(members)
        probed = self._probed
        specs = [self._spec(m) for m in members]
        ids = {m.id for m in members}
        kept = [x for x in self._known_links().values() if x.src in ids and x.dst in ids]
        if probed is None:
            return NetworkModel(specs, kept)
        return NetworkModel(specs, kept, probed.regions.values(), probed.region_links.values(), probed.defaults)

    def _spec(self, m: PlanMember) -> NodeSpec:
        """One member's node in the model (see :meth:`model`)."""
        probed = self._probed
        default = ROLE_UPLINK_BPS.get(m.role, 1e9)
        up, down = default, default
        if probed is not None and m.id in probed:
            s = probed.node(m.id)
            up, down = s.uplink_bps, s.downlink_bps
        if m.bandwidth > 0:
            # A reported rate is what the node happened to receive (an idle node reports little),
            # so it proves at least that much capacity and never less than the other figures.
            down = max(down, m.bandwidth * 8)
        return NodeSpec(m.id, m.region, m.role, uplink_bps=up, downlink_bps=down)

    def _known_links(self) -> dict[tuple[str, str], Measurement]:
        probed = self._probed
        links = {(x.src, x.dst): x for x in (probed.measurements() if probed is not None else ())}
        links.update(self._links)
        return links

    # --- updates -----------------------------------------------------------------------------------
    def settled(self, now: float | None = None) -> bool:
        """Whether :meth:`update` given the members of its last call again (and ``now``) returns None:
        a plan exists, no probe figures are waiting and the periodic full plan is not due."""
        due = now is not None and now - self._last_full >= self.full_every_s
        return self.plan is not None and not self._probe_fresh and not due

    def update(self, members: Iterable[PlanMember], now: float | None = None,
               changed: Mapping[str, PlanMember | None] | None = None) -> Plan | None:
        """A new plan if membership changed, the figures moved enough, or (given ``now``) the periodic
        full plan beats the current tree (None if not, or without the root).

        ``changed``, from a caller that tracks its members (:class:`~p2psync.control.plan_gossip.
        PlanStep`), names every member added, removed or replaced since the previous call, with its
        entry now (None: gone); every other member must be the one that call was given. A membership
        change then costs the part of the tree it touches, not passes over every member (~0.1 s a
        round at 100,000 members under churn). The result is the same as without it."""
        use = changed if self._synced else None
        self._synced = self._rootless = False  # until this call returns (an error: the next one walks all)
        out = self._update(members, now, use)
        self._synced = not self._rootless
        return out

    def _update(self, members: Iterable[PlanMember], now: float | None,
                changed: Mapping[str, PlanMember | None] | None) -> Plan | None:
        if changed is not None and self.plan is not None:
            delta = {n: None if m is None or (m.role == "trainer" and n != self.root) else m
                     for n, m in changed.items()}
            if self.root in delta and delta[self.root] is None:
                self._rootless = True  # its members no longer match the caller's: the next call walks all
                return None
            old = self._members
            if not all(n not in old if m is None else
                       (o := old.get(n)) is not None and (o is m or (o.role, o.region) == (m.role, m.region))
                       for n, m in delta.items()):
                return self._membership_delta(delta)
        members = [m for m in members if m.role != "trainer" or m.id == self.root]
        if not any(m.id == self.root for m in members):
            self._rootless = True
            return None
        same = self._same_members(members)
        due = now is not None and now - self._last_full >= self.full_every_s
        if self.plan is not None and same and not self._probe_fresh and not due \
                and not self._reports_moved(members):
            return None  # the common case, every gossip round: nothing to do, not even a model to build
        if self.plan is None:
            model = self.model(members)
            self._last_full = now if now is not None else self._last_full
            return self._adopt(plan(model, self.config, 0), model, members)
        if not same:
            return self._membership(members)
        model = self.model(members)
        cfg = self.config
        if due:
            assert now is not None
            self._last_full = now
            return self._full(model, members)
        current = estimate(model, self.plan.root, self.plan.parents, cfg.payload_bytes, cfg.chunk_bytes)
        if self._probe_fresh:
            self._probe_fresh = False
            self.model_used = model
            fresh = plan(model, cfg, self.plan.epoch + 1)
            return self._adopt(fresh, model, members) if self._better(fresh, current) else None
        moved = self._moved_figures(model)
        if not moved:
            return None
        # Re-place the members whose figures moved, with their children; everyone else stays.
        children = self.plan.children()
        loose = set(moved) | {c for n in moved for c in children.get(n, ())}
        kept = {c: p for c, p in self.plan.parents.items() if c not in loose}
        repaired = replan(dataclasses.replace(self.plan, parents=kept), model, cfg)
        self.model_used = model  # the plan has been checked against these figures either way
        self._replanner = None  # the figures it holds moved: built again when next needed
        return self._adopt(repaired, model, members) if self._better(repaired, current) else None

    # --- the incremental path ----------------------------------------------------------------------
    def _same_members(self, members: list[PlanMember]) -> bool:
        """Whether ``members`` are the planned members (ids, roles, regions). The plan step hands the
        same objects again for members that did not change, so this is an identity check for most."""
        old = self._members
        if len(old) != len(members):
            return False
        for m in members:
            o = old.get(m.id)
            if o is None or (o is not m and (o.role != m.role or o.region != m.region)):
                return False
        return True

    def _membership(self, members: list[PlanMember]) -> Plan | None:
        """Members left or joined: remove and place them with the incremental re-planner."""
        assert self.plan is not None and self.model_used is not None
        # One pass over the members and one over the planned ones; the plan and the moved members come
        # from the re-planner (walking or copying every member per change cost ~0.2 s at 100,000).
        now_ids = {m.id: m for m in members}
        old = self._members
        left = [n for n, m in old.items()
                if (o := now_ids.get(n)) is None or (m is not o and (m.role, m.region) != (o.role, o.region))]
        left_set = set(left)
        joined = [] if not left and len(now_ids) == len(old) else \
            [m for m in members if m.id not in old or m.id in left_set]
        self._members = now_ids
        return self._move(left, left_set, joined)

    def _membership_delta(self, delta: dict[str, PlanMember | None]) -> Plan | None:
        """:meth:`_membership` from the members that changed only (see :meth:`update`)."""
        old = self._members
        left = [n for n, m in delta.items() if (o := old.get(n)) is not None
                and (m is None or (m is not o and (o.role, o.region) != (m.role, m.region)))]
        left_set = set(left)
        joined = [m for n, m in delta.items() if m is not None and (n not in old or n in left_set)]
        for n, m in delta.items():
            if m is None:
                old.pop(n, None)
            else:
                old[n] = m
        return self._move(left, left_set, joined)

    def _move(self, left: list[str], left_set: set[str], joined: list[PlanMember]) -> Plan | None:
        """Remove ``left`` and place ``joined`` with the incremental re-planner (members already set)."""
        assert self.plan is not None
        # No model of every member is built: the re-planner's model gains the joiners and loses the
        # leavers (at 10,000 members a full model cost ~50 ms, after every change under churn).
        rp = self._replanner_for()
        self._probe_fresh = False
        if not left and not joined:
            return None
        before = self.plan
        new_ids = {m.id for m in joined}
        touching = [x for x in self._known_links().values() if (x.src in new_ids or x.dst in new_ids)
                    and (x.src in new_ids or (x.src in rp.model and x.src not in left_set))
                    and (x.dst in new_ids or (x.dst in rp.model and x.dst not in left_set))] if joined else []
        change = rp.leave_and_join(left, [self._spec(m) for m in joined], touching)
        new = change.plan
        self.plan, self.model_used = new, rp.model
        # The re-planner's moved set, and the members that left and came back (a new region or role).
        back = {n for n in left if n in new_ids and before.parents.get(n) != new.parents.get(n)
                and n in before.parents and n in new.parents}
        self.last_moved = change.moved | back
        return new

    def link_measured(self, src: str, dst: str, bandwidth_bps: float, rtt_s: float) -> Plan | None:
        """One pair was measured again: kept for later models, and if it is a plan edge its child may move
        (to a better offer only). A new plan if some member moved, else None."""
        if self.plan is None or self.model_used is None or src not in self.model_used or dst not in self.model_used:
            raise ValueError(f"link {src!r} -> {dst!r}: both ends must be planned members")
        self._links[(src, dst)] = Measurement(src, dst, bandwidth_bps, rtt_s)
        rp = self._replanner_for()
        change = rp.link_changed(src, dst, bandwidth_bps, rtt_s)
        self.plan, self.model_used = change.plan, rp.model  # same tree, or one subtree moved
        if not change.moved:
            return None
        self.last_moved = change.moved
        return change.plan

    def _full(self, model: NetworkModel, members: list[PlanMember]) -> Plan | None:
        """The periodic full plan: taken only if it beats the current tree by ``min_gain``."""
        assert self.plan is not None
        cfg = self.config
        current = estimate(model, self.plan.root, self.plan.parents, cfg.payload_bytes, cfg.chunk_bytes)
        fresh = plan(model, cfg, self.plan.epoch + 1)
        if fresh.parents == self.plan.parents or not self._better(fresh, current):
            return None
        return self._adopt(fresh, model, members)

    def _replanner_for(self) -> Replanner:
        assert self.plan is not None and self.model_used is not None
        if self._replanner is None or self._replanner.epoch != self.plan.epoch:
            self._replanner = Replanner(self.plan, self.model_used, self.config)
        return self._replanner

    def _better(self, new: Plan, current: Estimate) -> bool:
        """Whether ``new`` beats the current tree by ``min_gain``: on the time the last node holds
        the artifact, or, that time no more than 1 % worse, on the mean time a node holds it. (A member
        on a very slow link is the last one whatever the tree; it should still not hold up a subtree.)"""
        if new.est_completion_s < current.completion_s * (1 - self.min_gain):
            return True
        if new.est_completion_s > current.completion_s * 1.01:
            return False
        mean_new = sum(new.eta_s.values()) / max(1, len(new.eta_s))
        mean_now = sum(current.eta_s.values()) / max(1, len(current.eta_s))
        return mean_new < mean_now * (1 - self.min_gain)

    def _adopt(self, new: Plan, model: NetworkModel, members: list[PlanMember]) -> Plan:
        before = self.plan
        self.plan, self.model_used = new, model
        self._members = {m.id: m for m in members}
        self._replanner = None  # built from this plan when the next change needs it
        self.last_moved = frozenset() if before is None else frozenset(
            n for n, p in new.parents.items() if n in before.parents and before.parents[n] != p)
        return new

    def _reports_moved(self, members: list[PlanMember]) -> bool:
        """Cheap pre-check of :meth:`_moved_figures` (reports only change downlinks): no model is built."""
        old, f = self.model_used, self.change_factor
        assert old is not None
        for m in members:
            if m.bandwidth <= 0 or m.id not in old:
                continue
            x, y = old.node(m.id).downlink_bps, m.bandwidth * 8
            if y > f * x:  # only a rise counts: a report is a lower bound on the capacity
                return True
        return False

    def _moved_figures(self, model: NetworkModel) -> list[str]:
        """Members whose uplink or downlink differs from the planned-with figure by more than ``change_factor``."""
        old = self.model_used
        assert old is not None
        f = self.change_factor
        out = []
        for n in model.node_ids:
            if n not in old:
                continue
            a, b = old.node(n), model.node(n)
            if any(max(x, y) > f * min(x, y) for x, y in ((a.uplink_bps, b.uplink_bps),
                                                           (a.downlink_bps, b.downlink_bps))):
                out.append(n)
        return [n for n in out if n != self.root]


__all__ = ["ROLE_UPLINK_BPS", "LivePlanner", "PlanMember"]
