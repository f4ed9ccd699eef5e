"""The cluster CA, node certificates and the TLS material a node loads: what is accepted, what is
refused and how the refusal reads; the revocation list file."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2psync import certs, config
from p2psync.cli import main
from p2psync.errors import ConfigError
from p2psync.transport.revocation import RevocationFile, read_list
from p2psync.transport.tls import Tls

OWN_CERTIFICATES = True
"""Nodes here get no certificate unless the test issues one (see tests/conftest.py)."""


def _cfg(tmp_path: Path, **over) -> config.NodeConfig:
    base = {"id": "r1", "role": "rollout", "region": "eu", "data_dir": str(tmp_path / "r1"),
            "cluster_token": "unit-test-token-tls", "trainer_public_key": "x", "parents": ["https://a:1"]}
    return config.load(overrides={**base, **over})


def test_keygen_makes_the_cluster_ca_and_issue_names_the_node_and_its_region(tmp_path, capsys):
    assert main(["keygen", "-o", str(tmp_path / "keys")]) == 0
    assert {p.name for p in (tmp_path / "keys").iterdir()} == {"trainer.key", "trainer.pub", "ca.crt", "ca.key"}
    assert (tmp_path / "keys" / "ca.key").stat().st_mode & 0o077 == 0
    assert main(["cert", "issue", "--ca", str(tmp_path / "keys"), "--id", "r1", "--region", "eu",
                 "-o", str(tmp_path / "r1" / "tls")]) == 0
    ident = certs.identity_of(tmp_path / "r1" / "tls" / "node.crt")
    assert (ident.id, ident.region, ident.client_only) == ("r1", "eu", False)
    assert (tmp_path / "r1" / "tls" / "node.key").stat().st_mode & 0o077 == 0
    tls = Tls.for_node(_cfg(tmp_path))  # the node finds it in <data_dir>/tls
    assert tls.enabled and tls.server_context is not None and tls.scheme == "https"
    # A second keygen into the same folder refuses to replace the CA (or the key).
    assert main(["keygen", "-o", str(tmp_path / "keys")]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


def test_a_node_refuses_to_start_without_its_own_certificate(tmp_path):
    ca = certs.Authority(tmp_path / "ca")
    with pytest.raises(ConfigError, match=r"tls.dir: .*node.crt is missing: issue .*p2psync cert issue"):
        Tls.for_node(_cfg(tmp_path))
    ca.node("r2", "eu", tmp_path / "r1" / "tls")
    with pytest.raises(ConfigError, match=r"is for node 'r2', not for this node \('r1'\)"):
        Tls.for_node(_cfg(tmp_path))
    ca.node("r1", "us", tmp_path / "r1" / "tls")
    with pytest.raises(ConfigError, match=r"is for region 'us', not this node's region 'eu'"):
        Tls.for_node(_cfg(tmp_path))
    certs.issue(ca.directory, "r1", "eu", tmp_path / "r1" / "tls", client_only=True)
    with pytest.raises(ConfigError, match="client-only certificate"):
        Tls.for_node(_cfg(tmp_path))
    ca.node("r1", "eu", tmp_path / "elsewhere")
    assert Tls.for_node(_cfg(tmp_path, tls={"dir": str(tmp_path / "elsewhere")})).identity.id == "r1"
    assert not Tls.for_node(_cfg(tmp_path, tls={"enabled": False}, parents=["http://a:1"])).enabled


def test_bad_ids_and_validity_are_refused_naming_the_field(tmp_path):
    ca = certs.Authority(tmp_path / "ca")
    for bad in ("", "has space", "a/b", "x" * 200):
        with pytest.raises(ConfigError, match="^id: "):
            ca.node(bad, "eu", tmp_path / "n")
    with pytest.raises(ConfigError, match="^region: "):
        ca.node("ok", "e u", tmp_path / "n")
    assert main(["cert", "issue", "--ca", str(ca.directory), "--id", "n", "--days", "0", "-o", str(tmp_path / "n")]) == 1
    assert not (tmp_path / "n").exists()  # nothing was written


def test_a_node_certificate_names_its_hosts_and_a_bad_host_is_refused(tmp_path, capsys):
    ca = certs.Authority(tmp_path / "ca")
    assert main(["cert", "issue", "--ca", str(ca.directory), "--id", "r1", "--host", "r1.example.org",
                 "--host", "10.0.0.3", "--host", "2001:db8::7", "--host", "*.eu.example.org",
                 "-o", str(tmp_path / "r1")]) == 0
    assert certs.hosts_of(tmp_path / "r1" / "node.crt") == [
        "localhost", "r1.example.org", "*.eu.example.org", "127.0.0.1", "::1", "10.0.0.3", "2001:db8::7"]
    assert "hosts localhost, r1.example.org" in capsys.readouterr().out
    ca.node("r2", "eu", tmp_path / "r2")  # without --host: the loopback names only
    assert certs.hosts_of(tmp_path / "r2" / "node.crt") == ["localhost", "127.0.0.1", "::1"]
    for bad in ("", "has space", "a..b", "-x.org", "http://r1", "x" * 64 + ".org"):
        with pytest.raises(ConfigError, match="^host: "):
            certs.issue(ca.directory, "r3", "eu", tmp_path / "r3", hosts=[bad])
    assert not (tmp_path / "r3").exists()
    with pytest.raises(ConfigError, match="^host: a client-only certificate"):
        certs.issue(ca.directory, "op", "eu", tmp_path / "op", client_only=True, hosts=["r1.example.org"])
    assert certs.hosts_of(ca.client() / "node.crt") == []


def test_revocation_list_is_read_when_it_changes(tmp_path):
    path = tmp_path / "revoked"
    rf = RevocationFile(path)
    assert rf.poll() == frozenset()  # no file yet: nobody revoked
    assert rf.poll() is None  # unchanged
    assert main(["cert", "revoke", "--id", "r2", "--list", str(path)]) == 0
    assert main(["cert", "revoke", "--id", "r2", "--list", str(path)]) == 0  # once only
    path.write_text(path.read_text() + "# a comment\nr3  # another\n")
    assert rf.poll() == frozenset({"r2", "r3"}) and read_list(path) == {"r2", "r3"}
    assert path.read_text().count("r2") == 1


def test_a_client_cuts_a_server_revoked_before_or_after_its_handshake(tmp_path):
    """Client side of revocation, in the TLS layer: a new connection to a revoked server fails in its
    handshake (no request is sent), and a kept-alive connection to a server revoked after it was
    opened fails at its next use instead of being reused; other servers are unaffected."""
    import asyncio

    import aiohttp
    from aiohttp import web

    ca = certs.Authority(tmp_path / "ca")
    for name in ("relay-a", "relay-b", "me"):
        ca.node(name, "eu", tmp_path / name)
    requests: dict[str, int] = {"relay-a": 0, "relay-b": 0}

    async def serve(name: str) -> tuple[web.AppRunner, str]:
        async def hello(_request: web.Request) -> web.Response:
            requests[name] += 1
            return web.Response(text=name)

        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=Tls(tmp_path / name).server_context)
        await site.start()
        return runner, f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def go() -> None:
        (ra, a), (rb, b) = await serve("relay-a"), await serve("relay-b")
        me = Tls(tmp_path / "me")
        try:
            async with aiohttp.ClientSession(connector=me.connector(limit=1)) as s:
                assert await (await s.get(a + "/")).text() == "relay-a"  # kept alive: limit=1
                me.revoke({"relay-a"})
                with pytest.raises(aiohttp.ClientError):
                    await (await s.get(a + "/")).text()  # the kept connection is not reused
                with pytest.raises(aiohttp.ClientError, match="'relay-a' is revoked"):
                    await s.get(a + "/")  # a new one fails in its handshake
                assert await (await s.get(b + "/")).text() == "relay-b"
            assert requests == {"relay-a": 1, "relay-b": 1}  # nothing reached relay-a after its revocation
            async with aiohttp.ClientSession(connector=me.connector()) as s:
                me.revoke(set())  # lifted: served again
                assert await (await s.get(a + "/")).text() == "relay-a"
        finally:
            await ra.cleanup()
            await rb.cleanup()

    asyncio.run(go())
