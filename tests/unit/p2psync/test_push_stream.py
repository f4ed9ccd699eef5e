"""The push stream's protocol: bad frames, forged manifests and unasked padding refused; padding as asked."""

from __future__ import annotations

import asyncio
import dataclasses

import pushkit as kit
import pytest
import tlsutil
from aiohttp import web

from p2psync import config, keys
from p2psync.artifact import Manifest
from p2psync.errors import PeerUnreachable
from p2psync.node import Node
from p2psync.transport import push
from p2psync.transport.client import PeerClient

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def setup(tmp_path):
    return kit.make_setup(tmp_path)


# --- a fake parent speaking the stream protocol badly -------------------------------------------
async def _fake_parent(frames: list[bytes]) -> tuple[web.AppRunner, str]:
    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": push.CONTENT_TYPE})
        await resp.prepare(request)
        for f in frames:
            await resp.write(f)
        await asyncio.sleep(0.2)
        return resp

    app = web.Application()
    app.router.add_get("/v1/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _frame(kind: int, body: bytes) -> bytes:
    return push._HEADER.pack(kind, len(body)) + body


async def _read_all(frames: list[bytes], sizes: dict[tuple[str, int], int], warm: int = 0) -> list:
    runner, url = await _fake_parent(frames)
    client = await PeerClient.create(kit.TOKEN, "t", stall_timeout=2.0, sse_keepalive=1.0, parallel_streams=2)
    got = []
    try:
        async for f in push.read_stream(client, url, 1 << 20, lambda aid, i: sizes.get((aid, i)), warm):
            got.append(f)
    finally:
        await client.close()
        await runner.cleanup()
    return got


def test_stream_frames_that_break_the_protocol_are_refused_before_their_bytes_are_kept(setup):
    priv, states, arts = setup
    m, chunks = arts[1]
    aid = m.artifact_id
    sizes = {(aid, 0): len(chunks[0])}
    man = _frame(push.MANIFEST, m.to_bytes())
    cases = {
        "unannounced chunk": [push.chunk_prefix(arts[2][0].artifact_id, 0, len(chunks[0])) + chunks[0]],
        "chunk index past the manifest": [push.chunk_prefix(aid, len(chunks), len(chunks[0])) + chunks[0]],
        "wrong chunk size": [push.chunk_prefix(aid, 0, 10) + b"x" * 10],
        "unknown kind": [_frame(9, b"hello")],
        "oversized catalogue": [push._HEADER.pack(push.CATALOGUE, push.MAX_CATALOGUE + 1)],
        "truncated frame": [push._HEADER.pack(push.MANIFEST, 1000) + b"abc"],
        "not a manifest": [_frame(push.MANIFEST, b"random bytes, not a manifest")],
        "not a catalogue": [_frame(push.CATALOGUE, b"{\"format\": 99}")],
        "padding not asked for": [_frame(push.PADDING, b"\0" * 10)],
        "oversized padding frame": [push._HEADER.pack(push.PADDING, push.MAX_PADDING_FRAME + 1)],
    }
    for name, frames in cases.items():
        with pytest.raises(PeerUnreachable):
            asyncio.run(_read_all([man, *frames], sizes))
    # The well-formed part is delivered as is: the caller verifies signature and hashes.
    with pytest.raises(PeerUnreachable, match="stream closed"):
        asyncio.run(_read_all([man, push.chunk_prefix(aid, 0, len(chunks[0])) + chunks[0]], sizes))


def test_a_pushed_manifest_signed_by_another_key_is_refused_and_nothing_is_stored(tmp_path, setup):
    priv, states, arts = setup
    m, chunks = arts[1]
    forged = dataclasses.replace(m, signature=b"").sign(keys.generate())

    async def go():
        runner, url = await _fake_parent([_frame(push.MANIFEST, forged.to_bytes()),
                                          push.chunk_prefix(forged.artifact_id, 0, len(chunks[0])) + chunks[0]])
        # a plain fake parent
        node = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [url], tls={"enabled": False}))
        try:
            for _ in range(50):
                if node.metrics.total("p2psync_bad_chunks_total"):
                    break
                await asyncio.sleep(0.05)
            assert node.metrics.total("p2psync_bad_chunks_total") >= 1
            assert forged.artifact_id not in node.store.artifacts and node.version is None
        finally:
            await node.close()
            await runner.cleanup()

    asyncio.run(go())


