"""The emulated WAN on real namespaces: built and removed without leftovers, caps and delays hold, and a
p2psync tree of real node processes over it delivers every version bit-exactly.

Needs root and iproute2 (CI runs as root); skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import needs
import pytest
from nodeproc import TOKEN, Workload

from p2psync.testbed import netns
from p2psync.testbed.config import from_dict
from p2psync.testbed.runner import Testbed

pytestmark = [
    pytest.mark.netns,
    pytest.mark.integration,
]
needs.netns()

# Unique per test process, so parallel runs (or another engineer's testbed) never collide.
NAME = f"t{os.getpid() % 10**6}"


def _host_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split(":")[1].strip().split("@")[0] for line in out.splitlines())


def _small(name: str, **over) -> dict:
    d = {"name": name, "trainer_region": "a", "default_latency_ms": 20,
         "regions": [{"name": "a", "wan_mbit": 0, "nodes": 1}, {"name": "b", "wan_mbit": 100, "nodes": 2}]}
    d.update(over)
    return d


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    yield d
    # Whatever a failing test left behind goes too (by this test's own prefix only).
    if netns.leftovers(NAME) or netns.read_state(NAME, d):
        netns.down(NAME, d)


@pytest.mark.timeout(60)
def test_up_and_down_leave_nothing_behind_also_after_a_crash(state_dir):
    ns_before, links_before = netns.existing_namespaces(), _host_links()
    cfg = from_dict(_small(NAME))
    tb = Testbed.up(cfg, state_dir)
    assert set(cfg.namespaces()) <= set(netns.existing_namespaces())
    assert _host_links() == links_before  # every veth end lives inside the testbed
    st = netns.status(NAME, state_dir)
    assert st["complete"] and not st["missing"] and st["delay_line"]["alive"]
    # No route out of the testbed: a machine cannot reach an address outside its subnet.
    r = tb.run("b-0", ["ip", "route", "get", "192.0.2.1"], capture_output=True, text=True)
    assert r.returncode != 0 and "unreachable" in r.stderr.lower()
    # A process inside a machine keeps running when the controlling process dies...
    sleeper = tb.spawn("b-1", ["sleep", "600"])
    # ...and the state file survives the "crash"; `down` from a fresh process removes everything.
    out = subprocess.run([sys.executable, "-m", "p2psync.cli", "testbed", "down", "--name", NAME,
                          "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert sleeper.wait(10) == -signal.SIGTERM
    assert not [ns for ns in netns.existing_namespaces() if ns.startswith(f"{NAME}-")]
    assert sorted(netns.existing_namespaces()) == sorted(ns_before)
    assert _host_links() == links_before
    assert not netns.state_path(NAME, state_dir).exists()
    # A crash half way through `up` (state file lost too): the next `up` of the name clears the leftovers.
    subprocess.run(["ip", "netns", "add", f"{NAME}-core"], check=True)
    tb = Testbed.up(cfg, state_dir)
    tb.down()
    assert not netns.leftovers(NAME)


@pytest.mark.timeout(90)
def test_caps_and_delays_hold_on_real_tcp(state_dir):
    cfg = from_dict(_small(NAME))
    with Testbed.up(cfg, state_dir) as tb:
        dst = tb.machines["b-0"]
        server = tb.spawn("b-0", [sys.executable, "-m", "p2psync.testbed.probe", "serve", "--host", dst.ip],
                          stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"

            def probe(src: str, *args: str) -> dict:
                r = tb.run(src, [sys.executable, "-m", "p2psync.testbed.probe", *args, "--host", dst.ip],
                           capture_output=True, text=True, timeout=60)
                assert r.returncode == 0, r.stderr
                return json.loads(r.stdout)

            # Region b's WAN link is capped at 100 Mbit/s: a 20 MB transfer from region a cannot beat it
            # (5 % slack for the burst), and must get a fair part of it (a loose floor: shared CPU).
            far = probe("trainer", "bulk", "--mbytes", "20")
            assert far["bytes"] == 20_000_000
            assert far["mbit_s"] <= 100 * 1.05, far
            assert far["mbit_s"] >= 100 * 0.25, far
            # Inside region b nothing is capped: the same transfer is much faster than the WAN cap.
            near = probe("b-1", "bulk", "--mbytes", "20")
            assert near["mbit_s"] > 3 * 100, near
            # 20 ms one way between regions: every round trip takes at least 40 ms; none inside a region.
            assert min(probe("trainer", "rtt")["rtt_ms"]) >= 40.0
            assert min(probe("b-1", "rtt")["rtt_ms"]) < 10.0
        finally:
            Testbed.stop([server])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_p2psync_tree_over_the_wan_is_bit_exact(state_dir, tmp_path):
    from p2psync import keys
    from p2psync.testbed import nodes
    from p2psync.testbed.model import network_model
    from topology.planner import PlannerConfig, plan

    cfg = from_dict(_small(NAME))
    keydir, publish, work = tmp_path / "keys", tmp_path / "publish", tmp_path / "work"
    for d in (publish, work):
        d.mkdir()
    priv = keys.generate()
    keys.write_pair(priv, keydir)
    wl = Workload(priv, numel=200_000, fraction=0.03)
    staged = tmp_path / "staged"
    staged.mkdir()
    artifacts = [wl.snapshot(staged), wl.step(staged), wl.step(staged)]
    with Testbed.up(cfg, state_dir) as tb:
        p = plan(network_model(cfg), PlannerConfig(payload_bytes=artifacts[1].stat().st_size, chunk_bytes=1 << 16))
        # The planner sends region b's copy over the capped WAN once: exactly one b machine pulls from a.
        assert sum(1 for c, par in p.parents.items() if cfg.machine(c).region == "b"
                   and cfg.machine(par).region != "b") == 1
        parents = {c: [par, *p.fallbacks.get(c, [])] for c, par in p.parents.items()}
        ns = nodes.start(tb, parents, work, keydir, TOKEN, publish,
                         extra=["--limits.stall_timeout=5", "--limits.poll_interval=1", "--limits.sse_keepalive=1",
                                "--store.snapshot_chunk_size=65536"])
        try:
            for a in artifacts:
                os.link(a, publish / a.name)
            seen = ns.watch(version=2, timeout=90)
        finally:
            ns.stop()
        assert seen["timed_out"] == []
        assert {n: r["fingerprint"] for n, r in seen["nodes"].items()} == {n: wl.fingerprints[2] for n in ns.urls}


@pytest.mark.timeout(90)
def test_link_faults_partition_and_heal_at_run_time(state_dir):
    from p2psync.testbed.delay import LinkFaults

    cfg = from_dict(_small(NAME))
    with Testbed.up(cfg, state_dir) as tb:
        dst = tb.machines["b-0"]
        server = tb.spawn("b-0", [sys.executable, "-m", "p2psync.testbed.probe", "serve", "--host", dst.ip],
                          stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"

            def rtt(timeout: float) -> subprocess.CompletedProcess:
                return tb.run("trainer", [sys.executable, "-m", "p2psync.testbed.probe", "rtt", "--host", dst.ip,
                                          "--count", "3"], capture_output=True, text=True, timeout=timeout)

            assert rtt(60).returncode == 0
            # A partition a -> b (one direction is enough to stop TCP): nothing gets through ...
            got = tb.set_link_faults({("a", "b"): LinkFaults(drop=1.0)})
            assert got["faults"] == [[1, 2, {"drop": 1.0}]]
            with pytest.raises(subprocess.TimeoutExpired):
                rtt(5)
            assert tb.set_link_faults({})["fault_dropped"] > 0
            # ... and healed, the link works again, with its delay.
            healed = rtt(60)
            assert healed.returncode == 0 and min(json.loads(healed.stdout)["rtt_ms"]) >= 40.0
            # 20 % loss each way slows TCP but loses nothing; extra delay adds to the round trip.
            tb.set_link_faults({("a", "b"): LinkFaults(drop=0.2, delay_s=0.05), ("b", "a"): LinkFaults(drop=0.2)})
            lossy = rtt(60)
            assert lossy.returncode == 0 and min(json.loads(lossy.stdout)["rtt_ms"]) >= 90.0
        finally:
            Testbed.stop([server])
