"""Push of small artifacts down a child's open event stream (``GET /v1/stream``).

Why. Pulling an artifact costs a child at least two round trips to its parent
after it hears of it (manifest, then chunks), on top of the half round trip of
the announcement itself. Over a WAN link with 100 ms of one-way delay that is
0.5 s for a delta that takes 70 ms to transmit, and a tree pays it once per hop.
A parent that *pushes* a new delta's manifest and chunks on the stream the
child already holds open costs only the one-way delay plus the transmission
time (and, with cut-through, a relay forwards each chunk the moment it verified
it), which is what a delta of a few MB needs to approach the link's bound.

Trust is unchanged: a child verifies a pushed manifest's signature before it
stores it and every pushed chunk against that manifest's hashes before it
stores, serves or decodes it, exactly as it does pulled ones. A parent that
pushes anything that does not verify is reported and avoided like one that
served it. Push is an optimisation on top of pull: whatever did not arrive by
push (stream broken, parent switched, artifact larger than the limit, a push
that stalls) is pulled as before, and only artifacts announced after the stream
opened are pushed (the child pulls what existed before).

Wire format. ``GET /v1/stream?push=N`` (``N``: the largest artifact payload the
child wants pushed; 0 = announcements only) answers ``200`` with
``Content-Type: application/x-p2psync-stream`` and a sequence of frames, each
``u8 kind | u32 length (big endian) | payload``:

- ``0`` keep-alive (empty), every ``limits.sse_keepalive`` seconds of silence;
- ``1`` catalogue: the JSON of :class:`~p2psync.transport.messages.Catalogue`,
  one at once and one per change (as the ``head`` events of ``/v1/events``);
- ``2`` manifest: :meth:`Manifest.to_bytes` of a delta about to be pushed, sent
  *before* the catalogue that first lists it, so the child never asks for it;
- ``3`` chunk: ``u16 id length | artifact id | u32 index | chunk bytes``, in
  index order after its manifest;
- ``4`` padding (ignored by the child), only when the child asked for it with
  ``&warm=W`` (bytes): right after the first catalogue, at most W bytes in all
  (capped by the parent's ``limits.stream_warmup_bytes``), frames of at most
  ``MAX_PADDING_FRAME`` bytes, cut short when the catalogue changes (a delta
  never waits behind padding) and resumed after that catalogue (and the delta it
  pushes) until W bytes in all. A parent that does not know ``warm`` ignores it.

TCP windows. A new connection's windows start small: the sender's congestion
window at ten segments, and the receiver's advertised window at a few segments,
growing as the application reads. Each grows about twofold per round trip while
data flows, and on a stream that has carried only catalogues they never grew.
The first delta pushed on such a stream then takes several round trips of the
link instead of one: on the WAN testbed a 1.78 MB push over a 200 Mbit/s link
with 100 ms of one-way delay took 1.6-4.4 s on a fresh stream and 0.17-0.36 s
after 2-8 MB of padding had opened the windows (docs/benchmarks/wan.md, "TCP
windows"). How much padding: a BBR sender paces a burst at the bottleneck rate it
measured while the padding flowed, and it measures the full rate only after
several round trips at it, so a few bandwidth-delay products of padding are
needed (200 Mbit/s x 200 ms round trip: 5 MB). On the testbed's raw TCP
(``tools/wan/tcp_windows.py``), the 1.78 MB burst to ``ap-south`` took 0.313 s
(median of 7) after 4 MiB of padding, 0.237 s after 16 MiB and 0.179 s (1.05x
the link's bound, 5 runs) after 32 MiB, the default. The padding is paid once
per stream (a parent switch opens a new one). It only opens the windows if the
child reads it at once: the receiver's window grows with what its application
reads per round trip, and a BBR sender keeps the rate it measured. Padded while every node of the testbed was still
compiling its codec and pulling its first snapshot, the stream to ``ap-south``
kept a 120 KB receive window and a 4.7 Mbit/s estimate, and a delta took 1.6-2 s
on it. So a child that is not yet settled (codec warm, weights held, caught up)
opens its stream unpadded and re-opens it, padded, once it is. What keeps the congestion window open across the idle seconds between
steps is the sender's ``net.ipv4.tcp_slow_start_after_idle = 0`` (Linux
otherwise restarts slow start after one retransmission timeout of silence), a
host setting: the node logs a hint at start when it is 1.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from p2psync.artifact import Manifest
from p2psync.errors import CodecError, IntegrityError, PeerUnreachable
from p2psync.transport.messages import API, Catalogue, valid_artifact_id
from p2psync.transport.refusals import from_exception, from_response

if TYPE_CHECKING:
    from p2psync.transport.client import PeerClient
    from p2psync.transport.view import Responder

logger = logging.getLogger(__name__)

CONTENT_TYPE = "application/x-p2psync-stream"
KEEPALIVE, CATALOGUE, MANIFEST, CHUNK, PADDING = 0, 1, 2, 3, 4
_HEADER = struct.Struct(">BI")
_CHUNK_ID = struct.Struct(">H")
_CHUNK_INDEX = struct.Struct(">I")
_WRITE_PIECE = 256 << 10
MAX_CATALOGUE = 16 << 20
MAX_MANIFEST = 80 << 20
MAX_PADDING_FRAME = 1 << 20
PAD_WRITE = 256 << 10
"""Padding frames a parent writes (at most :data:`MAX_PADDING_FRAME`, what a child accepts)."""
PAD_UNSENT = 128 << 10
"""While it pads, a parent keeps at most about this much of the stream unsent in the kernel."""
_PADDING = bytes(MAX_PADDING_FRAME)


class PushUnsupported(PeerUnreachable):
    """The parent has no ``/v1/stream`` (an older node): use ``/v1/events``."""


# --- frames -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogueFrame:
    catalogue: Catalogue


@dataclass(frozen=True)
class ManifestFrame:
    manifest: Manifest


@dataclass(frozen=True)
class ChunkFrame:
    artifact_id: str
    index: int
    data: memoryview


def _header(kind: int, length: int) -> bytes:
    return _HEADER.pack(kind, length)


def chunk_prefix(aid: str, index: int, size: int) -> bytes:
    """Frame header plus the id and index that precede a chunk's bytes."""
    raw = aid.encode()
    return _header(CHUNK, _CHUNK_ID.size + len(raw) + _CHUNK_INDEX.size + size) + _CHUNK_ID.pack(len(raw)) + raw \
        + _CHUNK_INDEX.pack(index)


