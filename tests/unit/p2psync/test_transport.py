"""HTTP API in process (aiohttp test server): auth, limits, malformed input, Range, cut-through,
events; the client and multi-stream fetcher against a corrupting and a good peer; parent choice."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families
import torch
from aiohttp.test_utils import TestClient, TestServer

from p2psync import keys
from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_snapshot
from p2psync.config import NodeConfig, TestingConfig
from p2psync.state import ModelState
from p2psync.store import ArtifactInfo, VersionStore
from p2psync.transport.board import Board
from p2psync.transport.client import PeerClient
from p2psync.transport.fetch import Upstream, fetch_chunks
from p2psync.transport.messages import Catalogue
from p2psync.transport.metrics import Metrics
from p2psync.transport.parents import ParentSet
from p2psync.transport.server import Server
from p2psync.transport.view import HeadSignal

TOKEN = "unit-test-token-42"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def artifact():
    priv = keys.generate()
    g = torch.Generator().manual_seed(3)
    state = ModelState({"w": torch.randn(150_000, generator=g).to(torch.bfloat16)})
    enc = encode_snapshot(state, CodecOptions(chunk_size=64 << 10))
    m = build_manifest(enc, model_id="m", target_version=0, chunk_size=64 << 10, private_key=priv)
    assert len(enc.chunks) >= 4
    return priv, m, enc.chunks


class View:
    """The parts of a node the server needs, over a real store."""

    def __init__(self, tmp_path, priv, corrupt: bool = False) -> None:
        self.config = replace(NodeConfig(id="n", cluster_token=TOKEN, data_dir=str(tmp_path), role="trainer",
                                         trainer_public_key="x"),
                              testing=TestingConfig(corrupt_served_chunks=corrupt))
        self.config.limits.max_body_bytes = 1024
        self.config.limits.chunk_wait_timeout = 0.5
        self.store = VersionStore.open(tmp_path, priv.public_key())
        self.board = Board()
        self.metrics = Metrics()
        self.heads = HeadSignal()
        self.children: dict[str, str] = {}

    def catalogue(self) -> Catalogue:
        arts = tuple(self.store.catalogue())
        return Catalogue("n", "r", None, None, max((a.target for a in arts), default=None), arts)

    def status(self) -> dict:
        return {"node": "n"}

    def note_child(self, node_id: str, address: str) -> None:
        self.children[node_id] = address

    def extra_routes(self) -> list:
        return []


def _fill(view, m, chunks):
    view.store.add_manifest(m)
    for i, c in enumerate(chunks):
        view.store.put_chunk(m.artifact_id, i, c)


def run(coro):
    return asyncio.run(coro)


async def _client(view) -> TestClient:
    client = TestClient(TestServer(Server(view).app()))
    await client.start_server()
    return client


def test_auth_limits_and_malformed_requests(tmp_path, artifact):
    priv, m, chunks = artifact

    async def go():
        view = View(tmp_path, priv)
        _fill(view, m, chunks)
        c = await _client(view)
        try:
            base = f"/v1/artifacts/{m.artifact_id}"
            assert (await c.get("/v1/head")).status == 401
            assert (await c.get("/v1/head", headers={"Authorization": "Bearer nope"})).status == 401
            assert (await c.get("/no/such/route")).status == 401  # auth before routing
            assert (await c.get("/metrics")).status == 401
            assert (await c.post("/v1/head", data=b"x" * 4096, headers=AUTH)).status == 413
            assert (await c.get(f"{base}/chunks/x", headers=AUTH)).status == 400
            assert (await c.get(f"{base}/chunks/-1", headers=AUTH)).status == 400
            assert (await c.get("/v1/artifacts/a%20b/manifest", headers=AUTH)).status == 400
            assert (await c.get("/v1/versions/seven/manifest", headers=AUTH)).status == 400
            assert (await c.get("/v1/versions/0/manifest?kind=other", headers=AUTH)).status == 400
            assert (await c.get(f"{base}/chunks/0", headers={**AUTH, "Range": "bytes=5-2,7-9"})).status == 400
            assert (await c.get("/v1/artifacts/delta-1-2-00/manifest", headers=AUTH)).status == 404
            # ...and the node still serves good requests.
            r = await c.get("/v1/head", headers={**AUTH, "X-P2PSync-Node": "kid"})
            assert r.status == 200
            assert Catalogue.loads(await r.read()).artifacts[0].id == m.artifact_id
            assert view.children == {"kid": view.children["kid"]}
            r = await c.get("/metrics", headers=AUTH)
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in text_string_to_metric_families(await r.text()) for s in fam.samples}
            assert samples[("p2psync_requests_total",
                            (("code", "401"), ("node", "n"), ("region", "default"), ("role", "trainer")))] == 4
        finally:
            await c.close()

    run(go())


def test_range_requests_resume_a_chunk(tmp_path, artifact):
    priv, m, chunks = artifact

    async def go():
        view = View(tmp_path, priv)
        _fill(view, m, chunks)
        c = await _client(view)
        try:
            url = f"/v1/artifacts/{m.artifact_id}/chunks/1"
            r = await c.get(url, headers=AUTH)
            assert r.status == 200 and await r.read() == chunks[1]
            r = await c.get(url, headers={**AUTH, "Range": "bytes=1000-"})
            assert r.status == 206 and await r.read() == chunks[1][1000:]
            assert r.headers["Content-Range"] == f"bytes 1000-{len(chunks[1]) - 1}/{len(chunks[1])}"
            r = await c.get(url, headers={**AUTH, "Range": "bytes=10-19"})
            assert await r.read() == chunks[1][10:20]
            r = await c.get(url, headers={**AUTH, "Range": "bytes=-5"})
            assert await r.read() == chunks[1][-5:]
            assert (await c.get(url, headers={**AUTH, "Range": f"bytes={len(chunks[1])}-"})).status == 416
            r = await c.get("/v1/versions/0/manifest?kind=snapshot", headers=AUTH)
            assert r.status == 200 and await r.read() == m.to_bytes()
        finally:
            await c.close()

    run(go())


def test_cut_through_serves_a_chunk_as_soon_as_it_is_verified(tmp_path, artifact):
    priv, m, chunks = artifact

    async def go():
        view = View(tmp_path, priv)
        view.store.add_manifest(m)
        view.board.begin(m.artifact_id, len(m.chunks))
        c = await _client(view)
        try:
            url = f"/v1/artifacts/{m.artifact_id}/chunks/2"
            waiting = asyncio.create_task(c.get(url, headers=AUTH), name="waiter")
            await asyncio.sleep(0.05)
            assert not waiting.done()
            view.store.put_chunk(m.artifact_id, 2, chunks[2])
            view.board.arrived(m.artifact_id, 2)
            r = await waiting
            assert r.status == 200 and await r.read() == chunks[2]
            # A chunk that does not arrive within chunk_wait_timeout: 503, the child retries elsewhere.
            r = await c.get(f"/v1/artifacts/{m.artifact_id}/chunks/3", headers=AUTH)
            assert r.status == 503
        finally:
            await c.close()

    run(go())


def test_event_stream_pushes_each_new_catalogue(tmp_path, artifact):
    priv, m, chunks = artifact

    async def go():
        view = View(tmp_path, priv)
        view.config.limits.sse_keepalive = 0.05
        c = await _client(view)
        client = PeerClient(c.session, stall_timeout=5, sse_timeout=5)
        c.session.headers.update(AUTH)
        try:
            stream = client.call_events(str(c.make_url("")).rstrip("/"))
            first = await anext(stream)
            assert first.head is None
            _fill(view, m, chunks)
            view.heads.bump()
            second = await anext(stream)
            assert second.head == 0 and second.artifacts[0].id == m.artifact_id
            await stream.aclose()
        finally:
            await c.close()

    run(go())


def test_fetch_drops_corrupt_chunks_and_fails_over_to_a_good_peer(tmp_path, artifact):
    priv, m, chunks = artifact

    async def go():
        bad_view, good_view = View(tmp_path / "bad", priv, corrupt=True), View(tmp_path / "good", priv)
        _fill(bad_view, m, chunks)
        _fill(good_view, m, chunks)
        bad, good = await _client(bad_view), await _client(good_view)
        bad_url, good_url = (str(x.make_url("")).rstrip("/") for x in (bad, good))
        mine = VersionStore.open(tmp_path / "mine", priv.public_key())
        mine.add_manifest(m)
        metrics = Metrics()
        client = await PeerClient.create(TOKEN, "me", stall_timeout=5, sse_keepalive=1, parallel_streams=3)
        up = Upstream(client, ParentSet([bad_url, good_url], 0.01, 60), metrics, lambda: None)
        got: list[int] = []

        async def on_chunk(i: int, data: bytes) -> None:
            assert data == chunks[i]
            got.append(i)

        try:
            await fetch_chunks(up, mine, Board(), m, 3, on_chunk)
        finally:
            await client.close()
            await bad.close()
            await good.close()
        assert sorted(got) == list(range(len(chunks)))
        assert mine.artifacts[m.artifact_id].complete
        assert metrics.get("p2psync_bad_chunks_total", peer=bad_url) >= 1
        assert up.parents.avoided(up.now()) == [bad_url]

    run(go())


def test_parent_set_rests_are_jittered_below_their_doubling_ceiling():
    """Children of one failed parent do not all come back at one moment: each rest is drawn in
    [ceiling / 2, ceiling], the ceiling doubling per failure in a row up to max_rest."""
    import random

    rests: dict[int, list[float]] = {}
    for seed in range(40):
        ps = ParentSet(["http://a", "http://b"], retry_after=1.0, avoid_seconds=100.0, max_rest=4.0,
                       rng=random.Random(seed))
        for n in range(4):
            ps.failed("http://a", 0.0)
            rests.setdefault(n, []).append(ps._down_until["http://a"])
    for n, ceiling in enumerate((1.0, 2.0, 4.0, 4.0)):
        assert all(ceiling / 2 <= r <= ceiling for r in rests[n]), (n, rests[n])
        assert max(rests[n]) - min(rests[n]) > ceiling / 4  # spread, not one moment


def test_parent_set_fails_over_in_order_and_backs_off():
    ps = ParentSet(["http://a", "http://b", "http://c"], retry_after=1.0, avoid_seconds=100.0, jitter=0.0)
    assert ps.current(0) == "http://a"
    ps.failed("http://a", 0)
    assert ps.current(0.5) == "http://b"
    assert ps.current(1.5) == "http://a"  # rested, preferred again
    ps.failed("http://a", 2)  # second failure in a row: rests twice as long
    assert ps.current(3.5) == "http://b"
    assert ps.current(4.1) == "http://a"
    ps.corrupt("http://b", 5)
    ps.failed("http://a", 5)
    assert ps.current(5.1) == "http://c"
    assert ps.avoided(5.1) == ["http://b"]
    ps.failed("http://c", 5.1)
    assert ps.current(5.2) == "http://c" and ps.wait_time(5.2) > 0  # everyone out: soonest back


def test_catalogue_rejects_malformed_input():
    from p2psync.errors import CodecError

    ok = Catalogue("n", "r", 1, "f" * 32, 2, (ArtifactInfo("delta-1-2-x", "delta", 1, 2, 10, False),), (0,))
    assert Catalogue.loads(ok.dumps()) == ok
    for bad in ("nope", "{}", '{"format": 1}', ok.dumps().replace('"delta"', '"weird"')):
        with pytest.raises(CodecError):
            Catalogue.loads(bad)


def test_chunk_cut_off_midway_resumes_from_another_peer_and_oversized_answers_are_refused(tmp_path, artifact):
    """The receive buffer keeps exactly what arrived; the next peer continues with Range; a peer
    announcing more bytes than the chunk has is refused before anything lands in the buffer."""
    from aiohttp import web

    from p2psync.errors import PeerUnreachable
    from p2psync.transport.client import ChunkBuffer

    priv, m, chunks = artifact
    data = chunks[1]
    half = len(data) // 2

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[:half])
        await asyncio.sleep(0.05)  # let the first half reach the client, then drop the connection
        request.transport.abort()
        return resp

    async def oversized(request: web.Request) -> web.Response:
        return web.Response(body=data + b"x" * 10)

    async def go():
        app = web.Application()
        app.router.add_get("/cut/v1/artifacts/{aid}/chunks/{i}", cut)
        app.router.add_get("/big/v1/artifacts/{aid}/chunks/{i}", oversized)
        odd = TestClient(TestServer(app))
        await odd.start_server()
        view = View(tmp_path, priv)
        _fill(view, m, chunks)
        good = await _client(view)
        client = await PeerClient.create(TOKEN, "me", stall_timeout=5, sse_keepalive=1, parallel_streams=2)
        base = str(odd.make_url("")).rstrip("/")
        try:
            buf = ChunkBuffer(len(data))
            with pytest.raises(PeerUnreachable):
                await client.call_chunk(base + "/cut", m.artifact_id, 1, buf)
            assert 0 < buf.got <= half and bytes(buf.buf[:buf.got]) == data[:buf.got]
            await client.call_chunk(str(good.make_url("")).rstrip("/"), m.artifact_id, 1, buf)
            assert bytes(buf.take()) == data

            fresh = ChunkBuffer(len(data))
            fresh.buf[:] = bytes(len(data))
            with pytest.raises(PeerUnreachable, match="announced"):
                await client.call_chunk(base + "/big", m.artifact_id, 1, fresh)
            assert fresh.got == 0 and not any(fresh.buf)
        finally:
            await client.close()
            await good.close()
            await odd.close()

    run(go())


def test_a_manifest_that_arrives_in_pieces_is_read_whole(artifact):
    """A manifest answer sent in several writes with pauses between them (a large one over TLS arrives
    record by record) is read to its end, not cut at what had arrived when the first read returned."""
    from aiohttp import web

    _, m, _ = artifact
    raw = m.to_bytes()

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = len(raw)
        await resp.prepare(request)
        for k in range(0, len(raw), 40):
            await resp.write(raw[k:k + 40])
            await asyncio.sleep(0.005)
        return resp

    async def go():
        app = web.Application()
        app.router.add_get("/v1/artifacts/{aid}/manifest", slow)
        odd = TestClient(TestServer(app))
        await odd.start_server()
        client = await PeerClient.create(TOKEN, "me", stall_timeout=5, sse_keepalive=1, parallel_streams=1)
        try:
            got = await client.call_manifest(str(odd.make_url("")).rstrip("/"), m.artifact_id)
            assert got.to_bytes() == raw
        finally:
            await client.close()
            await odd.close()

    run(go())
