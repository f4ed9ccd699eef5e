"""Pulling verified artifacts into memory from one parent: for engines that apply what they fetch
and keep no store (the vLLM backend's workers).

A :class:`Parent` is the one value that names such a parent: its address, the cluster token, the
identity the client names itself by, its certificate folder loaded once into a
:class:`~p2psync.transport.tls.Tls`, and the trainer's public key every manifest from it is
checked against. Every function here checks what it gets (manifest signatures against that key,
chunk hashes against the signed manifest) and raises a typed
:class:`~p2psync.errors.P2PSyncError`; nothing unverified is returned. Each takes the
:class:`~p2psync.transport.client.PeerClient` to call through (``client``) or opens one for the
call; :class:`Fetcher` keeps one client and its connections between calls, on an event loop of
its own, for callers that are not async (vLLM's workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from p2psync.errors import ConfigError, P2PSyncError, SignatureError, TruncatedError, WrongSize
from p2psync.retry import Backoff

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from p2psync.transport.client import PeerClient
    from p2psync.transport.tls import Tls

T = TypeVar("T")
OnChunk = Callable[[int, memoryview], Awaitable[None]]
"""Called with each chunk (its index and bytes) as soon as its hash matched the signed manifest."""

NOT_YET = Backoff(first=0.05, cap=0.2, jitter=0.5)
"""How often a chunk the parent does not hold yet (it is still receiving it) is asked for again."""


class NoCatchup(P2PSyncError):
    """The parent holds no chain of artifacts from the version held to the one asked for;
    ``newest``: the newest version it lists (None: none)."""

    def __init__(self, message: str, newest: int | None) -> None:
        super().__init__(message)
        self.newest = newest


class NothingPublished(P2PSyncError):
    """The parent lists no complete artifact yet, so nothing signed can be checked against the key."""


def public_key_from(text: str, field: str = "public_key") -> Any:
    """The trainer's Ed25519 public key from PEM text or the path of a PEM file;
    :class:`~p2psync.errors.ConfigError` naming ``field`` if it cannot be read or is another kind."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from p2psync import keys

    if "BEGIN PUBLIC KEY" not in text:
        try:
            return keys.load_public(text)
        except ConfigError as exc:
            raise ConfigError(field, str(exc).removeprefix(f"{exc.field}: ")) from None
    try:
        key = serialization.load_pem_public_key(text.encode())
    except (ValueError, TypeError) as exc:
        raise ConfigError(field, f"PEM text that is not a public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(field, f"not an Ed25519 public key ({type(key).__name__})")
    return key


@dataclass(frozen=True, eq=False)
class Parent:
    """A p2psync node to pull verified artifacts from, with everything a call to it presents.

    Build it with :meth:`create`, once: the certificate folder becomes a :class:`Tls` and the
    key text a key there, and every call after that uses them. Two :class:`Parent` values are
    the same parent only if they are the same object (a new init is a new parent)."""

    url: str
    """The node's address (``https://host:port``), without a trailing slash."""
    token: str
    """The cluster token (``Authorization: Bearer``)."""
    public_key: Any
    """The trainer's Ed25519 public key (a key object)."""
    key_text: str
    """The key as given (PEM text or a file path), to pass on."""
    node_id: str = "engine"
    """The identity named in the child header; a node's own engine is ``<node id>/engine``."""
    tls: Tls | None = None
    """The certificate presented over mutual TLS (None: plain HTTP)."""
    timeout: float = 30.0
    """Seconds the parent may stall before a call fails."""
    parallel: int = field(default=4)
    """Chunk streams fetched at once."""

    @classmethod
    def create(cls, url: str, token: str, public_key: str, node_id: str = "engine", tls_dir: str | Path = "",
               timeout: float = 30.0, prefix: str = "") -> Parent:
        """The parent at ``url``, every value checked; :class:`~p2psync.errors.ConfigError` naming
        the field (``prefix`` + ``url``, ``token``, ``node_id``, ``timeout``, ``tls_dir``, ``public_key``, in
        that order)."""
        from p2psync.transport.tls import Tls

        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{prefix}url", f"must be an http:// or https:// address, got {url!r}")
        for name, value in (("token", token), ("node_id", node_id)):
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{prefix}{name}", f"must be a non-empty string, got {value!r}")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError(f"{prefix}timeout", f"must be a number of seconds > 0, got {timeout!r}")
        tls = None
        if tls_dir:
            if not Path(tls_dir).is_dir():
                raise ConfigError(f"{prefix}tls_dir", f"no such folder: {str(tls_dir)!r} (the certificate folder "
                                  "of the node, e.g. its data_dir/tls)")
            try:
                tls = Tls.for_client(tls_dir)
            except ConfigError as exc:
                raise ConfigError(f"{prefix}tls_dir", str(exc).removeprefix(f"{exc.field}: ")) from None
        elif url.startswith("https://"):
            raise ConfigError(f"{prefix}tls_dir", "missing: an https:// parent takes only mutual TLS; give the "
                              "folder with a certificate of the cluster CA (the node's data_dir/tls)")
        key = public_key_from(public_key, f"{prefix}public_key")
        return cls(url.rstrip("/"), token, key, public_key, node_id, tls, float(timeout))

    @property
    def tls_dir(self) -> str:
        """The certificate folder (empty: plain HTTP)."""
        return str(self.tls.directory) if self.tls is not None and self.tls.directory is not None else ""

    def wire(self) -> dict[str, Any]:
        """The parent as JSON values (what a vLLM worker's ``init_info`` carries)."""
        out: dict[str, Any] = {"url": self.url, "token": self.token, "public_key": self.key_text,
                               "node_id": self.node_id, "timeout": self.timeout}
        if self.tls_dir:
            out["tls_dir"] = self.tls_dir
        return out

    async def client(self) -> PeerClient:
        """A new client for this parent (its caller closes it)."""
        from p2psync.transport.client import PeerClient

        return await PeerClient.create(self.token, self.node_id, stall_timeout=self.timeout, sse_keepalive=1.0,
                                       parallel_streams=self.parallel, tls=self.tls)


@contextlib.asynccontextmanager
async def _using(parent: Parent, client: PeerClient | None) -> AsyncIterator[PeerClient]:
    """``client`` if given (left open), else a client of its own for the block."""
    if client is not None:
        yield client
        return
    async with await parent.client() as own:
        yield own


class Fetcher:
    """Calls to one parent at a time on an event loop of its own, through one client kept between
    calls.

    A client per call cost a thread, an event loop and new mutual-TLS connections every time
    (plan and manifest about 11 ms each on an idle core, more on the one core a vLLM worker is
    bound to); the kept client reuses its connections. The client is replaced when the parent
    changes, and after any failed call; a call without side effects (``retry``) that fails as
    unreachable on a kept client is tried once more on a new one (a parent that restarted closed
    the kept connections)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._client: PeerClient | None = None
        self._parent: Parent | None = None
        self._getting = asyncio.Lock()

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._getting = asyncio.Lock()  # used on that loop only
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="p2psync-fetch", daemon=True).start()
                self._loop = loop
            return self._loop

    async def _get(self, parent: Parent) -> tuple[PeerClient, bool]:
        """The client for ``parent`` and whether it is new."""
        async with self._getting:  # a background connect() and a call must not both build one
            if self._client is not None and self._parent is parent:
                return self._client, False
            await self._drop()
            self._client, self._parent = await parent.client(), parent
            return self._client, True

    async def _drop(self) -> None:
        client, self._client, self._parent = self._client, None, None
        if client is not None:
            await client.close()

    def run(self, parent: Parent, call: Callable[[PeerClient], Awaitable[T]], retry: bool = False) -> T:
        """``await call(client)`` on the fetcher's loop (blocking the caller until it ends)."""
        from p2psync.errors import PeerUnreachable

        async def go() -> T:
            client, new = await self._get(parent)
            try:
                return await call(client)
            except PeerUnreachable:
                await self._drop()
                if not retry or new:
                    raise
            except BaseException:
                await self._drop()
                raise
            client, _ = await self._get(parent)
            try:
                return await call(client)
            except BaseException:
                await self._drop()
                raise

        return asyncio.run_coroutine_threadsafe(go(), self._running()).result()

    def connect(self, parent: Parent) -> None:
        """Open ``parent.parallel`` connections in the background, returning at once: a fetch in
        parallel streams that follows (after the plan and manifest, say) then starts on open
        connections, its TLS handshakes done beside those calls. Failures are left to the fetch."""
        async def go() -> None:
            client, _ = await self._get(parent)
            await client.connect(parent.url, parent.parallel)

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


async def fetch_artifact(parent: Parent, aid: str, manifest: Manifest | None = None, need: list[int] | None = None,
                         on_chunk: OnChunk | None = None, client: PeerClient | None = None
                         ) -> tuple[Manifest, list[Any]]:
    """The manifest (signature checked) and the chunks (hash checked) of artifact ``aid``.

    ``manifest``: already fetched and checked (:func:`fetch_manifest`); ``need``: the chunks to
    fetch (None: every chunk); the others are None in the list returned. A chunk the parent says
    is not there yet (HTTP 503: it is still receiving the artifact) is asked for again, after
    :data:`NOT_YET`'s delays, until ``parent.timeout`` seconds passed. ``on_chunk(i, data)``:
    awaited with each chunk as soon as its hash matched; on any failure the fetches still running
    are cancelled before it is raised."""
    from p2psync.artifact import verify_chunk
    from p2psync.codec.slabs import Arena
    from p2psync.transport.client import ChunkBuffer, NotYet

    async with _using(parent, client) as client:
        if manifest is None:
            manifest = await _checked_manifest(client, parent, aid)
        sem = asyncio.Semaphore(parent.parallel)
        loop = asyncio.get_running_loop()
        # The chunks live as long as the update holds them, in memory of the fetch's own (huge pages
        # where the kernel gives them): a fresh engine's allocator would hand out each 1 MiB chunk as
        # 256 new 4 KiB pages (docs/CODEC.md, "Speed").
        arena = Arena(fresh=True)
        signed = manifest

        async def one(i: int) -> memoryview:
            async with sem:
                buf = ChunkBuffer(signed.chunks[i].size, arena)
                deadline = loop.time() + parent.timeout
                delays = NOT_YET.delays()
                while True:
                    try:
                        await client.call_chunk(parent.url, aid, i, buf)
                        break
                    except NotYet:  # still on its way to a parent that is receiving it: ask again
                        if loop.time() >= deadline:
                            raise
                        await asyncio.sleep(next(delays))
                    except WrongSize as exc:
                        raise short_answer(exc, f"chunk {i} of {aid} from {parent.url}") or exc
                data = buf.take()
                verify_chunk(signed, i, data)
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


async def _checked_manifest(client: PeerClient, parent: Parent, aid: str) -> Manifest:
    manifest = await client.call_manifest(parent.url, aid)
    manifest.verify(parent.public_key)
    if manifest.artifact_id != aid:
        raise P2PSyncError(f"{parent.url} served the manifest of {manifest.artifact_id} for {aid}")
    return manifest


async def fetch_manifest(parent: Parent, aid: str, client: PeerClient | None = None) -> Manifest:
    """The manifest of artifact ``aid``, signature checked."""
    async with _using(parent, client) as client:
        return await _checked_manifest(client, parent, aid)


def short_answer(exc: WrongSize, what: str) -> TruncatedError | None:
    """A :class:`TruncatedError` if the peer answered completely, but with fewer bytes than the signed size.

    A connection cut mid-body stays :class:`PeerUnreachable` (the answer never completed: trying
    again may work); a complete, well-formed answer that is shorter than the chunk the manifest
    signs is truncated content, and asking that peer again gives the same."""
    if exc.got >= exc.expected:
        return None
    return TruncatedError(f"{what}: the peer's answer has {exc.got} of the {exc.expected} bytes the signed "
                          "manifest gives it")


async def fetch_version_manifest(parent: Parent, version: int, client: PeerClient | None = None) -> Manifest:
    """The signed manifest of an artifact reaching ``version`` (a delta, else a snapshot), signature checked."""
    from p2psync.transport.client import NotHeld

    async with _using(parent, client) as client:
        try:
            m = await client.call_version_manifest(parent.url, version, "delta")
        except NotHeld:
            m = await client.call_version_manifest(parent.url, version, "snapshot")
    m.verify(parent.public_key)
    return m


async def fetch_plan(parent: Parent, current: int | None, target: int, client: PeerClient | None = None,
                     in_flight: bool = False) -> list[Any]:
    """The artifacts to apply, in order, to go from ``current`` to ``target`` with what the parent
    holds (``in_flight``: or is receiving: a cut-through node lists those and serves each chunk once
    it arrived); :class:`NoCatchup` if it holds no such chain."""
    from p2psync.store import plan_catchup

    async with _using(parent, client) as client:
        cat = await client.call_head(parent.url)
    held = [a for a in cat.artifacts if a.complete or in_flight]
    try:
        return plan_catchup(current, target, held)
    except P2PSyncError as exc:
        newest = max((a.target for a in held), default=None)
        what = "listed" if in_flight else "complete"
        raise NoCatchup(f"{exc} at {parent.url} (the newest {what} version there is {newest})", newest) from None


async def check_key(parent: Parent, client: PeerClient | None = None) -> int:
    """Verify the manifest of the newest complete artifact the parent lists against its key; its
    version. :class:`NothingPublished` if it lists none."""
    async with _using(parent, client) as client:
        cat = await client.call_head(parent.url)
        held = [a for a in cat.artifacts if a.complete]
        if not held:
            raise NothingPublished(f"{parent.url} lists no complete artifact yet, so the trainer's key cannot be "
                                   "checked against a signed manifest")
        newest = max(held, key=lambda a: (a.target, a.kind == "delta"))  # a delta's manifest is the smaller
        manifest = await client.call_manifest(parent.url, newest.id)
    try:
        manifest.verify(parent.public_key)
    except SignatureError as exc:
        raise SignatureError(f"the trainer's key does not verify {parent.url}'s artifact {newest.id}: {exc}") from None
    return int(manifest.target_version)
