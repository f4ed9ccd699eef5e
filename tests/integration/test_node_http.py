"""A real node keeps serving good clients while it refuses bad requests with the right status."""

from __future__ import annotations

import json
import socket

import pytest
from nodeproc import TOKEN, Cluster, Workload, at_version, request, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_bad_requests_get_their_codes_and_the_node_keeps_serving(cluster: Cluster):
    w = Workload(cluster.priv, numel=100_000)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True, extra=["--limits.idle_timeout=2"])
    wait_for(lambda: at_version(tr, 0), 60, "trainer published")
    head = json.loads(request(tr.url + "/v1/head")[1])
    aid = head["artifacts"][0]["id"]
    chunk_url = f"{tr.url}/v1/artifacts/{aid}/chunks/0"
    full = request(chunk_url)[1]

    # A client that opens a connection and sends half a request line is cut off later; others go on.
    idle = socket.create_connection((tr.url.split("//")[1].split(":")[0], int(tr.url.rsplit(":", 1)[1])))
    idle.sendall(b"GET /v1/head HTTP/1.1\r\nHost: x\r\n")

    assert request(tr.url + "/v1/head", token=None)[0] == 401
    assert request(tr.url + "/v1/head", token="wrong-token-xxxxxxxx")[0] == 401
    assert request(tr.url + "/v1/nowhere", token=None)[0] == 401  # before routing
    assert request(tr.url + "/v1/head", method="POST", data=b"x" * (1 << 20))[0] == 413
    assert request(f"{tr.url}/v1/artifacts/{aid}/chunks/zero")[0] == 400
    assert request(f"{tr.url}/v1/artifacts/bad!id/manifest")[0] == 400
    assert request(f"{tr.url}/v1/artifacts/{aid}/chunks/99999")[0] == 400
    assert request(chunk_url, headers={"Range": "bytes=oops"})[0] == 400
    assert request(chunk_url, headers={"Range": f"bytes={len(full)}-"})[0] == 416
    assert request(tr.url + "/v1/head", headers={"X-Big": "y" * 20000})[0] == 400

    code, part = request(chunk_url, headers={"Range": "bytes=100-"})
    assert code == 206 and part == full[100:]
    assert request(tr.url + "/v1/status")[0] == 200
    metrics = request(tr.url + "/metrics")[1].decode()
    assert 'p2psync_requests_total{code="401"' in metrics

    idle.settimeout(20)
    assert idle.recv(1024) == b""  # the idle connection was closed by the server
    idle.close()
    assert TOKEN and request(tr.url + "/v1/head")[0] == 200
