"""Probe endpoints of real ``p2psync node`` processes, and ``p2psync plan --probe`` against them."""

from __future__ import annotations

import json
import socket
import subprocess
import threading

import pytest
from nodeproc import CLI, TOKEN, Cluster, request, wait_for
from tlsutil import authority

from p2psync.probe.service import MAX_BLOB_BYTES, MAX_TARGETS
from topology.model import NetworkModel
from topology.tree import Plan


pytestmark = pytest.mark.integration

REPO = __file__.rsplit("/tests/", 1)[0]


def _post(url: str, body, timeout: float = 30.0, token: str | None = TOKEN):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, raw = request(url + "/v1/probe/measure", token=token, method="POST", data=data,
                        headers={"Content-Type": "application/json"}, timeout=timeout)
    return code, json.loads(raw) if raw.startswith(b"{") else raw


@pytest.mark.timeout(90)
def test_probe_endpoints_measure_and_refuse_bad_input(cluster: Cluster):
    a = cluster.start("a", "trainer", extra=["--region=us"])
    # b runs with a tighter [probe] config section than a's defaults.
    b = cluster.start("b", "relay", [a.url], extra=["--region=eu", "--probe.max_blob_bytes=4194304",
                                                    "--probe.max_targets=4", "--probe.bytes=1048576"])
    wait_for(lambda: b.status()["loaded"], 60, "b serving")

    code, body = request(a.url + "/v1/probe/blob?bytes=1000003")
    assert code == 200 and len(body) == 1000003
    assert len(set(body[:4096])) > 200  # random bytes, not a fill pattern
    assert request(a.url + "/v1/probe/blob?bytes=0") == (200, b"")
    for bad in ("-1", "abc", "1.5", "", str(MAX_BLOB_BYTES + 1)):
        code, body = request(a.url + f"/v1/probe/blob?bytes={bad}")
        assert code == 400 and b"bytes" in body, (bad, code, body)
    assert request(a.url + "/v1/probe/blob?bytes=10", token="wrong-token-123456")[0] == 401
    assert request(a.url + "/v1/probe/ping", token=None)[0] == 401

    code, reply = _post(a.url, {"targets": [b.url, "http://127.0.0.1:1"], "bytes": 2 << 20, "rtt_samples": 3})
    assert code == 200, reply
    assert reply["node"] == "a" and reply["region"] == "us"
    ok, dead = reply["results"]
    assert ok["node"] == "b" and ok["region"] == "eu" and ok["role"] == "relay" and ok["error"] is None
    assert ok["bytes"] == 2 << 20 and ok["bandwidth_bps"] > 0 and 0 < ok["rtt_min_s"] <= ok["rtt_s"]
    assert dead["error"] and "127.0.0.1:1" in dead["error"] and dead["bandwidth_bps"] is None
    # Probing does not make the prober a child of the target (nobody follows b).
    assert b.status()["children"] == []

    bad_bodies = [
        (b"not json", "<body>"),
        ([a.url], "<body>"),
        ({}, "targets"),
        ({"targets": []}, "targets"),
        ({"targets": ["ftp://x"]}, "targets[0]"),
        ({"targets": [a.url] * (MAX_TARGETS + 1)}, "targets"),
        ({"targets": [a.url], "bytes": MAX_BLOB_BYTES + 1}, "bytes"),
        ({"targets": [a.url], "bytes": "8"}, "bytes"),
        ({"targets": [a.url], "rtt_samples": 0}, "rtt_samples"),
        ({"targets": [a.url], "format": 99}, "format"),
        ({"targets": [a.url], "extra": 1}, "extra"),
    ]
    for body, field in bad_bodies:
        code, reply = _post(b.url, body)
        assert code == 400 and reply["error"].startswith(field), (body, code, reply)
    assert _post(b.url, {"targets": [a.url]}, token="wrong-token-123456")[0] == 401
    # Each node holds its own [probe] limits: b refuses what a serves and accepts.
    assert request(b.url + f"/v1/probe/blob?bytes={(4 << 20) + 1}")[0] == 400
    code, body = request(a.url + f"/v1/probe/blob?bytes={(4 << 20) + 1}")
    assert code == 200 and len(body) == (4 << 20) + 1
    code, reply = _post(b.url, {"targets": [a.url] * 5, "bytes": 0})
    assert code == 400 and reply["error"].startswith("targets"), reply
    code, reply = _post(b.url, {"targets": [a.url], "rtt_samples": 2})  # bytes: b's default, 1 MiB
    assert code == 200 and reply["results"][0]["bytes"] == 1 << 20, reply


