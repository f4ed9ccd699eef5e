"""The trainer's live page /ui in a real headless Chromium, against real node processes.

Trainer (us), relay-eu (eu), eu-1 (eu), us-1 (us), joined through gossip (the trainer's
``node.cluster()`` is the membership the page shows). The page must draw the tree by region with
every node's version and role, with exactly the parent each node really pulls from (the coordinator
may re-plan it), show transfer progress while a version flows, and move every node to the new
version once it is published (the page polls /ui/state; nothing reloads it). A screenshot taken
mid-transfer is kept under the test's tmp dir (``tools/ui_screenshot.sh`` copies it to docs/benchmarks/ui.png).
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import needs
import pytest
import tlsutil
from nodeproc import CLI, TOKEN, Cluster, Workload, at_version, request, wait_for
from ui_browser import Browser

pytestmark = pytest.mark.integration

NODES_JS = ("JSON.stringify(Object.fromEntries([...document.querySelectorAll('#tree [data-node]')]"
            ".map(e => [e.dataset.node, e.dataset.version])))")
EDGES_JS = "[...document.querySelectorAll('#tree [data-edge]')].map(e => e.dataset.edge).sort()"
GOSSIP = ["--gossip.interval=0.3", "--control.replan_delay=0.2"]


def _all_at(state_js: str, version: int, names: list[str]) -> str:
    return (f"(() => {{ const v = {state_js}; const o = JSON.parse(v); "
            f"return {json.dumps(names)}.every(n => o[n] === '{version}') ? v : ''; }})()")


def _real_edges(procs) -> list[str]:
    """parent->child for every node, from what each node says it pulls from right now."""
    by_url = {p.url: p.name for p in procs}
    edges = []
    for p in procs:
        parent = p.status().get("parent")
        if parent:
            edges.append(f"{by_url.get(parent.rstrip('/'), parent)}->{p.name}")
    return sorted(edges)


@pytest.mark.timeout(300)
def test_live_page_shows_the_tree_and_follows_a_new_version(cluster: Cluster, tmp_path):
    chromium = needs.chromium()
    w = Workload(cluster.priv, numel=1_200_000, fraction=0.5)
    w.snapshot(cluster.publish_dir)
    # Every source serves slowly and every follower pulls one chunk at a time, so a version's transfer
    # lasts long enough to be watched on the page.
    slow = ["--testing.serve_delay=0.2"]
    tr = cluster.start("trainer", "trainer", publish=True, extra=["--region=us", *GOSSIP, *slow])
    join = [*GOSSIP, *slow, f"--gossip.seeds={tr.url}", "--limits.parallel_streams=1"]
    relay = cluster.start("relay-eu", "relay", [tr.url], extra=["--region=eu", *join])
    eu1 = cluster.start("eu-1", "rollout", [relay.url, tr.url], extra=["--region=eu", *join])
    us1 = cluster.start("us-1", "rollout", [tr.url], extra=["--region=us", *join])
    nodes = [tr, relay, eu1, us1]
    roles = {"trainer": "trainer", "relay-eu": "relay", "eu-1": "rollout", "us-1": "rollout"}
    regions = {"trainer": "us", "relay-eu": "eu", "eu-1": "eu", "us-1": "us"}
    for p in nodes:
        wait_for(lambda p=p: at_version(p, 0), 90, f"{p.name} at version 0")
    assert request(tr.url + "/ui", token=None)[0] == 401
    assert request(tr.url + "/ui?token=wrong-token-123456", token=None)[0] == 401
    assert request(tr.url + "/ui/state", token=None, headers={"Cookie": "p2psync_ui=wrong-token-123456"})[0] == 401
    # The cookie opens /ui only, never the data-plane API.
    assert request(tr.url + "/v1/status", token=None, headers={"Cookie": f"p2psync_ui={TOKEN}"})[0] == 401

    names = [p.name for p in nodes]
    shot = tmp_path / "ui.png"
    # The browser holds no certificate of the cluster: it reaches the page through `p2psync ui`, a
    # loopback tunnel that presents a client certificate to the trainer over mutual TLS.
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    tunnel = subprocess.Popen(CLI + ["ui", "--node", tr.url, "--tls-dir", str(tlsutil.authority().client()),
                                     "--token-file", str(token_file)], stdout=subprocess.PIPE, text=True)
    page_url = tunnel.stdout.readline().strip()
    assert page_url.startswith("http://127.0.0.1:") and page_url.endswith(f"/ui?token={TOKEN}"), page_url

    async def drive() -> None:
        async with Browser.launch(tmp_path / "chromium", chromium) as browser:
            page = await browser.new_page(1280, 760)
            await page.goto(page_url)  # the address `p2psync ui` printed
            # The token went into an HttpOnly cookie and out of the address bar.
            assert await page.evaluate("location.pathname + location.search") == "/ui"
            assert await page.evaluate("document.cookie") == ""
            shown = json.loads(await page.wait_for(_all_at(NODES_JS, 0, names), 60, "every node at version 0"))
            assert set(shown) == set(names)
            # The edges drawn are the parents the nodes really pull from (the page and the nodes agree).
            real: list[str] = []
            for _ in range(100):
                drawn = await page.evaluate(EDGES_JS)
                real = await asyncio.to_thread(_real_edges, nodes)
                if drawn == real and len(real) == 3:
                    break
                await asyncio.sleep(0.2)
            assert drawn == real and len(real) == 3, (drawn, real)
            bands = await page.evaluate("[...document.querySelectorAll('#tree [data-region].band-label')]"
                                        ".map(e => e.dataset.region)")
            assert bands == ["us", "eu"]  # the trainer's region first
            shown_regions = await page.evaluate("Object.fromEntries([...document.querySelectorAll('#tree [data-node]')]"
                                                ".map(e => [e.dataset.node, e.dataset.region]))")
            assert shown_regions == regions
            shown_roles = await page.evaluate("Object.fromEntries([...document.querySelectorAll('#tree [data-node]')]"
                                              ".map(e => [e.dataset.node, e.dataset.role]))")
            assert shown_roles == roles
            assert "trainer (trainer) at v0 · 4/4 nodes" in await page.evaluate("document.getElementById('summary').textContent")

            polls = int(await page.evaluate("document.body.dataset.polls"))
            await asyncio.to_thread(w.step, cluster.publish_dir)
            # While the version flows, the page shows a transfer's progress.
            progress = await page.wait_for(
                "Math.max(0, ...[...document.querySelectorAll('#tree .bar')].map(b => parseFloat(b.dataset.progress))"
                ".filter(f => f > 0 && f < 1))", 90, "a transfer in progress", interval=0.05)
            assert 0 < progress < 1
            await page.screenshot(shot)
            shown = json.loads(await page.wait_for(_all_at(NODES_JS, 1, names), 90, "every node at version 1"))
            assert set(shown) == set(names)
            assert int(await page.evaluate("document.body.dataset.polls")) > polls  # it kept polling, no reload
            assert await page.evaluate("document.getElementById('error').hidden") is True
            errors = [c for c in browser.console if "exception" in c]
            assert not errors, errors

    try:
        asyncio.run(drive())
    finally:
        tunnel.terminate()
        tunnel.wait(30)
    for p in nodes:
        s = p.status()
        assert s["version"] == 1 and s["fingerprint"] == w.fingerprints[1]
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000
