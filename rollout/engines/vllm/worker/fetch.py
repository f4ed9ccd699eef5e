"""Fetching from a p2psync parent for the vLLM backend: plans, signed manifests, verified chunks.

Every function checks what it gets (manifest signatures against the trainer's
key, chunk hashes against the signed manifest) and raises a typed
:class:`~p2psync.errors.P2PSyncError`; :mod:`rollout.engines.vllm.worker.backend` runs
them on every tensor-parallel rank and votes. Each takes the client to use
(``client``) or opens its own (mutual TLS with the folder given) for one call;
the backend's updates go through a :class:`Fetcher`, which keeps one client and
its connections between calls. :func:`decoding` hands each verified chunk to a
:class:`~rollout.engines.vllm.apply.stream.Streamed` decode while later chunks are on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from p2psync.errors import P2PSyncError, SignatureError, TruncatedError, WrongSize
from p2psync import workers
from p2psync.transport.fetch import Pipeline
from rollout.engines.vllm.worker.infos import TransferInfoError

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from rollout.engines.vllm.apply.stream import Streamed

T = TypeVar("T")
OnChunk = Callable[[int, memoryview], Awaitable[None]]
"""Called with each chunk (its index and bytes) as soon as its hash matched the signed manifest."""

NOT_YET_RETRY_S = 0.2
"""Pause before asking again for a chunk the parent does not hold yet."""


def _tls(tls_dir: str) -> Any:
    from p2psync.transport.tls import Tls

    return Tls.for_client(tls_dir) if tls_dir else None


async def _new_client(token: str, node_id: str, timeout: float, parallel: int, tls_dir: str) -> Any:
    from p2psync.transport.client import PeerClient

    return await PeerClient.create(token, node_id, stall_timeout=timeout, sse_keepalive=1.0,
                                   parallel_streams=parallel, tls=_tls(tls_dir))


@contextlib.asynccontextmanager
async def _using(client: Any, token: str, node_id: str, timeout: float, parallel: int, tls_dir: str
                 ) -> AsyncIterator[Any]:
    """``client`` if given (left open), else a client of its own for the block."""
    if client is not None:
        yield client
        return
    own = await _new_client(token, node_id, timeout, parallel, tls_dir)
    async with own:
        yield own


class Fetcher:
    """Calls to one parent on an event loop of its own, through one client kept between calls.

    A client per call cost a thread, an event loop and new mutual-TLS connections every time
    (plan and manifest about 11 ms each on an idle core here, more on the one core a vLLM worker is
    bound to); the kept client reuses its connections. The client is replaced when the parent's
    address, token, identity or folder changes, and after any failed call; a call without side
    effects (``retry``) that fails as unreachable on a kept client is tried once more on a new one
    (a parent that restarted closed the kept connections)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._client: Any = None
        self._key: tuple[Any, ...] | None = None
        self._getting = asyncio.Lock()

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._getting = asyncio.Lock()  # used on that loop only
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="p2psync-fetch", daemon=True).start()
                self._loop = loop
            return self._loop

    async def _get(self, key: tuple[Any, ...]) -> tuple[Any, bool]:
        """The client for ``key`` and whether it is new."""
        async with self._getting:  # a background connect() and a call must not both build one
            if self._client is not None and self._key == key:
                return self._client, False
            await self._drop()
            token, node_id, timeout, parallel, tls_dir = key
            self._client, self._key = await _new_client(token, node_id, timeout, parallel, tls_dir), key
            return self._client, True

    async def _drop(self) -> None:
        client, self._client, self._key = self._client, None, None
        if client is not None:
            await client.close()

    def run(self, token: str, node_id: str, timeout: float, tls_dir: str,
            call: Callable[[Any], Awaitable[T]], retry: bool = False, parallel: int = 4) -> T:
        """``await call(client)`` on the fetcher's loop (blocking the caller until it ends)."""
        from p2psync.errors import PeerUnreachable

        key = (token, node_id, timeout, parallel, tls_dir)

        async def go() -> T:
            client, new = await self._get(key)
            try:
                return await call(client)
            except PeerUnreachable:
                await self._drop()
                if not retry or new:
                    raise
            except BaseException:
                await self._drop()
                raise
            client, _ = await self._get(key)
            try:
                return await call(client)
            except BaseException:
                await self._drop()
                raise

        return asyncio.run_coroutine_threadsafe(go(), self._running()).result()

    def connect(self, token: str, node_id: str, timeout: float, tls_dir: str, url: str, parallel: int = 4) -> None:
        """Open ``parallel`` connections to ``url`` in the background, returning at once: a fetch in
        parallel streams that follows (after the plan and manifest, say) then starts on open
        connections, its TLS handshakes done beside those calls. Failures are left to the fetch."""
        key = (token, node_id, timeout, parallel, tls_dir)

        async def go() -> None:
            client, _ = await self._get(key)
            await client.connect(url, parallel)

        fut = asyncio.run_coroutine_threadsafe(go(), self._running())
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: never logged as lost

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """``await make()`` on the fetcher's loop, without a client (blocking the caller until it ends)."""
        async def go() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(go(), self._running()).result()

    def close(self) -> None:
        """Close the kept client and stop the loop (a later call starts them again)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._drop(), loop).result()
            loop.call_soon_threadsafe(loop.stop)


async def fetch_artifact(url: str, token: str, node_id: str, aid: str, public_key: Any, timeout: float,
                         parallel: int = 4, tls_dir: str = "", manifest: Any = None,
                         need: list[int] | None = None,
                         on_chunk: Callable[[int, memoryview], Awaitable[None]] | None = None,
                         client: Any = None) -> tuple[Any, list[Any]]:
    """The manifest (signature checked) and the chunks (hash checked) of artifact ``aid`` at ``url``.

    ``manifest``: already fetched and checked (:func:`fetch_manifest`); ``need``: the chunks to
    fetch (None: every chunk); the others are None in the list returned. A chunk the parent says
    is not there yet (HTTP 503: it is still receiving the artifact) is asked for again every
    :data:`NOT_YET_RETRY_S` until ``timeout`` seconds passed. ``on_chunk(i, data)``:
    awaited with each chunk as soon as its hash matched (:mod:`rollout.engines.vllm.apply.stream`); on
    any failure the fetches still running are cancelled before it is raised."""
    from p2psync.artifact import verify_chunk
    from p2psync.codec.slabs import Arena
    from p2psync.transport.client import ChunkBuffer, NotYet

    async with _using(client, token, node_id, timeout, parallel, tls_dir) as client:
        if manifest is None:
            manifest = await _checked_manifest(client, url, aid, public_key)
        sem = asyncio.Semaphore(parallel)
        loop = asyncio.get_running_loop()
        # The chunks live as long as the update holds them, in memory of the fetch's own (huge pages
        # where the kernel gives them): a fresh engine's allocator would hand out each 1 MiB chunk as
        # 256 new 4 KiB pages (docs/CODEC.md, "Speed").
        arena = Arena(fresh=True)

        async def one(i: int) -> memoryview:
            async with sem:
                buf = ChunkBuffer(manifest.chunks[i].size, arena)
                deadline = loop.time() + timeout
                while True:
                    try:
                        await client.call_chunk(url, aid, i, buf)
                        break
                    except NotYet:  # still on its way to a parent that is receiving it: ask again
                        if loop.time() >= deadline:
                            raise
                        await asyncio.sleep(NOT_YET_RETRY_S)
                    except WrongSize as exc:
                        raise short_answer(exc, f"chunk {i} of {aid} from {url}") or exc
                data = buf.take()
                verify_chunk(manifest, i, data)
            if on_chunk is not None:  # outside the semaphore: the next fetch starts meanwhile
                await on_chunk(i, data)
            return data

        wanted = range(len(manifest.chunks)) if need is None else need
        tasks = [asyncio.ensure_future(one(i)) for i in wanted]
        try:
            got = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    chunks: list[Any] = [None] * len(manifest.chunks)
    for i, data in zip(wanted, got):
        chunks[i] = data
    return manifest, chunks


async def _checked_manifest(client: Any, url: str, aid: str, public_key: Any) -> Any:
    manifest = await client.call_manifest(url, aid)
    manifest.verify(public_key)
    if manifest.artifact_id != aid:
        raise P2PSyncError(f"{url} served the manifest of {manifest.artifact_id} for {aid}")
    return manifest


async def fetch_manifest(url: str, token: str, node_id: str, aid: str, public_key: Any, timeout: float,
                         tls_dir: str = "", client: Any = None) -> Any:
    """The manifest of artifact ``aid`` at ``url``, signature checked."""
    async with _using(client, token, node_id, timeout, 1, tls_dir) as client:
        return await _checked_manifest(client, url, aid, public_key)


def short_answer(exc: WrongSize, what: str) -> TruncatedError | None:
    """A :class:`TruncatedError` if the peer answered completely, but with fewer bytes than the signed size.

    A connection cut mid-body stays :class:`PeerUnreachable` (the answer never completed: trying
    again may work); a complete, well-formed answer that is shorter than the chunk the manifest
    signs is truncated content, and asking that peer again gives the same."""
    if exc.got >= exc.expected:
        return None
    return TruncatedError(f"{what}: the peer's answer has {exc.got} of the {exc.expected} bytes the signed "
                          "manifest gives it")


async def fetch_version_manifest(url: str, token: str, node_id: str, version: int, public_key: Any,
                                 timeout: float, tls_dir: str = "", client: Any = None) -> Any:
    """The signed manifest of an artifact reaching ``version`` (a delta, else a snapshot), signature checked."""
    from p2psync.transport.client import NotHeld

    async with _using(client, token, node_id, timeout, 1, tls_dir) as client:
        try:
            m = await client.call_version_manifest(url, version, "delta")
        except NotHeld:
            m = await client.call_version_manifest(url, version, "snapshot")
    m.verify(public_key)
    return m


async def fetch_plan(url: str, token: str, node_id: str, current: int | None, target: int, timeout: float,
                     tls_dir: str = "", client: Any = None, in_flight: bool = False) -> list[Any]:
    """The artifacts to apply, in order, to go from ``current`` to ``target`` with what ``url`` holds
    (``in_flight``: or is receiving: a cut-through node lists those and serves each chunk once it
    arrived)."""
    from p2psync.store import plan_catchup

    async with _using(client, token, node_id, timeout, 1, tls_dir) as client:
        cat = await client.call_head(url)
    held = [a for a in cat.artifacts if a.complete or in_flight]
    try:
        return plan_catchup(current, target, held)
    except P2PSyncError as exc:
        newest = max((a.target for a in held), default=None)
        what = "listed" if in_flight else "complete"
        raise TransferInfoError("update_info.version", f"{exc} at {url} (the newest {what} version there is "
                                f"{newest})") from None


async def check_key(url: str, token: str, node_id: str, public_key: Any, timeout: float, tls_dir: str = "",
                    client: Any = None) -> int:
    """Verify the manifest of the newest complete artifact ``url`` lists against ``public_key``; its version.

    What an init without ``version`` checks, so that a wrong key is refused at init, not at the
    first update."""
    async with _using(client, token, node_id, timeout, 1, tls_dir) as client:
        cat = await client.call_head(url)
        held = [a for a in cat.artifacts if a.complete]
        if not held:
            raise TransferInfoError("init_info.url", f"{url} lists no complete artifact yet, so the trainer's key "
                                    "cannot be checked against a signed manifest (init again once it has one)")
        newest = max(held, key=lambda a: (a.target, a.kind == "delta"))  # a delta's manifest is the smaller
        manifest = await client.call_manifest(url, newest.id)
    try:
        manifest.verify(public_key)
    except SignatureError as exc:
        raise SignatureError(f"init_info.public_key does not verify {url}'s artifact {newest.id}: {exc}") from None
    return int(manifest.target_version)

async def decoding(stream: Streamed, source: Callable[[OnChunk], Awaitable[T]], threads: int,
                   cpus: set[int] | None = None) -> T:
    """``await source(on_chunk)`` (a fetch that calls ``on_chunk(i, data)`` with each chunk once
    its hash matched), each chunk decoded into ``stream`` on ``threads`` worker threads as it
    arrives. Returns once every decode ended; raises the fetch's failure, else the first decode's
    (with every decode in flight ended first)."""
    with workers.pool(threads, cpus, "p2psync-decode") as pool:
        pipe = Pipeline(stream.add, max(1, threads) + 2, pool)
        try:
            got = await source(pipe.submit)
        except BaseException:
            try:
                await pipe.drain()
            except BaseException:  # noqa: BLE001 - the fetch's failure is the one raised
                pass
            raise
        await pipe.drain()
    return got


def fetch_decoding(fetching: Callable[..., Any], info: Any, public_key: Any, aid: str, manifest: Manifest,
                   need: list[int] | None, stream: Streamed | None) -> list[Any]:
    """The chunks of ``aid`` this rank needs (``need``; the others None), fetched from the parent of
    ``info`` (the accepted init) through ``fetching(call)`` (the backend's kept client), each checked
    against ``manifest``; with ``stream``, each decoded into it as it arrives."""
    def fetch(client: Any, on_chunk: OnChunk | None = None) -> Any:
        return fetch_artifact(info.url, info.token, info.node_id, aid, public_key, info.timeout,
                              tls_dir=info.tls_dir, manifest=manifest, need=need, on_chunk=on_chunk, client=client)

    if stream is None:
        return list(fetching(fetch)[1])
    live = stream.live
    return list(fetching(lambda c: decoding(stream, lambda on_chunk: fetch(c, on_chunk), live.threads,
                                            live.cpus))[1])
