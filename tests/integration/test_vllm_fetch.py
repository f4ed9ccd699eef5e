"""The vLLM backend's fetches from a real node through one kept client (no vLLM needed): later calls
reuse its connections, a node restarted at the same address is reached again by the next call, and a
refused fetch leaves the fetcher usable."""

from __future__ import annotations

import socket

import pytest
import tlsutil
from nodeproc import TOKEN, Cluster, Workload, at_version, wait_for

from p2psync import keys
from p2psync.errors import SignatureError
from rollout.engines.vllm.worker.fetch import Fetcher, fetch_artifact, fetch_manifest, fetch_plan

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
    pub = keys.load_public(cluster.keydir / "trainer.pub")
    f = Fetcher()

    def fetch(call, retry=False):
        return f.run(TOKEN, "engine", 10.0, tls, call, retry=retry)

    try:
        plan = fetch(lambda c: fetch_plan(tr.url, TOKEN, "engine", 0, 1, 10.0, tls, client=c), retry=True)
        assert [a.target for a in plan] == [1]
        kept = f._client
        m = fetch(lambda c: fetch_manifest(tr.url, TOKEN, "engine", plan[0].id, pub, 10.0, tls, client=c))
        _, chunks = fetch(lambda c: fetch_artifact(tr.url, TOKEN, "engine", plan[0].id, pub, 10.0, tls_dir=tls,
                                                   manifest=m, client=c))
        assert f._client is kept and all(c is not None for c in chunks)

        # A manifest that does not verify is refused; the next call opens a new client and works.
        with pytest.raises(SignatureError):
            fetch(lambda c: fetch_manifest(tr.url, TOKEN, "engine", plan[0].id, keys.generate().public_key(),
                                           10.0, tls, client=c))
        assert fetch(lambda c: fetch_manifest(tr.url, TOKEN, "engine", plan[0].id, pub, 10.0, tls,
                                              client=c)).artifact_id == plan[0].id

        # The node restarts at the same address: the kept connections are dead, the plan is asked again.
        tr.stop()
        cluster.procs.remove(tr)
        tr2 = cluster.start("trainer", "trainer", publish=True, extra=[f"--listen.port={port}"], data_dir=tr.data_dir)
        assert tr2.url == tr.url
        wait_for(lambda: at_version(tr2, 1), 60, "trainer restarted")
        plan2 = fetch(lambda c: fetch_plan(tr.url, TOKEN, "engine", 0, 1, 10.0, tls, client=c), retry=True)
        assert [a.id for a in plan2] == [a.id for a in plan]
    finally:
        f.close()
