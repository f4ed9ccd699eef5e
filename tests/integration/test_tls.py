"""Mutual TLS between real node processes on loopback: who gets in, who is refused, revocation.

Every node serves TLS with a certificate of the tests' cluster CA (:mod:`tlsutil`). A client or
node without such a certificate is refused in the handshake (no HTTP answer at all); a proxy that
terminates TLS with a certificate of its own is refused by the node behind it and by the node in
front of it; a peer whose certificate names one node but that claims another is refused; a revoked
node is cut off once the coordinator's list reaches the others.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tlsutil
from chunk_proxy import chunk_proxy
from nodeproc import CLI, TOKEN, Cluster, Workload, at_version, request, wait_for

from p2psync.certs import Authority
from p2psync.transport.tls import Tls

pytestmark = pytest.mark.integration

GOSSIP = ["--gossip.interval=0.3", "--control.replan_delay=0.2"]
REFUSED = (ssl.SSLError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected,
           urllib.error.URLError)


def _answer(url: str, context: ssl.SSLContext | None, headers: dict | None = None) -> int | Exception:
    """The HTTP status the node answers with that TLS context, or the exception if it did not answer."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}", **(headers or {})})
    try:
        # 60 s: on a loaded 2-core machine a node busy applying a version can take over 10 s to
        # finish a handshake; a refusal still ends the handshake at once.
        with urllib.request.urlopen(req, timeout=60, context=context) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except REFUSED as exc:
        return exc


