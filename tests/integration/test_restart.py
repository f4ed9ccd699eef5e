"""Restarts of real node processes from their data dirs: membership converges again without
touching the other nodes, and a revoked node gets nothing from anyone, whatever restarted when."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
from nodeproc import CLI, TOKEN, Cluster, Proc, Workload, at_version, get_json, wait_for

from p2psync.transport.tls import Tls

pytestmark = pytest.mark.integration

INTERVAL = 0.3
GOSSIP = [f"--gossip.interval={INTERVAL}", "--control.replan_delay=0.2"]
BOUND = 200 * INTERVAL
"""Back in every view within 200 gossip rounds of the restarted node's start (it converges in a few;
the rest is room for a loaded machine, where a node just started takes seconds to load)."""


def _alive(p: Proc) -> dict[str, str]:
    """The members ``p`` holds alive, with their addresses."""
    return {n["id"]: n["address"] for n in get_json(p.url + "/v1/cluster")["nodes"] if n["status"] == "alive"}


def _all_see_all(procs: list[Proc]) -> bool:
    want = {p.name: p.url for p in procs}
    return all(_alive(p) == want for p in procs)


def _as(node: Proc, url: str) -> int | str:
    """The HTTP status ``url`` answers a request made with ``node``'s certificate, or why it did not answer."""
    ctx = Tls.for_client(node.data_dir / "tls").client_context
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}", "X-P2PSync-Node": node.name})
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (ssl.SSLError, ConnectionError, urllib.error.URLError) as exc:
        return type(exc).__name__


@pytest.mark.timeout(420)
def test_a_restarted_trainer_or_relay_is_back_in_every_view_and_versions_flow(cluster: Cluster):
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True, extra=GOSSIP)
    join = [*GOSSIP, f"--gossip.seeds={tr.url}"]
    relay = cluster.start("relay", "relay", [tr.url], extra=join)
    leaf = cluster.start("leaf", "rollout", [relay.url, tr.url], extra=join)
    for p in (relay, leaf):
        wait_for(lambda p=p: at_version(p, 0), 120, f"{p.name} at version 0")
    wait_for(lambda: _all_see_all([tr, relay, leaf]), BOUND, "every node in every view")

    # SIGTERM the trainer and start it again on its port with its data dir: it says so, and each
    # side's view holds the other again (before: the others kept it as 'left' and it saw only itself).
    tr = cluster.restart(tr, same_port=True)
    wait_for(lambda: at_version(tr, 0), 120, "trainer reloaded")
    wait_for(lambda: _all_see_all([tr, relay, leaf]), BOUND, "every node in every view after the trainer's restart")
    w.step(cluster.publish_dir)
    wait_for(lambda: at_version(leaf, 1), 120, "leaf at version 1")

    # The relay comes back on another port: the others learn its new address.
    relay = cluster.restart(relay)
    wait_for(lambda: _all_see_all([tr, relay, leaf]), BOUND, "every node in every view after the relay's restart")
    w.step(cluster.publish_dir)
    for p in (relay, leaf):
        s = wait_for(lambda p=p: at_version(p, 2), 120, f"{p.name} at version 2")
        assert s["fingerprint"] == w.fingerprints[2]


@pytest.mark.timeout(480)
def test_a_revocation_after_a_trainer_restart_holds_at_every_node_and_across_their_restarts(
        cluster: Cluster, tmp_path):
    w = Workload(cluster.priv, numel=20_000)
    w.snapshot(cluster.publish_dir)
    revoked = tmp_path / "revoked"
    tr = cluster.start("trainer", "trainer", publish=True, extra=[*GOSSIP, f"--tls.revoked={revoked}"])
    join = [*GOSSIP, f"--gossip.seeds={tr.url}"]
    relay = cluster.start("relay", "relay", [tr.url], extra=join)
    good = cluster.start("good", "rollout", [relay.url, tr.url], extra=join)
    bad = cluster.start("bad", "rollout", [relay.url, tr.url], extra=join)
    for p in (relay, good, bad):
        wait_for(lambda p=p: at_version(p, 0), 120, f"{p.name} at version 0")
    wait_for(lambda: _all_see_all([tr, relay, good, bad]), BOUND, "every node in every view")

    tr = cluster.restart(tr, same_port=True)
    wait_for(lambda: at_version(tr, 0), 120, "trainer reloaded")
    out = subprocess.run(CLI + ["cert", "revoke", "--id", "bad", "--list", str(revoked)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Not at the trainer only: every node refuses it (before, the relay went on serving it).
    for p in (tr, relay, good):
        wait_for(lambda p=p: _as(bad, p.url + "/v1/head") == 403, BOUND, f"{p.name} refusing the revoked node")
    w.step(cluster.publish_dir)
    wait_for(lambda: at_version(good, 1), 120, "good at version 1")
    assert bad.status()["version"] == 0
    # The revoked node says so, naming the setting, instead of retrying 'unreachable' lines.
    wait_for(lambda: "this node is revoked" in bad.log.read_text(), BOUND, "the revoked node saying so")
    assert "tls.revoked" in bad.log.read_text()

    # The relay restarts from its data dir: it refuses the revoked node from its first request on,
    # before any gossip could have told it again.
    relay = cluster.restart(relay, same_port=True)
    assert _as(bad, relay.url + "/v1/head") == 403
    assert "revocation list restored" in relay.log.read_text()
    saved = json.loads((relay.data_dir / "control.json").read_text())
    assert saved["revoked"]["value"]["ids"] == ["bad"]
    # So does the trainer, restarted once more, and the other rollout node.
    tr = cluster.restart(tr, same_port=True)
    assert _as(bad, tr.url + "/v1/head") == 403
    good = cluster.restart(good, same_port=True)
    assert _as(bad, good.url + "/v1/head") == 403

    w.step(cluster.publish_dir)
    for p in (relay, good):
        wait_for(lambda p=p: at_version(p, 2), 120, f"{p.name} at version 2")
    assert bad.status()["version"] == 0
    assert _as(good, relay.url + "/v1/head") == 200  # the others are served as before
