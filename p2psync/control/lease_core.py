"""The coordinator's core: lease table, scheduler, lease timer and results, without HTTP.

:class:`CoordinatorCore` holds the state; :class:`p2psync.control.coordinator.Coordinator`
puts the HTTP routes on it. Contracts:

- Every work id submitted is, at any time, queued, leased to one node, or
  completed (:class:`~p2psync.lease.LeaseTable`); :meth:`results` yields each
  accepted work id exactly once, with every response's full token history
  (tokens, log-probabilities and the version of each token), also when the
  response was started on another node and migrated.
- A lease request long-polls up to ``wait`` seconds. Work is placed by the
  :class:`~p2psync.schedule.Scheduler` over the nodes waiting now plus the nodes
  busy with leases (their estimated finish times), so a long prompt group waits
  for a fast node that frees up soon rather than going to a slow one now. Only
  a node within the staleness bound (version >= head - max_staleness) gets
  work; its version is what its latest lease request said it generates with
  (``version``), or its gossip report if that arrived later.
- Expired leases return their work, with its tokens, to the front of the queue
  (the lease timer) and the waiting nodes are served again at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2psync.control.api import Result
from p2psync.control.bodies import grant_json
from p2psync.errors import ConfigError
from p2psync.gossip.items import LEASES_PREFIX
from p2psync.lease import LeaseTable, WorkItem
from p2psync.schedule import NodeView, Scheduler
from p2psync.transport.client import cancel_quietly

if TYPE_CHECKING:
    from p2psync.control.gossip_service import GossipService
    from p2psync.host import Host

_DEFAULT_TPS = 100.0


@dataclass
class Waiter:
    """A lease request waiting for work; ``future`` gets its grants (JSON, see :func:`grant_json`)."""

    node: str
    max_items: int
    future: asyncio.Future


class CoordinatorCore:
    """Leases, scheduling and results on the trainer node (see module doc); no HTTP.

    ``gossip``: the node's gossip service when gossip is on (the live plan, the lease table's
    publication and the members' figures ride on it)."""

    def __init__(self, host: Host, gossip: GossipService | None = None) -> None:
        self.host = host
        self.gossip = gossip
        cfg = host.config.control
        self.table = LeaseTable(cfg.lease_ttl)
        self.scheduler = Scheduler(max_staleness=cfg.max_staleness)
        self._results: asyncio.Queue[Result] = asyncio.Queue()
        self._waiters: list[Waiter] = []
        self._granted_at: dict[int, float] = {}
        self._tps: dict[str, float] = {}
        self._said_version: dict[str, tuple[float, int]] = {}
        """node -> (time, version) its latest lease request said it generates with."""
        self._dirty_holders: set[str] = set()
        self._published_holders: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._kick = asyncio.Event()
        self._stopped = False
    # --- service ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self._feed_probe_figures()
        t = asyncio.create_task(self._timer(), name=f"{self.host.config.id}:lease-timer")
        t.add_done_callback(self._task_done)
        self._tasks.append(t)

    def _feed_probe_figures(self) -> None:
        """Give the live planner (gossip starts first) the probe run named by ``probe.measurements``."""
        path = self.host.config.probe.measurements
        planner = getattr(self.gossip, "planner", None)
        if not path or planner is None:
            return
        from topology.model import NetworkModel

        try:
            measured = NetworkModel.load(path)
        except OSError as exc:
            raise ConfigError("probe.measurements", f"cannot read {path}: {exc.strerror}") from None
        planner.use_measurements(measured)
        self.host.log.info("live plan uses probe figures from %s (%d nodes, %d pairs)", path, len(measured),
                           len(measured.measurements()))

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.host.log.error("coordinator task crashed: %r", task.exception(), exc_info=task.exception())

    async def stop(self) -> None:
        self._stopped = True
        for w in self._waiters:
            if not w.future.done():
                w.future.set_result([])
        self._waiters.clear()
        for t in self._tasks:
            await cancel_quietly(t)
        self._results.put_nowait(None)  # type: ignore[arg-type]  # wakes results() so it ends

    # --- WorkSink ------------------------------------------------------------------------------
    def submit(self, work_id: str, payload: dict[str, Any], *, prompt_key: str = "", responses: int = 1) -> None:
        """Queue a prompt group; idempotent by ``work_id``. ``ValueError`` for a bad id or count."""
        if not isinstance(work_id, str) or not 0 < len(work_id) <= 128:
            raise ValueError(f"work_id must be a non-empty string of at most 128 characters, got {work_id!r}")
        if not isinstance(responses, int) or not 1 <= responses <= 1024:
            raise ValueError(f"responses must be 1..1024, got {responses!r}")
        self.table.submit(WorkItem(work_id, prompt_key or work_id, payload, responses))
        self._kick.set()

    async def results(self) -> AsyncIterator[Result]:
        """Accepted results in completion order, each work id once; ends when the node stops."""
        while True:
            r = await self._results.get()
            if r is None:
                self._results.put_nowait(None)  # for any other reader
                return
            yield r

    def pending(self) -> int:
        return self.table.pending()

    # --- scheduling ----------------------------------------------------------------------------
    def _head(self) -> int:
        return self.host.version if self.host.version is not None else 0

    def _member_info(self, node_id: str) -> tuple[str, float | None, int | None]:
        """(node class, reported throughput or None, newest reported version or None).

        The version is the fresher of the node's last gossip report and what its last
        lease request said: a report waits for the next gossip round (a second by
        default, several training steps of a small model), so a node that took a new
        version since would look stale and get no work in between."""
        said = self._said_version.get(node_id)
        g = self.gossip.gossip if self.gossip is not None else None
        if g is None:
            return "reserved", None, None if said is None else said[1]
        e = g.members.get(node_id)
        got = g.reports.get(node_id)
        rep = None if got is None else got[1]
        cls = e.node_class if e is not None else "reserved"
        tps = rep.throughput if rep is not None and rep.throughput > 0 else None
        version = rep.versions[-1] if rep is not None and rep.versions else None
        if said is not None and (version is None or got is None or said[0] >= got[0]):
            version = said[1]
        return cls, tps, version

    def _views(self, now: float) -> list[NodeView]:
        head = self._head()
        waiting: dict[str, int] = {}
        for w in self._waiters:
            waiting[w.node] = waiting.get(w.node, 0) + w.max_items
        holders = {n for n, leases in self.table.holders().items() if leases}
        info = {n: self._member_info(n) for n in set(waiting) | holders}
        known = [tps for _, tps, _ in info.values() if tps] + [v for v in self._tps.values()]
        default_tps = sum(known) / len(known) if known else _DEFAULT_TPS
        views = []
        for n in sorted(set(waiting) | holders):
            cls, tps, version = info[n]
            tps = tps or self._tps.get(n) or default_tps
            held = self.table.leases_of(n)
            slots = len(held) + waiting.get(n, 0)
            per_slot = tps / max(1, slots)
            busy = []
            for lease in held:
                item = self.table.item(lease.work_id)
                done = sum(len(t) for t in self.table.tokens(lease.work_id).values())
                left = max(1.0, self.scheduler.predictor.predict(item.prompt_key) - done)
                # A busy node that does not ask for more is not free now, whatever the estimate says.
                floor = now if n in waiting else now + 1.0
                busy.append(max(floor, now + left / per_slot))
            if version is None:
                version = head  # nothing reported (no gossip): assume current
            views.append(NodeView(n, cls, tps, slots, tuple(busy), version, None, None))
        return views

    def _dispatch(self) -> None:
        """Serve waiting lease requests from the queue, as the scheduler places the work."""
        if not self._waiters or not self.table.queued():
            return
        now = time.time()
        placements = self.scheduler.assign(now, self.table.queued(), self._views(now), self._head())
        want: dict[str, int] = {}
        for w in self._waiters:
            want[w.node] = want.get(w.node, 0) + w.max_items
        granted: dict[str, list[dict[str, Any]]] = {}
        for wid, nid in placements:
            if want.get(nid, 0) <= 0:
                continue  # planned on a busy node: stays queued for it
            lease = self.table.grant(now, nid, wid)
            self._granted_at[lease.lease_id] = now
            granted.setdefault(nid, []).append(grant_json(lease, self.table.item(wid), self.table.history(wid)))
            want[nid] -= 1
            self._dirty_holders.add(nid)
        if not granted:
            return
        keep = []
        for w in self._waiters:
            mine = granted.get(w.node, [])
            if mine and not w.future.done():
                w.future.set_result(mine[:w.max_items])
                granted[w.node] = mine[w.max_items:]
            else:
                keep.append(w)
        self._waiters = keep
        self._kick.set()

    async def _timer(self) -> None:
        """Expire leases when due, re-dispatch, publish lease entries; at least every 0.5 s."""
        while True:
            now = time.time()
            expired = self.table.expire(now)
            for wid in expired:
                self.host.log.info("lease on %s expired; back to the queue", wid)
            self._dirty_holders.update(self._published_holders - set(self.table.holders()))
            self._reconcile_leases()
            self._dispatch()
            self._publish_leases(now)
            nxt = self.table.next_expiry()
            timeout = 0.5 if nxt is None else min(0.5, max(0.01, nxt - time.time()))
            self._kick.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._kick.wait()
            except TimeoutError:
                pass

    def _reconcile_leases(self) -> None:
        """Mark holders whose gossiped ``leases/<node>`` entry names other work than the table (an
        old entry a straggler brought back after its tombstone was removed): republished next."""
        g = self.gossip.gossip if self.gossip is not None else None
        if g is None:
            return
        holders = self.table.holders()
        for name, e in g.coord.entries.items():
            if name.startswith(LEASES_PREFIX) and e.value:
                node = name[len(LEASES_PREFIX):]
                if sorted(w for w, _ in e.value) != [w for w, _ in holders.get(node, [])]:
                    self._dirty_holders.add(node)

    def _publish_leases(self, now: float) -> None:
        """``leases/<node>`` entries for holders whose lease set changed; an empty list (a tombstone
        every node drops after a while) for a node that holds nothing any more."""
        g = self.gossip.gossip if self.gossip is not None else None
        if g is None or g.coord.sign is None or not self._dirty_holders:
            self._dirty_holders.clear()
            return
        holders = self.table.holders()
        for n in sorted(self._dirty_holders):
            leases = [[w, round(t, 3)] for w, t in holders.get(n, [])]
            g.publish(f"leases/{n}", leases, now)
            if leases:
                self._published_holders.add(n)
            else:
                self._published_holders.discard(n)
        self._dirty_holders.clear()
