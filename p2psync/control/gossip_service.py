"""The gossip service: the sans-IO :class:`~p2psync.gossip.protocol.GossipNode` on the node's HTTP server.

``POST /v1/gossip`` carries one gossip message (``messages.dumps``); the sender's
advertised URL rides the ``X-P2PSync-Gossip-From`` header (not the TCP source
port, which is an ephemeral client port); a body may take up to ``gossip.max_body_bytes``
(1 MiB), not the node's general 64 KiB, and each message is sized to what its receiver
said it takes (see :mod:`p2psync.gossip.config`). Replies go out as new POSTs, fire and
forget with a short timeout: a lost message only slows convergence.
``GET /v1/cluster`` answers :meth:`p2psync.node.Node.cluster` as JSON.

What rides on it, per node:

- membership and failure detection (suspect, then dead; graceful leave on stop);
- its versions held and measured throughput/bandwidth, reported to the
  coordinator only (:meth:`update_self`);
- on the trainer (the coordinator): ``head`` after every applied version, and
  the ``plan``, re-planned with :class:`~p2psync.control.live_plan.LivePlanner`
  whenever the alive membership changes (after ``control.replan_delay`` of
  quiet). Every coordinator entry is signed with the trainer key and every node
  refuses entries whose signature does not verify, so relays cannot forge them;
- on every other node: the planned parent becomes its first candidate parent
  (:meth:`p2psync.node.Node.set_planned_parent`), the configured parents follow;
- revocation: the trainer re-reads ``tls.revoked`` every round; when it changes it
  enforces the list, writes the signed entry ``revoked`` and pushes it at once to
  every member that has not left (one message each, not left to epidemic spread), so each node
  cuts the revoked ids off (:meth:`p2psync.transport.tls.Tls.revoke`) within one
  gossip round; revoked nodes leave the plan. A message whose sender is not the
  node its TLS certificate names is refused (403);
- restarts: every node keeps its incarnation, the addresses of the members it saw alive
  and the signed ``revoked`` entry in its data dir (:mod:`p2psync.control.saved_state`).
  Built before the node serves, the service enforces the saved list at once (and, on the
  trainer, the ``tls.revoked`` file); started, it publishes an incarnation above its last one,
  calls the remembered members while it knows no live peer, and gossips the saved entry on.

Contracts: the timer task and the sender tasks are owned by the service and
cancelled in :meth:`stop`; :meth:`stop` sends the leave tombstone first (best
effort, bounded by ``gossip.send_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from p2psync.control import plan_gossip, saved_state
from p2psync.control.bodies import BadRequest, read_body
from p2psync.control.saved_state import SavedControl
from p2psync.errors import CodecError, NotCoordinator, PeerRefused
from p2psync.gossip import DetectorConfig, GossipConfig, GossipNode, MemberEntry
from p2psync.gossip.membership import restart_incarnation
from p2psync.gossip.messages import Delta, Message, dumps, loads
from p2psync.gossip.signing import signer, verifier
from p2psync.transport.client import cancel_quietly
from p2psync.transport.messages import API
from p2psync.transport.peers import claim_refused
from p2psync.transport import refusals
from p2psync.transport.revocation import RevocationFile, read_list

if TYPE_CHECKING:
    from p2psync.control.live_plan import LivePlanner
    from p2psync.host import Host

logger = logging.getLogger(__name__)

FROM_HEADER = "X-P2PSync-Gossip-From"
_SAVE_EVERY = 10.0
"""Seconds between saves of the control state when only the remembered peers changed."""
_MAX_IN_FLIGHT = 256
"""Gossip POSTs under way at once; more are dropped (the next round heals it). Each message is its
own task: one slow or dead peer must not hold up heartbeats to the others."""


def _valid_url(url: str) -> bool:
    return url.startswith(("http://", "https://")) and 8 < len(url) <= 256 and not any(c.isspace() for c in url)


class GossipService:
    """Gossip for one node (built and handed to the parts that need it by :mod:`p2psync.services`)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.settings = host.config.gossip
        self.gossip: GossipNode | None = None
        self.planner: LivePlanner | None = None
        self._plan_step: plan_gossip.PlanStep | None = None
        self._session: aiohttp.ClientSession | None = None
        self._in_flight: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()
        self._plan_applied: tuple[int, str | None] | None = None
        self._head_published: int | None = None
        self._bw = (0.0, 0.0)  # (time, bytes_in) at the last bandwidth sample
        self.bandwidth = 0.0
        self.dropped = 0
        self._refusals = refusals.RefusalLog()
        self._revocations: RevocationFile | None = None
        self._revoked_seen = 0  # version of the last ``revoked`` entry enforced here
        self._saved_path = saved_state.path_in(host.config.data_dir)
        self._saved_at = 0.0
        self.saved = saved_state.load(self._saved_path, verifier(host.public_key))
        """The control state this node keeps in its data dir (as last written or read)."""
        self._enforce_saved_revocations()

    def _enforce_saved_revocations(self) -> None:
        """Before the node serves: the revocation list it held before a restart (and the trainer's file)."""
        cfg = self.host.config
        ids = set(self.saved.revoked.value["ids"]) if self.saved.revoked is not None else set()
        if cfg.role == "trainer" and cfg.tls.revoked:
            ids |= read_list(Path(cfg.tls.revoked))
        if ids:
            self.host.tls.revoke(ids)
            self.host.log.info("revocation list restored from %s: %s", self._saved_path, ", ".join(sorted(ids)))

    # --- lifecycle -----------------------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [web.post(f"{API}/gossip", self.rpc_gossip), web.get(f"{API}/cluster", self.rpc_cluster)]

    async def rpc_cluster(self, request: web.Request) -> web.Response:
        """``GET /v1/cluster``: :meth:`p2psync.node.Node.cluster` as JSON."""
        return web.json_response({"format": 1, "nodes": self.host.cluster()})

    async def start(self) -> None:
        host, s = self.host, self.settings
        cfg = host.config
        coordinator = s.coordinator or (cfg.id if cfg.role == "trainer" else None)
        now = time.time()
        me = MemberEntry(id=cfg.id, address=host.address, role=cfg.role, region=cfg.region,
                         node_class=s.node_class, incarnation=restart_incarnation(self.saved.incarnation, now))
        gcfg = GossipConfig(interval=s.interval, fanout=s.fanout, report_interval=s.report_interval,
                            report_budget=s.report_budget, max_body_bytes=s.max_body_bytes,
                            rejoin_interval=10 * s.interval,
                            detector=DetectorConfig(suspect_after=s.suspect_after, dead_after=s.dead_after,
                                                    tombstone_ttl=s.tombstone_ttl))
        sign = signer(host.private_key) if cfg.role == "trainer" and host.private_key is not None else None
        self.gossip = GossipNode(me, seeds=tuple(u.rstrip("/") for u in s.seeds), rejoin=self.saved.peers,
                                 coordinator=coordinator, config=gcfg, seed=hash((cfg.id, now)) & 0xFFFFFFFF,
                                 now=now, verify=verifier(host.public_key), sign=sign)
        if self.saved.revoked is not None:
            try:
                self.gossip.coord.restore(self.saved.revoked)
                self._revoked_seen = self.saved.revoked.version
            except NotCoordinator as exc:
                host.log.warning("not gossiping the saved revocation list: %s", exc)
        self._persist(now, force=True)  # the new incarnation, before anyone sees it
        if cfg.role == "trainer":
            if sign is None:
                host.log.warning("gossip: no trainer_private_key, so the plan and leases cannot be signed "
                                 "and no node would accept them; the live plan is off")
            else:
                from p2psync.control.live_plan import LivePlanner

                self.planner = LivePlanner(cfg.id)
                self._plan_step = plan_gossip.PlanStep(self.planner)
        headers = {"Authorization": f"Bearer {cfg.token()}", FROM_HEADER: host.address,
                   "Content-Type": "application/json"}
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=s.send_timeout),
            connector=host.tls.connector(limit=128, limit_per_host=8))
        if cfg.role == "trainer" and cfg.tls.revoked:
            self._revocations = RevocationFile(Path(cfg.tls.revoked))
            self._check_revocations(time.time())
        self._spawn(self._timer(), "gossip-timer")
        if self.planner is not None or cfg.role != "trainer":
            self._spawn(self._react(), "gossip-plan")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=f"{self.host.config.id}:{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.host.log.error("gossip task %s crashed: %r", task.get_name(), task.exception(),
                                exc_info=task.exception())

    async def stop(self) -> None:
        """Leave (tombstone to a few peers, bounded by ``send_timeout``), then stop every task."""
        g = self.gossip
        if g is not None and not g.stopped:
            self._persist(time.time(), force=True)
        if g is not None and not g.stopped and self._session is not None:
            out = g.leave(time.time())
            if out:
                await asyncio.gather(*(self._post(addr, msg) for addr, msg in out), return_exceptions=True)
            g.stop()
        for t in [*self._tasks, *self._in_flight]:
            await cancel_quietly(t)
        if self._session is not None:
            await self._session.close()

    # --- wire ----------------------------------------------------------------------------------
    def send(self, out: list[tuple[str, Message]]) -> None:
        """Fire and forget: one task per message, at most ``_MAX_IN_FLIGHT`` at once."""
        for addr, msg in out:
            if len(self._in_flight) >= _MAX_IN_FLIGHT:
                self.dropped += 1
                continue
            t = asyncio.create_task(self._post(addr, msg), name=f"{self.host.config.id}:gossip-post")
            self._in_flight.add(t)
            t.add_done_callback(self._in_flight.discard)

    async def _post(self, addr: str, msg: Message) -> bool:
        assert self._session is not None
        try:
            async with self._session.post(addr + f"{API}/gossip", data=dumps(msg)) as resp:
                refused = await refusals.from_response(addr, "gossip", resp) if resp.status >= 300 else None
                await resp.read()
        except aiohttp.ClientConnectorCertificateError as exc:
            refused = refusals.from_exception(addr, "gossip", exc)  # type: ignore[assignment]
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False  # fire and forget: the next round heals it
        if isinstance(refused, PeerRefused) and self._refusals.due(refused, time.time()) is not None:
            self.host.log.error("gossip: %s", refused)
        return refused is None and resp.status < 300

    async def rpc_gossip(self, request: web.Request) -> web.Response:
        sender = request.headers.get(FROM_HEADER, "")
        if not _valid_url(sender):
            return web.json_response({"error": f"missing or bad {FROM_HEADER} header", "status": 400}, status=400)
        try:
            msg = loads(await read_body(request, self.settings.max_body_bytes))
        except (BadRequest, CodecError) as exc:
            return web.json_response({"error": str(exc), "status": 400}, status=400)
        refused = claim_refused(request, msg.sender, "gossip sender")
        if refused:
            return web.json_response({"error": refused, "status": 403}, status=403)
        g = self.gossip
        if g is None or g.stopped:
            return web.json_response({"error": "gossip is not running", "status": 503}, status=503)
        self.send(g.receive(time.time(), sender.rstrip("/"), msg))
        self._changed.set()
        return web.Response(status=204)

    # --- timers --------------------------------------------------------------------------------
    async def _timer(self) -> None:
        g = self.gossip
        assert g is not None
        while True:
            now = time.time()
            self._update_self(now)
            self._check_revocations(now)
            self.send(g.tick(now))
            self._persist(now)
            self._changed.set()
            await asyncio.sleep(max(0.01, min(g.next_wakeup() - time.time(), g.config.interval)))

    def _update_self(self, now: float) -> None:
        host, g = self.host, self.gossip
        assert g is not None
        total = host.metrics.total("p2psync_bytes_in_total")
        t0, b0 = self._bw
        if t0 and total > b0 and now > t0:
            rate = (total - b0) / (now - t0)
            self.bandwidth = rate if not self.bandwidth else 0.7 * self.bandwidth + 0.3 * rate
        self._bw = (now, total)
        versions = () if host.version is None else (host.version,)
        g.update_self(now, versions=versions, bandwidth=self.bandwidth or None)

    def update_self(self, *, throughput: float | None = None, bandwidth: float | None = None) -> None:
        """Report a measured decode throughput (tokens/s) or download bandwidth (bytes/s)."""
        if self.gossip is not None:
            self.gossip.update_self(time.time(), throughput=throughput, bandwidth=bandwidth)

    async def _react(self) -> None:
        """Coordinator: publish head and re-plan; everyone: follow the planned parent."""
        delay = self.host.config.control.replan_delay
        while True:
            await self._changed.wait()
            self._changed.clear()
            self._follow_revoked()
            if self.planner is not None:
                self._publish_head()
                await asyncio.sleep(delay)  # let a burst of joins or failures settle into one plan
                await self._replan()
            else:
                self._follow_plan()

    def _publish_head(self) -> None:
        v = self.host.version
        g = self.gossip
        if v is not None and v != self._head_published and g is not None and g.coord.sign is not None:
            g.publish("head", {"version": v}, time.time())
            self._head_published = v

    async def _replan(self) -> None:
        g, planner, step = self.gossip, self.planner, self._plan_step
        assert g is not None and planner is not None and step is not None
        now = time.time()
        got = step.inputs(g, self.host.tls.revoked, now)
        if got is None:
            return  # nothing the plan reads changed since the last step
        new = await asyncio.to_thread(planner.update, got[1], now, step.changed)
        step.ran(got[0])
        if new is None:
            return
        plan_gossip.publish(g, new, time.time())
        self.host.log.info("plan epoch %d: %d nodes, %s", new.epoch, len(new.nodes),
                           {c: p for c, p in sorted(new.parents.items())} if len(new.parents) <= 16 else "...")

    def _check_revocations(self, now: float) -> None:
        """Trainer: enforce and gossip the revocation file when it changed (pushed to every live member)."""
        g, rf = self.gossip, self._revocations
        if rf is None or g is None:
            return
        ids = rf.poll()
        if ids is None:
            return
        self.host.tls.revoke(ids)
        if g.coord.sign is None:
            return
        entry = g.publish("revoked", {"ids": sorted(ids)}, now)
        self._revoked_seen = entry.version
        self._persist(now, force=True)
        me = self.host.config.id
        msg = Delta(me, coord=(entry,))
        # Every member that has not left, also one suspected or declared dead (it may only be slow).
        self.send([(e.address, msg) for e in g.members.entries.values()
                   if e.status != "left" and e.id != me and e.id not in ids])

    def _follow_revoked(self) -> None:
        """Every node: enforce the coordinator's latest ``revoked`` entry, and keep it in the data dir."""
        g = self.gossip
        assert g is not None
        e = g.coord.get("revoked")
        if e is None or e.version == self._revoked_seen:
            return
        self._revoked_seen = e.version
        self.host.tls.revoke(set(e.value["ids"]))
        self._persist(time.time(), force=True)

    def _persist(self, now: float, force: bool = False) -> None:
        """Save the control state when it changed: at once for a new incarnation or revocation
        list (``force``), at most every ``_SAVE_EVERY`` s for the remembered peers."""
        g = self.gossip
        if g is None:
            return
        me, coord = g.members.me, g.coord.coordinator
        rank = {"trainer": 0, "relay": 1}
        live = sorted((e for e in g.members.live() if e.id != me.id),
                      key=lambda e: (e.id != coord, rank.get(e.role, 2), e.id))
        # Alone (every other member gone): keep the addresses of the last run instead of none.
        peers = tuple(e.address for e in live[:saved_state.MAX_PEERS]) or self.saved.peers
        state = SavedControl(me.incarnation, peers, g.coord.get("revoked"))
        if state == self.saved:
            return
        urgent = force or (state.incarnation, state.revoked) != (self.saved.incarnation, self.saved.revoked)
        if not urgent and now - self._saved_at < _SAVE_EVERY:
            return
        try:
            saved_state.save(self._saved_path, state)
        except OSError as exc:
            self.host.log.warning("cannot save the control state to %s: %s", self._saved_path, exc)
            return
        self.saved, self._saved_at = state, now

    def _follow_plan(self) -> None:
        g = self.gossip
        assert g is not None
        follow = plan_gossip.planned_parent(g, self.host.config.id)
        if follow is None:
            return  # not known yet (or the parent is gone): keep what we have until gossip catches up
        version, url, parent_id = follow
        if self._plan_applied == (version, url):
            return
        self._plan_applied = (version, url)
        self.host.set_planned_parent(url, parent_id)

    # --- views ---------------------------------------------------------------------------------
    def coordinator_address(self) -> str | None:
        """Advertised URL of the coordinator, if gossip knows it (also while it is suspected or
        declared dead: a busy trainer is still the coordinator, and only it can say otherwise)."""
        g = self.gossip
        if g is None or g.coord.coordinator is None:
            return None
        e = g.members.get(g.coord.coordinator)
        return e.address if e is not None else None

    def cluster(self) -> list[dict]:
        """Every member this node knows (see :meth:`p2psync.node.Node.cluster`)."""
        g = self.gossip
        if g is None:
            return []
        plan = g.coord.plan
        parents = plan[2] if plan else {}
        me = self.host.config.id
        out = []
        for e in sorted(g.members.entries.values(), key=lambda e: e.id):
            rep = g.report_of(e.id)
            if e.id == me:
                version = self.host.version
            elif rep is not None and rep.versions:
                version = rep.versions[-1]
            else:
                version = e.versions[-1] if e.versions else None
            out.append({"id": e.id, "role": e.role, "region": e.region, "address": e.address,
                        "version": version, "status": e.status, "parent": parents.get(e.id),
                        "node_class": e.node_class,
                        "throughput": rep.throughput if rep is not None else e.throughput})
        return out