def test_push_limit_is_validated(tmp_path):
    from p2psync.errors import ConfigError

    for bad in (-1, 1.5, True, (1 << 30) + 1):
        with pytest.raises(ConfigError, match="limits.push_bytes"):
            kit.cfg(tmp_path, "n", "relay", ["https://127.0.0.1:1"], limits={"push_bytes": bad}).validate()
    assert isinstance(Manifest, type)


def test_padding_beyond_what_the_child_asked_for_is_refused(setup):
    _, _, arts = setup
    m, _ = arts[1]
    man = _frame(push.MANIFEST, m.to_bytes())
    pad = _frame(push.PADDING, b"\0" * 1000)
    with pytest.raises(PeerUnreachable, match="more padding than asked"):
        asyncio.run(_read_all([pad, pad, man], {}, warm=1500))

    # Up to what was asked: skipped, and the frames after it are delivered.
    async def read() -> list:
        runner, url = await _fake_parent([pad, man])
        client = await PeerClient.create(kit.TOKEN, "t", stall_timeout=2.0, sse_keepalive=1.0, parallel_streams=2)
        got = []
        try:
            async for f in push.read_stream(client, url, 1 << 20, lambda aid, i: None, 1500):
                got.append(f)
        except PeerUnreachable as exc:
            assert "stream closed" in str(exc)
        finally:
            await client.close()
            await runner.cleanup()
        return got

    got = asyncio.run(read())
    assert [type(f) for f in got] == [push.ManifestFrame] and got[0].manifest.artifact_id == m.artifact_id


def test_a_new_stream_is_padded_as_the_child_asked_capped_by_the_parent_and_pushes_still_arrive(tmp_path, setup):
    _, states, arts = setup
    cap = 1 << 20

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer", limits={"stream_warmup_bytes": cap}))
        leaf = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [tr.address],
                                         limits={"stream_warmup_bytes": 3 * cap}))
        plain = await Node.create(kit.cfg(tmp_path, "plain", "rollout", [tr.address],
                                          limits={"stream_warmup_bytes": 0}))
        try:
            await asyncio.sleep(0.5)
            # A node without weights opens its stream unpadded (it would read the padding slowly
            # while it starts), and re-opens it padded once it is warm and caught up.
            assert tr.metrics.total("p2psync_stream_padding_bytes_total") == 0
            await tr.publish(*arts[0])
            for n in (leaf, plain):
                await asyncio.wait_for(n.wait_version(0), 30)
            async with asyncio.timeout(30):
                while tr.metrics.total("p2psync_stream_padding_bytes_total") < cap:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # streams open before the deltas are announced
            for m, chunks in arts[1:]:
                await tr.publish(m, chunks)
            for n in (leaf, plain):
                await asyncio.wait_for(n.wait_version(3), 30)
                assert kit.same(n.state, states[3]) and n.fingerprint == tr.fingerprint
                assert n.metrics.total("p2psync_chunks_pushed_in_total") == sum(len(c) for _, c in arts[1:])
            # One stream each: the leaf asked for 3 MiB and got the parent's cap, the other asked for none.
            assert tr.metrics.total("p2psync_stream_padding_bytes_total") == cap
        finally:
            for n in (plain, leaf, tr):
                await n.close()

    asyncio.run(go())


def test_a_node_whose_kernels_load_before_its_weights_pads_its_stream_before_the_next_delta(
        tmp_path, setup, monkeypatch):
    """Settled is warm kernels and weights held, whichever comes last: a restarted node whose
    codec was ready before its stored weights had loaded must not wait for an apply to pad."""
    from p2psync.store import VersionStore
    from p2psync.transport import warm

    _, _, arts = setup
    cap = 1 << 20

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer", limits={"stream_warmup_bytes": cap}))
        try:
            await tr.publish(*arts[0])
            first = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [tr.address]))
            await asyncio.wait_for(first.wait_version(0), 30)
            await first.close()  # checkpoints version 0 on exit
            padded = tr.metrics.total("p2psync_stream_padding_bytes_total")

            async def instant(**_kw):
                return 0.0
            load = VersionStore.load_state

            def slow_load(store):
                import time
                time.sleep(0.5)  # the weights load after the kernels
                return load(store)
            monkeypatch.setattr(warm, "warm_up_process", instant)
            monkeypatch.setattr(VersionStore, "load_state", slow_load)
            leaf = await Node.create(kit.cfg(tmp_path, "leaf", "rollout", [tr.address]))
            try:
                await asyncio.wait_for(leaf.wait_version(0), 30)
                async with asyncio.timeout(10):  # no new version: only settling can pad it
                    while tr.metrics.total("p2psync_stream_padding_bytes_total") < padded + cap:
                        await asyncio.sleep(0.05)
            finally:
                await leaf.close()
        finally:
            await tr.close()

    asyncio.run(go())


