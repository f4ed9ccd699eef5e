"""A real node keeps serving good clients while it refuses bad requests with the right status."""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

import pytest
import tlsutil
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
    idle = tlsutil.client_context().wrap_socket(
        socket.create_connection((tr.url.split("//")[1].split(":")[0], int(tr.url.rsplit(":", 1)[1]))))
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
    assert request(tr.url + "/v1/head", headers={"X-Big": "y" * 20000})[0] == 431
    assert request(tr.url + "/v1/head", headers={"X-Big" + "y" * 9000: "1"})[0] == 431
    assert request(tr.url + "/v1/" + "a" * 9000)[0] == 431

    code, part = request(chunk_url, headers={"Range": "bytes=100-"})
    assert code == 206 and part == full[100:]
    assert request(tr.url + "/v1/status")[0] == 200
    metrics = request(tr.url + "/metrics")[1].decode()
    assert 'p2psync_requests_total{code="401"' in metrics
    assert 'p2psync_requests_total{code="431"' in metrics

    idle.settimeout(20)
    try:
        closed = idle.recv(1024) == b""
    except (ssl.SSLEOFError, ConnectionResetError):
        closed = True
    assert closed  # the idle connection was closed by the server
    idle.close()
    assert TOKEN and request(tr.url + "/v1/head")[0] == 200


def held_by_a_process(server_port: int, client_port: int) -> bool:
    """Whether some process still holds the server's end of the TCP connection from
    ``client_port`` to ``server_port``: Linux lists a socket whose owner closed it with inode 0
    (orphaned, the kernel finishing it alone) until it drops it from /proc/net/tcp*."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, remote, inode = f[1], f[2], int(f[9])
            if (int(local.rsplit(":", 1)[1], 16) == server_port
                    and int(remote.rsplit(":", 1)[1], 16) == client_port and inode != 0):
                return True
    return False


@pytest.mark.timeout(120)
def test_a_client_that_stops_reading_is_cut_off_while_others_are_served(cluster: Cluster):
    import torch

    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_snapshot
    from p2psync.state import ModelState

    # One 32 MiB chunk: far more than loopback socket buffers hold, so a client that stops
    # reading leaves the server with a write that cannot finish.
    size = 32 << 20
    g = torch.Generator().manual_seed(5)
    state = ModelState({"w": torch.randint(-32768, 32767, (size // 2,), dtype=torch.int16, generator=g)})
    enc = encode_snapshot(state, CodecOptions(chunk_size=size + (1 << 20), zstd_level=0))
    m = build_manifest(enc, model_id="test", target_version=0, chunk_size=size + (1 << 20),
                       private_key=cluster.priv)
    write_file(cluster.publish_dir / "000000-snapshot.p2sa", m, enc.chunks)
    stall = 2  # seconds a write may wait on a client that does not read
    tr = cluster.start("trainer", "trainer", publish=True, extra=[f"--limits.idle_timeout={stall}"])
    wait_for(lambda: at_version(tr, 0), 60, "trainer published")
    host, port = tr.url.split("//")[1].rsplit(":", 1)
    path = f"/v1/artifacts/{m.artifact_id}/chunks/0"

    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    slow.connect((host, int(port)))
    slow = tlsutil.client_context().wrap_socket(slow)
    slow.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    client_port = slow.getsockname()[1]
    assert held_by_a_process(int(port), client_port)  # from here on it reads nothing

    # While that write is stuck, other clients get whole chunks and answers.
    for _ in range(2):
        code, body = request(tr.url + path, timeout=60)
        assert code == 200 and body == enc.chunks[0]
    assert request(tr.url + "/v1/head")[0] == 200

    def cut() -> bool:
        text = request(tr.url + "/metrics")[1].decode()
        return "p2psync_slow_clients_cut_total" in text
    wait_for(cut, 60, "the stalled client to be cut off")
    # The node let go of the connection while the client still reads nothing: an abort, not a
    # close that waits for the client to take the rest (which would hold it for good).
    wait_for(lambda: not held_by_a_process(int(port), client_port), 5 * stall,
             "the node to release the stalled client's connection")
    got = 0
    slow.settimeout(20)
    try:
        while piece := slow.recv(1 << 20):
            got += len(piece)
    except (ConnectionResetError, ssl.SSLError):
        pass
    slow.close()
    assert got < len(enc.chunks[0])  # it never got the whole chunk: the connection was dropped
    assert request(tr.url + "/v1/head")[0] == 200