# --- server side --------------------------------------------------------------------------------
async def serve_stream(server: Responder, request: web.Request) -> web.StreamResponse:
    """``GET /v1/stream``: catalogues as they change, and new small deltas pushed whole."""
    view, limits = server.view, server.limits
    try:
        asked = int(request.query.get("push", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="push must be an integer (bytes)") from None
    if asked < 0:
        raise web.HTTPBadRequest(text="push must be >= 0")
    push_max = min(asked, limits.push_bytes)
    try:
        warm = int(request.query.get("warm", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="warm must be an integer (bytes)") from None
    if warm < 0:
        raise web.HTTPBadRequest(text="warm must be >= 0")
    warm = min(warm, limits.stream_warmup_bytes)
    heads = view.heads
    resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-cache"})
    seq = -1
    known: set[str] | None = None  # artifacts listed when the stream opened: the child pulls those
    try:
        await resp.prepare(request)
        while not heads.closed:
            if heads.seq == seq:
                await server.write(resp, _header(KEEPALIVE, 0))
            else:
                seq = heads.seq
                cat = view.catalogue()
                fresh = [] if known is None else list({a.id: a for a in cat.artifacts if a.id not in known
                                                       and a.kind == "delta" and 0 < a.bytes <= push_max}.values())
                known = {a.id for a in cat.artifacts} | (known or set())
                pushing = []
                with ExitStack() as forwarding:  # counted on the board until its chunks were written
                    for a in fresh:
                        art = view.store.artifacts.get(a.id)
                        if art is not None:
                            forwarding.enter_context(view.board.pushing(a.id))
                            body = art.manifest.to_bytes()
                            await server.write(resp, _header(MANIFEST, len(body)) + body)
                            pushing.append(art.manifest)
                    text = cat.dumps().encode()
                    await server.write(resp, _header(CATALOGUE, len(text)) + text)
                    if warm:
                        # Padding gives way to a catalogue that moved (and to the delta it may push)
                        # and resumes after it, until the child has all it asked for.
                        opened = seq
                        warm -= await _pad(server, resp, warm, lambda: heads.seq != opened,
                                           request.transport.get_extra_info("socket") if request.transport else None)
                    for m in pushing:
                        await _push_chunks(server, resp, m)
                if heads.seq != seq:
                    continue  # the catalogue moved while we pushed: say so at once
            await heads.wait(seq, limits.sse_keepalive)
    except ConnectionError:  # reset, broken pipe, or aiohttp's 'Connection lost' while draining
        pass  # the child went away
    except TimeoutError:
        server.cut(request)
    return resp


async def _pad(server: Responder, resp: web.StreamResponse, total: int,
               moved: Callable[[], bool] = lambda: False, sock: Any = None) -> int:
    """Up to ``total`` bytes of padding frames: open the stream's TCP windows (module doc).
    Stops early once ``moved()`` (the catalogue changed, and the child takes less than it asked
    for as complete). Padding is written :data:`PAD_WRITE` bytes at a time with at most about
    :data:`PAD_UNSENT` of it left unsent in the kernel (``sock``: the stream's socket), so a delta
    announced meanwhile waits behind a few hundred KB of padding, not behind what a large send
    buffer holds (seconds on a slow link). Returns the bytes sent."""
    sent = 0
    with _unsent_capped(sock, PAD_UNSENT):
        while sent < total and not moved():
            n = min(PAD_WRITE, total - sent)
            await server.write(resp, _header(PADDING, n))
            await server.write(resp, memoryview(_PADDING)[:n])
            sent += n
    server.view.metrics.inc("p2psync_stream_padding_bytes_total", sent)
    return sent


@contextmanager
def _unsent_capped(sock: Any, limit: int) -> Iterator[None]:
    """Linux's ``TCP_NOTSENT_LOWAT`` on ``sock`` while inside, then the host's default again
    (nothing where the socket or the option is missing: the padding is then only less prompt
    to give way)."""
    opt = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    capped = False
    if sock is not None and opt is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, opt, limit)
            capped = True
        except OSError:
            pass
    try:
        yield
    finally:
        if capped:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, 0)  # 0: the host's net.ipv4.tcp_notsent_lowat
            except OSError:
                pass