@pytest.mark.timeout(90)
def test_one_measurement_at_a_time_per_node(cluster: Cluster):
    a = cluster.start("a", "trainer")
    # A target that accepts the connection and never answers keeps the first measurement busy.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    port = silent.getsockname()[1]
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=_post(a.url, {"targets": [f"http://127.0.0.1:{port}"],
                                                                      "bytes": 0})))
    t.start()
    try:
        conn, _ = silent.accept()  # the first measurement is under way
        code, reply = _post(a.url, {"targets": [a.url], "bytes": 0})
        assert code == 409 and "already running" in reply["error"]
        conn.close()  # the silent target goes away: the first measurement ends with an error result
        t.join(30)
        code, reply = first["r"]
        assert code == 200 and reply["results"][0]["error"]
    finally:
        silent.close()
        t.join(30)
    code, reply = _post(a.url, {"targets": [a.url], "bytes": 1 << 20})
    assert code == 200 and reply["results"][0]["error"] is None


@pytest.mark.timeout(240)
def test_plan_probe_measures_live_nodes_and_plans(cluster: Cluster, tmp_path):
    tr = cluster.start("trainer", "trainer", extra=["--region=us"])
    nodes = [tr]
    for region, n in (("us", 1), ("eu", 2), ("ap", 2)):
        for i in range(n):
            nodes.append(cluster.start(f"{region}-{i}", "relay" if i == 0 else "rollout", [tr.url],
                                       extra=[f"--region={region}"]))
    for p in nodes:
        wait_for(lambda p=p: p.status(timeout=10)["loaded"], 90, f"{p.name} serving")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    listing = tmp_path / "cluster.txt"
    listing.write_text("# the test cluster\n" + "\n".join(p.url for p in nodes[1:]) + "\n")
    plan_path, meas_path = tmp_path / "plan.json", tmp_path / "measured.json"
    # The trainer's address on the command line, the others from a cluster file: both forms.
    cp = subprocess.run(CLI + ["plan", "--probe", tr.url, *(p.url for p in nodes[1:]), "--token-file", str(token),
                               "--probe-bytes", str(1 << 20), "--rtt-samples", "2", "--intra-peers", "1",
                               "-o", str(plan_path), "--save-measurements", str(meas_path), "--no-sim",
                               "--tls-dir", str(authority().client())],
                        capture_output=True, text=True, cwd=REPO, timeout=200)
    assert cp.returncode == 0, cp.stderr[-3000:]
    out = cp.stdout
    assert "from row to column" in out and "estimated completion" in out
    for p in nodes:
        assert p.name in out
    plan = Plan.load(plan_path)
    assert plan.root == "trainer" and set(plan.parents) == {p.name for p in nodes[1:]}
    assert plan.regions["eu-1"] == "eu" and plan.roles["us-0"] == "relay" and plan.roles["ap-1"] == "rollout"
    assert all(bw > 0 for bw in plan.edge_bps.values()) and plan.est_completion_s > 0

    model = NetworkModel.load(meas_path)  # what `plan --from` reads
    region = {p.name: p.name.split("-")[0] if p is not tr else "us" for p in nodes}
    measured = {(m.src, m.dst) for m in model.measurements()}
    for r in ("eu", "ap"):  # the trainer's link into every other region was measured
        assert any(s == "trainer" and region[d] == r for s, d in measured), r
    for a in ("us", "eu", "ap"):  # every ordered region pair, and inside every region
        for b in ("us", "eu", "ap"):
            assert any(region[s] == a and region[d] == b for s, d in measured), (a, b)
    assert len(measured) < len(nodes) * (len(nodes) - 1)  # sampled, not all pairs
    raw = json.loads(meas_path.read_text())["probe"]
    assert raw["addresses"]["trainer"] == tr.url and not raw["failed"] and not raw["unreachable"]

    # The saved measurements plan again offline, to the same tree.
    again = tmp_path / "again.json"
    cp = subprocess.run(CLI + ["plan", "--from", str(meas_path), "-o", str(again), "--no-sim"],
                        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert Plan.load(again).parents == plan.parents


@pytest.mark.timeout(60)
def test_plan_probe_needs_a_token_and_a_trainer(cluster: Cluster, tmp_path):
    r = cluster.start("lonely", "trainer")
    tls = ["--tls-dir", str(authority().client())]  # the operator's client certificate (mutual TLS)
    cp = subprocess.run(CLI + ["plan", "--probe", r.url, *tls], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert cp.returncode == 1 and "cluster token" in cp.stderr
    token = tmp_path / "token"
    token.write_text("wrong-token-123456")
    cp = subprocess.run(CLI + ["plan", "--probe", r.url, "--token-file", str(token), *tls],
                        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert cp.returncode == 1 and "exactly one trainer" in cp.stderr and "401" in cp.stderr