def test_padding_stops_when_the_catalogue_moves_with_little_of_it_left_unsent():
    import socket
    from types import SimpleNamespace

    written: list[int] = []
    counted: list[int] = []
    server = SimpleNamespace(view=SimpleNamespace(metrics=SimpleNamespace(inc=lambda _n, v: counted.append(v))))
    with socket.create_server(("127.0.0.1", 0)) as listener:  # TCP: the option is per TCP socket
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    lowat = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    seen: list[int] = []

    async def write(_resp, data):
        if lowat is not None:
            seen.append(a.getsockopt(socket.IPPROTO_TCP, lowat))
        written.append(len(data))
    server.write = write
    frames = lambda: sum(1 for n in written if n == push.PAD_WRITE)  # noqa: E731
    total = 8 * push.PAD_WRITE
    try:
        assert asyncio.run(push._pad(server, None, total, lambda: frames() >= 3, a)) == 3 * push.PAD_WRITE
        assert counted == [3 * push.PAD_WRITE]
        if lowat is not None:  # capped while padding, the host's default again after
            assert set(seen) == {push.PAD_UNSENT} and a.getsockopt(socket.IPPROTO_TCP, lowat) == 0
        written.clear()
        assert asyncio.run(push._pad(server, None, total + 5)) == total + 5  # nothing moved: all of it
        assert sum(written) == total + 5 + 9 * push._HEADER.size
    finally:
        a.close()
        b.close()


def test_a_malformed_warm_request_is_refused(tmp_path, setup):
    import aiohttp

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer"))
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {kit.TOKEN}"},
                                             connector=tlsutil.client_tls().connector()) as s:
                for bad in ("abc", "-1", "1.5"):
                    async with s.get(f"{tr.address}/v1/stream?push=100&warm={bad}") as resp:
                        assert resp.status == 400, bad
                        assert "warm" in await resp.text()
            assert tr.metrics.total("p2psync_stream_padding_bytes_total") == 0
        finally:
            await tr.close()

    asyncio.run(go())


def test_stream_warmup_limit_is_validated(tmp_path):
    from p2psync.errors import ConfigError

    for bad in (-1, 1.5, True, config.MAX_STREAM_WARMUP + 1):
        with pytest.raises(ConfigError, match="limits.stream_warmup_bytes"):
            kit.cfg(tmp_path, "n", "relay", ["https://127.0.0.1:1"], limits={"stream_warmup_bytes": bad}).validate()


def test_a_child_lost_while_its_stream_or_events_are_written_ends_the_request_quietly(tmp_path, setup, monkeypatch,
                                                                                     caplog):
    """Found by the chaos soak (tools/chaos.py): aiohttp reports a connection lost while it drains as a plain
    ``ConnectionError('Connection lost')``, which the stream and event handlers did not take for a child going
    away: each one was an ERROR with a traceback in the parent's log (15 in one soak)."""
    import contextlib
    import logging

    import aiohttp

    from p2psync.transport.server import Server

    async def lost(self, resp, data):
        raise ConnectionError("Connection lost")

    async def go():
        tr = await Node.create(kit.cfg(tmp_path, "trainer", "trainer"))
        monkeypatch.setattr(Server, "write", lost)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {kit.TOKEN}"},
                                             connector=tlsutil.client_tls().connector()) as s:
                for path in ("/v1/stream?push=100&warm=65536", "/v1/events"):
                    async with s.get(tr.address + path) as resp:
                        assert resp.status == 200
                        with contextlib.suppress(aiohttp.ClientError):  # the server gave the response up
                            await resp.read()
        finally:
            await tr.close()

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text