async def _push_chunks(server: Responder, resp: web.StreamResponse, manifest: Manifest) -> None:
    """Every chunk of ``manifest`` in order, each as soon as this node verified it (cut-through);
    stops early (the child pulls the rest) if this node's own fetch is abandoned or stalls."""
    view, limits = server.view, server.limits
    store, board = view.store, view.board
    aid = manifest.artifact_id
    for i, ref in enumerate(manifest.chunks):
        if not store.has_chunk(aid, i):
            if not board.active(aid):
                return
            await board.wait(aid, i, limits.chunk_wait_timeout)
            if not store.has_chunk(aid, i):
                return
        try:
            data = store.cached_chunk(aid, i)
            if data is None:
                data = await asyncio.to_thread(store.read_chunk, aid, i)
        except (IntegrityError, KeyError, OSError) as exc:
            logger.warning("push of %s stopped at chunk %d: %s", aid, i, exc)
            return
        if view.config.testing.serve_delay:
            await asyncio.sleep(view.config.testing.serve_delay)
        if view.config.testing.corrupt_served_chunks:
            buf = bytearray(data)
            buf[len(buf) // 2] ^= 0xFF
            data = bytes(buf)
        body = memoryview(data)
        await server.write(resp, chunk_prefix(aid, i, len(body)))
        for off in range(0, len(body), _WRITE_PIECE):
            await server.write(resp, body[off:off + _WRITE_PIECE])
        view.metrics.inc("p2psync_bytes_out_total", len(body))
        view.metrics.inc("p2psync_chunks_out_total")
        view.metrics.inc("p2psync_chunks_pushed_total")


# --- client side --------------------------------------------------------------------------------
async def read_stream(client: PeerClient, url: str, push_max: int,
                      chunk_size: Callable[[str, int], int | None], warm: int = 0,
                      ) -> AsyncIterator[CatalogueFrame | ManifestFrame | ChunkFrame]:
    """Frames from a parent's ``/v1/stream`` (structure checked; signatures and hashes not: the
    caller verifies before it stores). ``chunk_size(artifact id, index)`` is the size the pushed
    manifest gives that chunk, or None if no pushed manifest announced it: a chunk frame of any
    other size, or for anything not announced, is refused before its bytes are read. ``warm``:
    bytes of padding to ask for (module doc, "TCP windows"); more than that is refused. Every
    failure is :class:`PeerUnreachable`."""
    warm = max(0, int(warm))
    path = f"{API}/stream?push={max(0, int(push_max))}" + (f"&warm={warm}" if warm else "")
    limits = {KEEPALIVE: 0, CATALOGUE: MAX_CATALOGUE, MANIFEST: MAX_MANIFEST, PADDING: MAX_PADDING_FRAME}
    try:
        async with client._session.get(url + path, timeout=client._timeout(client.sse_timeout)) as resp:
            if resp.status == 404:
                raise PushUnsupported(url, "stream: HTTP 404 (no push support)")
            if resp.status != 200:
                raise await from_response(url, "stream", resp) or PeerUnreachable(url, f"stream: HTTP {resp.status}")
            if resp.headers.get("Content-Type", "").split(";")[0].strip() != CONTENT_TYPE:
                raise PeerUnreachable(url, "stream: not a p2psync stream")
            content = resp.content
            while True:
                try:
                    kind, length = _HEADER.unpack(await content.readexactly(_HEADER.size))
                    if kind == CHUNK:
                        yield await _read_chunk(content, url, length, chunk_size)
                        continue
                    if kind not in limits:
                        raise PeerUnreachable(url, f"stream: unknown frame kind {kind}")
                    if length > limits[kind]:
                        raise PeerUnreachable(url, f"stream: {length}-byte frame of kind {kind} exceeds its limit")
                    if kind == PADDING:
                        warm -= length
                        if warm < 0:
                            raise PeerUnreachable(url, "stream: more padding than asked for")
                    payload = await content.readexactly(length) if length else b""
                except asyncio.IncompleteReadError:
                    raise PeerUnreachable(url, "stream closed") from None
                try:
                    if kind == CATALOGUE:
                        yield CatalogueFrame(Catalogue.loads(payload))
                    elif kind == MANIFEST:
                        yield ManifestFrame(Manifest.from_bytes(payload))
                except CodecError as exc:
                    raise PeerUnreachable(url, f"stream: {exc}") from None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise from_exception(url, "stream", exc) from None


async def _read_chunk(content: aiohttp.StreamReader, url: str, length: int,
                      chunk_size: Callable[[str, int], int | None]) -> ChunkFrame:
    if length < _CHUNK_ID.size + _CHUNK_INDEX.size:
        raise PeerUnreachable(url, "stream: truncated chunk frame")
    (n,) = _CHUNK_ID.unpack(await content.readexactly(_CHUNK_ID.size))
    rest = length - _CHUNK_ID.size - n - _CHUNK_INDEX.size
    if n > 96 or rest < 0:
        raise PeerUnreachable(url, "stream: malformed chunk frame")
    raw = await content.readexactly(n)
    (index,) = _CHUNK_INDEX.unpack(await content.readexactly(_CHUNK_INDEX.size))
    aid = raw.decode("ascii", "replace")
    if not valid_artifact_id(aid):
        raise PeerUnreachable(url, "stream: chunk frame with a malformed artifact id")
    want = chunk_size(aid, index)
    if want is None:
        raise PeerUnreachable(url, f"stream: chunk {index} of {aid}, which no pushed manifest announced")
    if rest != want:
        raise PeerUnreachable(url, f"stream: chunk {index} of {aid} is {rest} bytes, its manifest says {want}")
    data = bytearray(rest)
    view = memoryview(data)
    got = 0
    while got < rest:  # into one buffer: no join of pieces
        piece = await content.read(min(rest - got, 1 << 20))
        if not piece:
            raise asyncio.IncompleteReadError(bytes(view[:got]), rest)
        view[got:got + len(piece)] = piece
        got += len(piece)
    return ChunkFrame(aid, index, view.toreadonly())


# --- what a child does with pushed frames ------------------------------------------------------
class Pushes:
    """Artifacts whose chunks a parent is pushing to this node, and a way to wait for the next one."""

    def __init__(self, keep: int = 16) -> None:
        self._keep = keep
        self._manifests: dict[str, Manifest] = {}
        self._event = asyncio.Event()

    def expect(self, manifest: Manifest) -> None:
        self._manifests[manifest.artifact_id] = manifest
        while len(self._manifests) > self._keep:
            self._manifests.pop(next(iter(self._manifests)))

    def manifest(self, aid: str) -> Manifest | None:
        return self._manifests.get(aid)

    def arrived(self) -> None:
        ev, self._event = self._event, asyncio.Event()
        ev.set()

    async def wait(self, timeout: float) -> bool:
        """Wait for the next pushed chunk (of any artifact); False after ``timeout`` seconds of none."""
        ev = self._event
        try:
            async with asyncio.timeout(timeout):
                await ev.wait()
        except TimeoutError:
            return False
        return True

