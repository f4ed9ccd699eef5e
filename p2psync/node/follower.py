"""A node following its parent: parent choice, fetching, push, cut-through, snapshot rebuilds.

Relays and rollout nodes learn new heads from their parent's stream
(``/v1/stream``, or ``/v1/events`` from a parent without it), plan the cheapest
catch-up (:func:`p2psync.store.plan_catchup`), fetch with several streams, verify
every chunk, and hand it to the :class:`~p2psync.node.replica.Replica` to apply
all-or-nothing. Children hear of an artifact before this node decodes it and may
fetch each chunk the moment it is verified here (cut-through). Deltas up to
``limits.push_bytes`` arrive pushed on that stream instead
(:mod:`p2psync.transport.push`): verified the same way, pulled as before whatever
did not arrive.

Snapshots for joiners. Relays cannot sign, so the trainer signs the snapshots a
relay serves. Every ``store.snapshot_interval`` versions the trainer encodes its
weights as a *raw* snapshot (``zstd_level=0``, ``store.snapshot_chunk_size``) and
signs its manifest, beside the next version's announcement and transfer
(:class:`~p2psync.node.origin.Origin`). Raw segments are a pure function of the
weights, the tensor table and the chunk size, so any node holding version v
bit-exactly can rebuild the very same chunks from its own state without
downloading them: a follower that applied v and sees a signed snapshot manifest
for v upstream fetches only that manifest (a few KiB of hashes), re-encodes,
verifies every rebuilt chunk against the signed hashes, and only then stores and
serves it. A relay can therefore offer a joiner a recent snapshot without the
trainer sending one over the WAN, and a rebuilt chunk that does not match is
never served. (Compressed snapshots would tie the bytes to one zstd build; raw
ones do not. A joiner still takes whichever is fewer bytes: that raw snapshot
plus deltas, or any older, compressed snapshot plus a longer delta chain.)

Contract: every manifest this node stores verified against the trainer's key,
every chunk against its manifest, before it is stored, served or decoded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p2psync.codec.decode import Applier
from p2psync.errors import ChunkHashMismatch, CodecError, P2PSyncError, PeerUnreachable
from p2psync.node.priority import FORWARD_WAIT
from p2psync.node.snapshots import names_snapshot, rebuild_snapshot
from p2psync.retry import Backoff
from p2psync.store import ArtifactInfo, VersionStore, plan_catchup
from p2psync.transport.client import PeerClient, cancel_quietly
from p2psync.transport.tls import Tls
from p2psync.transport.fetch import Pipeline, Upstream, fetch_chunks
from p2psync.transport.messages import Catalogue
from p2psync.transport.parents import ParentSet
from p2psync.transport.push import CatalogueFrame, ChunkFrame, ManifestFrame, Pushes, PushUnsupported, read_stream
from p2psync.transport.view import HeadSignal

STORE_RETRY_S = 2.0
"""Seconds between attempts to store the next version after the data dir refused a write."""

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from p2psync.config import NodeConfig
    from p2psync.logs import NodeAdapter
    from p2psync.node.replica import Replica
    from p2psync.node.tasks import Spawn
    from p2psync.transport.board import Board
    from p2psync.transport.metrics import Metrics


def _nothing_with(i: int, data: bytes | memoryview) -> None:
    """A chunk needs no decode here (a node without weights)."""


async def _nothing() -> None:
    return None


class Follower:
    """Keeps a relay or rollout node caught up with its parent (see the module doc).

    Build with ``await Follower.create(...)``; :meth:`start` spawns its tasks; :meth:`close`
    after they were cancelled."""

    def __init__(self, config: NodeConfig, log: NodeAdapter, store: VersionStore, board: Board, metrics: Metrics,
                 heads: HeadSignal, public_key: Ed25519PublicKey, replica: Replica, stop: asyncio.Event,
                 spawn: Spawn, client: PeerClient) -> None:
        self.config = config
        self.log = log
        self.store = store
        self.board = board
        self.metrics = metrics
        self.heads = heads
        self.public_key = public_key
        self.replica = replica
        self._stop = stop
        self._spawn = spawn
        self.client = client
        self.parent_changed = asyncio.Event()
        lim = config.limits
        self.upstream = Upstream(client, ParentSet(list(config.parents), lim.retry_after, lim.avoid_seconds, lim.max_rest),
                                 metrics, self.parent_changed.set, log)
        self.upstream_cat: Catalogue | None = None
        """The parent's latest catalogue."""
        self._upstream_seen = HeadSignal()  # bumped for every catalogue the parent sends
        self._wake = asyncio.Event()
        self._pushes = Pushes()
        self._no_push: set[str] = set()
        self._stream_unpadded = False  # the open push stream asked for no padding (see _watch)
        self._rebuilt: set[int] = set()  # versions whose signed snapshot we rebuilt (or are rebuilding)
        self._on_held: dict[str, Callable[[], None]] = {}  # artifacts being received: say "holds"

    @classmethod
    async def create(cls, config: NodeConfig, log: NodeAdapter, store: VersionStore, board: Board,
                     metrics: Metrics, heads: HeadSignal, public_key: Ed25519PublicKey, replica: Replica,
                     stop: asyncio.Event, spawn: Spawn, tls: Tls | None = None) -> Follower:
        lim = config.limits
        client = await PeerClient.create(config.token(), config.id, stall_timeout=lim.stall_timeout,
                                         sse_keepalive=lim.sse_keepalive, parallel_streams=lim.parallel_streams,
                                         tls=tls)
        return cls(config, log, store, board, metrics, heads, public_key, replica, stop, spawn, client)

    def start(self) -> None:
        self._spawn(self._watch_upstream(), "upstream")
        self._spawn(self._follow(), "follow")
        self._spawn(self._pad_once_warm(), "pad-when-warm")

    def halt(self) -> None:
        """The node is stopping: a rebuild waiting for a snapshot manifest gives up."""
        self._upstream_seen.close()

    async def close(self) -> None:
        await self.client.close()

    async def _pad_once_warm(self) -> None:
        # Both, in either order: on a fast host the kernels load before the weights do, and a
        # stream left unpadded until the first apply carries that first delta slowly.
        await self.replica.warm.wait()
        await self.replica.loaded.wait()
        self._pad_stream_if_settled()

    def _after_apply(self, first: Any = None, snapshot_of: int | None = None) -> None:
        self.replica.after_apply(first, snapshot_of)
        self._pad_stream_if_settled()

    def set_planned_parent(self, url: str | None, parent_id: str | None = None) -> None:
        """Follow the live plan: ``url`` becomes the first candidate parent, the configured ones
        follow. The switch happens at once if the current parent changes; chunks held are kept."""
        parents = self.upstream.parents
        if parents.plan(url):
            self.log.info("planned parent: %s (%s); candidates %s", parent_id, url, parents.candidates)
            self.parent_changed.set()  # the watcher re-picks (the same parent: it just reconnects)

    def _settled(self) -> bool:
        """Codec warm, weights held and caught up with the parent: the node reads its stream at
        once, so padding sent now opens the stream's TCP windows (see :meth:`_watch`)."""
        cat, version = self.upstream_cat, self.replica.version
        return self.replica.warm.is_set() and version is not None and (cat is None or cat.head is None
                                                                       or cat.head <= version)

    def _pad_stream_if_settled(self) -> None:
        if self._stream_unpadded and self._settled():
            self._stream_unpadded = False
            self.log.info("settled: re-opening the push stream to be padded")
            self.parent_changed.set()  # the watcher re-opens its stream to the same parent

    async def _watch_upstream(self) -> None:
        """Keep an event stream open to the current parent; move when the parent changes."""
        up = self.upstream
        while True:
            url = await up.pick()
            self.parent_changed.clear()
            watch = asyncio.create_task(self._watch(url), name=f"{self.config.id}:watch:{url}")
            moved = asyncio.create_task(self.parent_changed.wait(), name=f"{self.config.id}:moved")
            try:
                await asyncio.wait({watch, moved}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                moved.cancel()  # at once: if we are being cancelled, the next await re-raises
                if watch.done() and not watch.cancelled():
                    # Looked at below, but a stop cancelling us now re-raises in the next await first:
                    # looked at here, so that asyncio does not log it as never retrieved.
                    watch.exception()
                await cancel_quietly(watch)
                await cancel_quietly(moved)
            exc = watch.exception() if watch.done() and not watch.cancelled() else None
            if isinstance(exc, PeerUnreachable):
                up.failed(url, exc)
            elif isinstance(exc, OSError):  # storing a pushed manifest or chunk failed: not the parent's fault
                self.log.error("cannot store what %s pushed in %s (%s); re-opening the stream in %.0f s",
                               url, self.config.data_dir, exc, STORE_RETRY_S)
                self.metrics.inc("p2psync_store_errors_total")
                await asyncio.sleep(STORE_RETRY_S)

    async def _watch(self, url: str) -> None:
        lim = self.config.limits
        if lim.push_bytes > 0 and url not in self._no_push:
            # Padding opens the stream's TCP windows only if this node reads it at once: a node still
            # starting (compiling its codec, loading or catching up: seconds of CPU, and the link busy
            # with its snapshot) read it slowly on the WAN testbed, and the windows stayed small. Such
            # a node opens its stream unpadded and re-opens it padded once settled.
            warm = lim.stream_warmup_bytes if self._settled() else 0
            self._stream_unpadded = lim.stream_warmup_bytes > 0 and not warm
            try:
                async for frame in read_stream(self.client, url, lim.push_bytes, self._pushed_chunk_size, warm):
                    self.upstream.ok(url)
                    await self._on_frame(url, frame)
                return
            except PushUnsupported:
                self._stream_unpadded = False
                self._no_push.add(url)
                self.log.info("parent %s cannot push; following its event stream instead", url)
        async for cat in self.client.call_events(url):
            self.upstream.ok(url)
            self._note_upstream(cat)

    def _pushed_chunk_size(self, aid: str, index: int) -> int | None:
        m = self._pushes.manifest(aid)
        return m.chunks[index].size if m is not None and 0 <= index < len(m.chunks) else None

    async def _on_frame(self, url: str, frame: CatalogueFrame | ManifestFrame | ChunkFrame) -> None:
        """A frame the parent pushed: verified exactly like pulled data before anything is kept."""
        if isinstance(frame, CatalogueFrame):
            self._note_upstream(frame.catalogue)
            return
        if isinstance(frame, ManifestFrame):
            m = frame.manifest
            try:
                m.verify(self.public_key)
                if m.kind != "delta" or m.payload_bytes > self.config.limits.push_bytes:
                    raise CodecError(f"a {m.kind} of {m.payload_bytes} bytes was not asked for")
            except P2PSyncError as exc:
                self.upstream.corrupt(url, f"a pushed manifest that does not verify ({exc})")
                raise PeerUnreachable(url, "pushed a bad manifest") from None
            if m.artifact_id not in self.store.artifacts:
                await asyncio.to_thread(self.store.add_manifest, m)
            self._pushes.expect(m)
            return
        aid, i = frame.artifact_id, frame.index
        if aid not in self.store.artifacts or self.store.has_chunk(aid, i):
            return  # pruned meanwhile, or already held
        try:
            await asyncio.to_thread(self.store.put_chunk, aid, i, frame.data)
        except ChunkHashMismatch as exc:
            self.upstream.corrupt(url, f"corrupt pushed chunk {i} of {aid} ({exc.actual} != {exc.expected})")
            raise PeerUnreachable(url, "pushed a corrupt chunk") from None
        self.metrics.inc("p2psync_bytes_in_total", len(frame.data))
        self.metrics.inc("p2psync_chunks_in_total")
        self.metrics.inc("p2psync_chunks_pushed_in_total")
        self.board.arrived(aid, i)
        self._pushes.arrived()
        if self.store.artifacts[aid].complete:
            # Listed complete now, not when this node's decode queue next has room (a leaf that
            # decodes as chunks arrive submits them behind a bounded queue).
            self._on_held.get(aid, self.heads.bump)()

    def _note_upstream(self, cat: Catalogue) -> None:
        self.upstream_cat = cat
        self._upstream_seen.bump()
        self.metrics.set("p2psync_head", -1 if cat.head is None else cat.head)
        self._wake.set()

    async def _follow(self) -> None:
        """Catch up to the parent's head whenever it moves.

        Also rebuilds the trainer-signed snapshot of the version held when the parent announces
        its manifest only after we applied that version (the trainer signs it just after it
        publishes the delta), once per version.
        """
        await self.replica.loaded.wait()
        lim = self.config.limits
        interrupted = 0  # catch-ups interrupted in a row: each waits longer (jittered)
        while True:
            cat = self.upstream_cat
            version = self.replica.version
            if (cat is not None and self.config.materialise and version is not None
                    and version not in self._rebuilt and names_snapshot(cat, version)):
                self._rebuilt.add(version)
                self._after_apply(self._materialise(version), version)  # beside the next catch-up
                continue
            if cat is None or cat.head is None or (version is not None and cat.head <= version):
                self._wake.clear()
                try:
                    async with asyncio.timeout(lim.poll_interval):
                        await self._wake.wait()
                except TimeoutError:
                    await self._poll()
                continue
            try:
                await self._catch_up(cat)
                interrupted = 0
            except P2PSyncError as exc:
                self.log.warning("catch-up to version %s interrupted: %s", cat.head, exc)
                self.upstream_cat = None
                await self._poll()
                await asyncio.sleep(Backoff(first=lim.retry_after, cap=max(lim.retry_after, 30.0)).delay(interrupted))
                interrupted += 1
            except OSError as exc:
                # The data dir refused a write (full disk, quota, read-only): nothing half-written is
                # kept (the store writes by rename) and the applied version stays; keep serving it and
                # try again, rather than stopping the node over what freed space will fix.
                self.log.error("catch-up to version %s: cannot store it in %s (%s); trying again in %.0f s",
                               cat.head, self.config.data_dir, exc, STORE_RETRY_S)
                self.metrics.inc("p2psync_store_errors_total")
                await asyncio.sleep(STORE_RETRY_S)

    async def _poll(self) -> None:
        url = await self.upstream.pick()
        try:
            self._note_upstream(await self.client.call_head(url))
        except PeerUnreachable as exc:
            self.upstream.failed(url, exc)

    async def _catch_up(self, cat: Catalogue) -> None:
        assert cat.head is not None
        plan = plan_catchup(self.replica.version, cat.head, cat.artifacts)
        self.log.info("catching up %s -> %d via %s", self.replica.version, cat.head, [a.id for a in plan])
        for info in plan:
            await self._fetch_apply(info)
            latest = self.upstream_cat or cat  # it may list a snapshot signed while we fetched
            first = None
            version = self.replica.version
            if self.config.materialise and version is not None and names_snapshot(latest, version):
                self._rebuilt.add(version)
                first = self._materialise(version)
            self._after_apply(first, version if first is not None else None)

    async def _fetch_apply(self, info: ArtifactInfo) -> None:
        aid = info.id
        art = self.store.artifacts.get(aid)
        if art is None:
            m = await self.upstream.manifest(aid, lambda m: m.verify(self.public_key))
            art = self.store.add_manifest(m)
        manifest = art.manifest
        t0 = time.perf_counter()
        # Children hear of it first (cut-through: they fetch, or are pushed, each chunk the moment
        # it is verified here), before this node spends anything on its own decode and apply.
        self.board.begin(aid, len(manifest.chunks))
        self.heads.bump()
        try:
            await self._receive_apply(art, t0)
        finally:
            self.board.end(aid)
            self.heads.bump()

    async def _receive_apply(self, art: Any, t0: float) -> None:
        manifest = art.manifest
        aid = manifest.artifact_id
        order = self.replica.decode_order()
        self.log.info("decoding %s: %s", aid, order.why)
        # Without weights (store.hold_weights) the node stores and relays the verified chunks only.
        applier = await asyncio.to_thread(Applier.onto, self.replica.state, manifest) \
            if self.replica.holds_weights else None
        # Chunks decode in worker threads while later ones download (bounded, so memory is too;
        # deeper than the threads, so that fetching, and forwarding, do not wait for each decode).
        decode = Pipeline(applier.add_chunk if applier is not None else _nothing_with,
                          self.config.limits.parallel_streams + 2, self.replica.pool(order.nice, order.threads))
        submitted: set[int] = set()
        pulled = 0
        announced = False

        def held() -> None:
            # Once, the moment every chunk is stored (pushed, pulled or here before), whatever
            # the decode has reached: listed complete (children and late joiners may pull it, the
            # parent sees it held) while it decodes and applies.
            nonlocal announced
            if announced:
                return
            announced = True
            self.heads.bump()
            self.log.info("holds %s: %d chunks (%d held or pushed) %.3f s after its manifest", aid,
                          len(manifest.chunks), len(manifest.chunks) - pulled, time.perf_counter() - t0)

        async def submit(i: int, data: bytes | memoryview) -> None:
            if i not in submitted:
                submitted.add(i)
                await decode.submit(i, data)

        async def fetched(i: int, data: bytes | memoryview) -> None:
            nonlocal pulled
            pulled += 1
            if art.complete:
                held()
            await submit(i, data)

        async def submit_held() -> None:
            # Kept from an interrupted fetch or an earlier run, or pushed by the parent.
            while extra := sorted(set(art.held) - submitted):
                for i in extra:
                    data = self.store.cached_chunk(aid, i)
                    await submit(i, data if data is not None else
                                 await asyncio.to_thread(self.store.read_chunk, aid, i))

        # forward_first: a pushed delta arrives in one burst; hold it all before decoding any of it
        # (also what was here before), so that receiving (and forwarding to children) does not
        # share the CPU with its decode.
        hold = self._pushes.manifest(aid) is not None and order.forward_first
        # Said once all is stored: here if it already is (before submitting, which waits on the
        # decode queue), else by the pushed chunk (_on_frame) or the pulled one (fetched) that
        # completes it, and at the latest after the fetch.
        self._on_held[aid] = held
        try:
            if art.complete:
                held()
            if not hold:
                await submit_held()
            if self._pushes.manifest(aid) is not None:
                await self._take_pushed(art, _nothing if hold else submit_held)
            if hold and art.complete and not await self.board.forwarded(aid, FORWARD_WAIT):
                self.log.info("children still being pushed %s after %.1f s; decoding beside it", aid, FORWARD_WAIT)
            await submit_held()  # no await between its last look and fetch_chunks' look at the store
            await fetch_chunks(self.upstream, self.store, self.board, manifest,
                               self.config.limits.parallel_streams, fetched)
        finally:
            self._on_held.pop(aid, None)
        held()
        await decode.drain()
        await self.replica.commit(manifest, applier=applier, order=order)

    async def _take_pushed(self, art: Any, submit_held: Any) -> None:
        """Decode pushed chunks as they arrive, until all are here or no chunk of this artifact
        arrived for ``limits.stall_timeout`` (then the rest is pulled).

        Stalled means no chunk of *this* artifact: the stream may go on pushing newer versions
        (a parent that lost the connection it was pushing this one on does not push it again),
        and those must not keep this node waiting for chunks that will never come."""
        n = len(art.manifest.chunks)
        loop = asyncio.get_running_loop()
        stall = self.config.limits.stall_timeout
        held, since = len(art.held), loop.time()
        while True:
            await submit_held()
            if len(art.held) >= n:
                break
            if len(art.held) > held:
                held, since = len(art.held), loop.time()
            left = since + stall - loop.time()
            if left <= 0 or not await self._pushes.wait(left):
                self.log.warning("push of %s stalled at %d of %d chunks; pulling the rest",
                                 art.manifest.artifact_id, len(art.held), n)
                break

    async def _materialise(self, version: int) -> None:
        """Rebuild the trainer-signed raw snapshot of ``version`` from our weights (see module doc).

        If the parent lists it as pending (the trainer is still signing it, or the parent still
        rebuilding it), first waits until the parent lists the manifest: this runs as the
        version's housekeeping, so the next commit waits with it (the weights must still be
        ``version``'s), while the next artifact is already received and forwarded. Gives up,
        keeping nothing, when the parent stops listing it as pending without a manifest or after
        ``store.snapshot_wait`` seconds.
        """
        if self.store.find("snapshot", version, complete=True) is not None:
            return
        if not await self._snapshot_signed(version):
            return
        url = await self.upstream.pick()
        try:
            m = await self.client.call_version_manifest(url, version, "snapshot")
            m.verify(self.public_key)
        except P2PSyncError as exc:
            self.log.warning("no snapshot manifest for version %d from %s: %s", version, url, exc)
            return
        if m.target_fingerprint != self.replica.fingerprint:
            self.log.warning("snapshot manifest for version %d names another fingerprint; ignored", version)
            return

        assert self.replica.state is not None
        if await asyncio.to_thread(rebuild_snapshot, self.store, self.replica.state, m):
            self.metrics.inc("p2psync_snapshots_materialised_total")
            self.log.info("materialised signed snapshot %s from local weights", m.artifact_id)
            self.heads.bump()
        else:
            self.log.warning("rebuilt snapshot of version %d does not match the signed manifest; not serving it",
                             version)

    async def _snapshot_signed(self, version: int) -> bool:
        """Wait until the parent lists the signed snapshot manifest of ``version`` (see :meth:`_materialise`)."""
        lim = self.config.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.store.snapshot_wait
        while True:
            seq = self._upstream_seen.seq
            cat = self.upstream_cat
            if self._stop.is_set():
                return False
            if cat is not None and version in cat.snapshot_manifests:
                return True
            if cat is not None and version not in cat.snapshots_pending:
                self.log.warning("parent no longer makes the snapshot of version %d; not rebuilding it", version)
                return False
            left = deadline - loop.time()
            if left <= 0:
                self.log.warning("no signed snapshot of version %d after %.0f s; not rebuilding it", version,
                                 self.config.store.snapshot_wait)
                return False
            await self._upstream_seen.wait(seq, min(left, lim.poll_interval))
            if self._upstream_seen.seq == seq:
                await self._poll()  # nothing heard: the push stream may be down

