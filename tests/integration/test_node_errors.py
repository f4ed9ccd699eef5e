"""What a node's log says when it is refused for a reason only an operator fixes: one line naming
the cause and the setting, instead of an endless ``peer ... unreachable`` retry line."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import tlsutil
from nodeproc import CLI, TOKEN, Cluster, Proc, Workload, request, wait_for

from p2psync.certs import Authority

pytestmark = pytest.mark.integration


def _said(p: Proc, *words: str) -> bool:
    text = p.log.read_text()
    return all(w in text for w in words)


def _refusals(p: Proc, token: str = TOKEN) -> float:
    text = request(p.url + "/metrics", token=token)[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("p2psync_parent_refusals_total"))


@pytest.mark.timeout(240)
def test_a_wrong_cluster_token_is_named_once_while_retries_go_on(cluster: Cluster):
    Workload(cluster.priv, numel=20_000).snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    wrong = "not-the-clusters-token-000"
    # A refusing parent rests limits.max_rest (30 s by default) before the next try: 1 s here.
    relay = cluster.start("relay", "relay", [tr.url], extra=[f"--cluster_token={wrong}", "--limits.max_rest=1"])
    wait_for(lambda: _said(relay, "wrong cluster token", "cluster_token"), 120, "the relay naming the cause")
    wait_for(lambda: _refusals(relay, wrong) >= 2, 120, "a retry after the first refusal")
    lines = [line for line in relay.log.read_text().splitlines() if "wrong cluster token" in line]
    assert len(lines) == 1, lines
    assert "unreachable" not in lines[0] and len(lines[0]) < 300, lines[0]


@pytest.mark.timeout(240)
def test_a_peer_of_another_ca_is_named(cluster: Cluster, tmp_path):
    Workload(cluster.priv, numel=20_000).snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True)
    # A relay set up with another cluster's CA (its certificate and ca.crt both of that CA).
    Authority(tmp_path / "other-ca").node("relay", "default", tmp_path / "relay" / "tls")
    relay = cluster.start("relay", "relay", [tr.url], data_dir=tmp_path / "relay")
    wait_for(lambda: _said(relay, "certificate not issued by this cluster's CA", "tls.dir"), 120,
             "the relay naming the cause")
    line = next(line for line in relay.log.read_text().splitlines() if "not issued by this cluster's CA" in line)
    assert "ClientConnectorCertificateError" not in line and len(line) < 400, line


@pytest.mark.timeout(120)
def test_a_node_whose_certificate_does_not_chain_to_the_ca_beside_it_refuses_to_start(cluster: Cluster, tmp_path):
    tls = Authority(tmp_path / "other-ca").node("relay", "default", tmp_path / "relay" / "tls")
    shutil.copy(tlsutil.authority().directory / "ca.crt", tls / "ca.crt")  # the cluster's CA beside it
    out = subprocess.run(CLI + ["node", "--role", "relay", "--id", "relay", "--listen.port=0",
                                f"--data_dir={tmp_path / 'relay'}", f"--cluster_token={TOKEN}",
                                f"--trainer_public_key={cluster.keydir / 'trainer.pub'}",
                                "--parents=https://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stdout == ""  # no address: it never listened
    assert "certificate not issued by this cluster's CA" in out.stderr and "tls.dir" in out.stderr, out.stderr
