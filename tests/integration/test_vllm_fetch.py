"""The leaf fetch the vLLM backend uses (:mod:`p2psync.transport.leaf`), from a real node through one
kept client (no vLLM needed): later calls reuse its connections, a node restarted at the same address
is reached again by the next call, and a refused fetch leaves the fetcher usable."""

from __future__ import annotations

import socket

import pytest
import tlsutil
from nodeproc import TOKEN, Cluster, Workload, at_version, wait_for

from cryptography.hazmat.primitives import serialization

from p2psync import keys
from p2psync.errors import SignatureError
from p2psync.transport.leaf import Fetcher, Parent, fetch_artifact, fetch_manifest, fetch_plan

pytestmark = pytest.mark.integration


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_a_kept_client_fetches_again_after_the_node_restarts_at_the_same_address(cluster: Cluster):
    w = Workload(cluster.priv, numel=100_000)
    w.snapshot(cluster.publish_dir)
    w.step(cluster.publish_dir)
    port = _port()
    tr = cluster.start("trainer", "trainer", publish=True, extra=[f"--listen.port={port}"])
    wait_for(lambda: at_version(tr, 1), 60, "trainer published")
    tls = str(tlsutil.node_tls("engine").directory)
    parent = Parent.create(tr.url, TOKEN, str(cluster.keydir / "trainer.pub"), "engine", tls, 10.0)
    other_key = keys.generate().public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    forged = Parent.create(tr.url, TOKEN, other_key, "engine", tls, 10.0)
    f = Fetcher()

    def fetch(call, retry=False, at=parent):
        return f.run(at, call, retry=retry)

    try:
        plan = fetch(lambda c: fetch_plan(parent, 0, 1, c), retry=True)
        assert [a.target for a in plan] == [1]
        kept = f._client
        m = fetch(lambda c: fetch_manifest(parent, plan[0].id, c))
        _, chunks = fetch(lambda c: fetch_artifact(parent, plan[0].id, manifest=m, client=c))
        assert f._client is kept and all(c is not None for c in chunks)

        # A manifest that does not verify against the key is refused; the next call works.
        with pytest.raises(SignatureError):
            fetch(lambda c: fetch_manifest(forged, plan[0].id, c), at=forged)
        assert f._client is None  # the failed call's client was dropped
        assert fetch(lambda c: fetch_manifest(parent, plan[0].id, c)).artifact_id == plan[0].id

        # The node restarts at the same address: the kept connections are dead, the plan is asked again.
        tr.stop()
        cluster.procs.remove(tr)
        tr2 = cluster.start("trainer", "trainer", publish=True, extra=[f"--listen.port={port}"], data_dir=tr.data_dir)
        assert tr2.url == tr.url
        wait_for(lambda: at_version(tr2, 1), 60, "trainer restarted")
        plan2 = fetch(lambda c: fetch_plan(parent, 0, 1, c), retry=True)
        assert [a.id for a in plan2] == [a.id for a in plan]
    finally:
        f.close()