def _verifying_context(cert_dir: Path | None = None) -> ssl.SSLContext:
    """Trusts the cluster CA (so the server is accepted) and presents ``cert_dir``'s certificate, if any."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(str(tlsutil.authority().directory / "ca.crt"))
    if cert_dir is not None:
        ctx.load_cert_chain(str(cert_dir / "node.crt"), str(cert_dir / "node.key"))
    return ctx


def _requests_seen(p) -> int:
    # A node just started on a loaded machine may take seconds to finish a handshake: no 5 s limit here.
    text = request(p.url + "/metrics", timeout=60)[1].decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("p2psync_requests_total")))


@pytest.mark.timeout(180)
def test_a_client_or_node_without_a_certificate_of_the_cluster_ca_is_refused_in_the_handshake(
        cluster: Cluster, tmp_path):
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    url = tr.url + "/v1/status"
    assert url.startswith("https://")
    rogue = Authority(tmp_path / "rogue-ca")
    rogue_client = rogue.client()
    before = _requests_seen(tr)
    # No certificate, a certificate of another authority (even one naming a real node), plain HTTP:
    # the handshake fails and no HTTP answer comes back.
    rogue_trainer = rogue.node("trainer", "default", tmp_path / "rogue-trainer")
    for ctx in (_verifying_context(), _verifying_context(rogue_client), _verifying_context(rogue_trainer)):
        got = _answer(url, ctx)
        assert isinstance(got, Exception), got
    assert isinstance(_answer(url.replace("https://", "http://"), None), Exception)
    assert _requests_seen(tr) == before + 1  # only the metrics read itself got through
    # The same request with a client certificate of the cluster CA is answered (the refusals above
    # are the certificate's doing); the cluster token is still required on top of it.
    assert _answer(url, tlsutil.client_context()) == 200
    req = urllib.request.Request(url)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10, context=tlsutil.client_context())
    assert err.value.code == 401

    # A node whose certificate comes from another authority never gets in (and never gets a byte).
    rogue.node("intruder", "default", tmp_path / "intruder" / "tls")
    intruder = cluster.start("intruder", "rollout", [tr.url], data_dir=tmp_path / "intruder")
    friend = cluster.start("friend", "rollout", [tr.url])
    wait_for(lambda: at_version(friend, 0), 60, "friend at version 0")
    # The intruder serves with the other authority's certificate: ask it with one of those.
    seen = json.loads(Tls.for_client(rogue_client).urlopen(
        urllib.request.Request(intruder.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}), 10).read())
    assert seen["version"] is None
    assert "certificate not issued by this cluster's CA" in intruder.log.read_text()
    children = json.dumps(tr.status().get("children", {}))
    assert "friend" in children and "intruder" not in children


@pytest.mark.timeout(180)
def test_standard_tls_clients_verify_a_node_by_host_name(cluster: Cluster):
    """curl with --cacert (no -k) and Python's default context (host-name check on) accept a node at
    the names its certificate carries (p2psync cert issue: localhost, 127.0.0.1, ::1, --host) and
    refuse it under a name it does not carry."""
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    port = int(tr.url.rsplit(":", 1)[1])
    ca = tlsutil.authority().directory / "ca.crt"
    client = tlsutil.authority().client()
    for host in ("127.0.0.1", "localhost"):
        done = subprocess.run(["curl", "-sS", "--fail", "--cacert", str(ca), "--cert", str(client / "node.crt"),
                               "--key", str(client / "node.key"), "-H", f"Authorization: Bearer {TOKEN}",
                               f"https://{host}:{port}/v1/status"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (host, done.stderr)
        assert json.loads(done.stdout)["node"] == "trainer"
    ctx = ssl.create_default_context(cafile=str(ca))
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(client / "node.crt"), str(client / "node.key"))
    assert _answer(f"https://localhost:{port}/v1/status", ctx) == 200
    # A name the certificate does not carry fails the host-name check, in curl as in Python.
    done = subprocess.run(["curl", "-sS", "--cacert", str(ca), "--resolve", f"elsewhere.example.org:{port}:127.0.0.1",
                           f"https://elsewhere.example.org:{port}/v1/status"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 60 and "elsewhere.example.org" in done.stderr, (done.returncode, done.stderr)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
            ctx.wrap_socket(sock, server_hostname="elsewhere.example.org")


def test_a_node_without_its_certificate_does_not_start_and_says_how_to_get_one(cluster: Cluster, tmp_path):
    args = ["node", "--role", "relay", "--id", "lonely", "--listen.port=0", f"--data_dir={tmp_path / 'lonely'}",
            f"--cluster_token={TOKEN}", f"--trainer_public_key={cluster.keydir / 'trainer.pub'}",
            "--parents=https://127.0.0.1:9"]
    p = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert "tls.dir" in p.stderr and "p2psync cert issue" in p.stderr
    # A certificate for another node is refused the same way.
    tlsutil.certify(tmp_path / "lonely", "someone-else")
    p = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "for node 'someone-else'" in p.stderr
    # Plain HTTP needs saying so; the node then warns what crosses the network in clear.
    plain = [*args[:-1], "--tls.enabled=false", "--parents=http://127.0.0.1:9"]
    proc = subprocess.Popen(CLI + plain, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("http://")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "TLS IS OFF" in err


@pytest.mark.timeout(180)
def test_a_proxy_that_terminates_tls_with_a_certificate_of_its_own_is_refused(cluster: Cluster, tmp_path):
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    rogue = Authority(tmp_path / "rogue-ca")
    # The proxy's certificate names a real node id, but comes from the wrong authority.
    mitm = Tls.for_client(rogue.node("trainer", "default", tmp_path / "mitm"))
    with chunk_proxy(tr.url, "pass", mitm) as proxy:
        victim = cluster.start("victim", "rollout", [proxy.url])
        # Control: the same proxy with a certificate of the cluster CA relays the snapshot.
        with chunk_proxy(tr.url, "pass", tlsutil.node_tls("honest-proxy")) as honest:
            control = cluster.start("control", "rollout", [honest.url])
            wait_for(lambda: at_version(control, 0), 60, "control at version 0 through the honest proxy")
            assert honest.requests > 0
        assert victim.status()["version"] is None
        assert proxy.requests == 0  # the victim never sent a request through it
        assert "certificate not issued by this cluster's CA" in victim.log.read_text()
        # And the trainer refuses the proxy's own upstream connection in the handshake.
        assert isinstance(_answer(tr.url + "/v1/head", _verifying_context(tmp_path / "mitm")), Exception)


@pytest.mark.timeout(180)
def test_a_peer_claiming_another_nodes_id_is_refused(cluster: Cluster, tmp_path):
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True, extra=GOSSIP)
    r1 = cluster.start("r1", "rollout", [tr.url], extra=[*GOSSIP, f"--gossip.seeds={tr.url}"])
    wait_for(lambda: at_version(r1, 0), 60, "r1 at version 0")
    as_r1 = Tls.for_client(r1.data_dir / "tls").client_context
    head = tr.url + "/v1/head"
    assert _answer(head, as_r1, {"X-P2PSync-Node": "r1"}) == 200
    assert _answer(head, as_r1, {"X-P2PSync-Node": "r1/engine"}) == 200  # r1's own engine
    assert _answer(head, as_r1, {"X-P2PSync-Node": "r2"}) == 403
    assert _answer(head, tlsutil.client_context(), {"X-P2PSync-Node": "r1"}) == 403

    def post(path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
        req = urllib.request.Request(tr.url + path, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", **headers})
        try:
            with urllib.request.urlopen(req, timeout=10, context=as_r1) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    # Gossip as another node, a lease request and a result in another node's name: all refused.
    hb = json.dumps({"format": 1, "type": "heartbeat", "sender": "r2", "inc": 1, "hb": 5}).encode()
    code, body = post("/v1/gossip", hb, {"X-P2PSync-Gossip-From": r1.url, "Content-Type": "application/json"})
    assert code == 403 and b"'r2'" in body
    code, body = post("/v1/control/lease", json.dumps({"node": "r2", "max_items": 1, "wait": 0}).encode(),
                      {"Content-Type": "application/json"})
    assert code == 403 and b"certificate names 'r1'" in body
    code, body = post("/v1/control/complete", json.dumps({"node": "r2", "work_id": "w", "lease_id": 1,
                                                          "responses": []}).encode(),
                      {"Content-Type": "application/json"})
    assert code == 403
    # In its own name the same lease request is served (nothing is queued: no grants).
    code, body = post("/v1/control/lease", json.dumps({"node": "r1", "max_items": 1, "wait": 0}).encode(),
                      {"Content-Type": "application/json"})
    assert code == 200 and json.loads(body)["grants"] == []


@pytest.mark.timeout(240)
def test_a_revoked_node_is_cut_off_by_every_node(cluster: Cluster, tmp_path):
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    revoked = tmp_path / "revoked"
    tr = cluster.start("trainer", "trainer", publish=True, extra=[*GOSSIP, f"--tls.revoked={revoked}"])
    join = [*GOSSIP, f"--gossip.seeds={tr.url}"]
    relay = cluster.start("relay", "relay", [tr.url], extra=join)
    bad = cluster.start("bad", "rollout", [relay.url, tr.url], extra=join)
    good = cluster.start("good", "rollout", [relay.url, tr.url], extra=join)
    for p in (relay, bad, good):
        wait_for(lambda p=p: at_version(p, 0), 120, f"{p.name} at version 0")
    as_bad = Tls.for_client(bad.data_dir / "tls").client_context
    assert _answer(relay.url + "/v1/head", as_bad, {"X-P2PSync-Node": "bad"}) == 200

    out = subprocess.run(CLI + ["cert", "revoke", "--id", "bad", "--list", str(revoked)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # The trainer reads the list at its next gossip round and pushes it to every member at once.
    # The pushes go out together but land one by one: each node is waited for in turn.
    for p in (relay, tr, good):
        wait_for(lambda p=p: _answer(p.url + "/v1/head", as_bad, {"X-P2PSync-Node": "bad"}) == 403, 60,
                 f"{p.name} refusing the revoked node")
    assert _answer(good.url + "/v1/head", as_bad) == 403
    # A new version reaches every node but the revoked one, whose open streams were cut.
    w.step(cluster.publish_dir)
    for p in (relay, good):
        wait_for(lambda p=p: at_version(p, 1), 120, f"{p.name} at version 1")
    assert bad.status()["version"] == 0
    assert "revoked" in bad.log.read_text() or "403" in bad.log.read_text()
