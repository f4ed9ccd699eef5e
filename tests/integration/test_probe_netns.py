"""`p2psync plan --probe` on an emulated WAN: the probe measures the rate a `tc tbf` cap really allows.

Two regions of two machines each in network namespaces (:mod:`p2psync.testbed`); region b's link to
the WAN core is capped with tbf. Real `p2psync node` processes run inside the namespaces, and
`p2psync plan --probe` runs in the core namespace against them. A user would notice if the measured
cross-region rate were not the cap, if the uncapped pairs inside a region looked like the WAN, or if
the plan sent the delta over the WAN more than once.

Needs root, iproute2 and /dev/net/tun (CI runs as root); skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import statistics

import needs
import pytest
from nodeproc import TOKEN

from p2psync.testbed import netns
from p2psync.testbed.config import from_dict
from p2psync.testbed.runner import Testbed

pytestmark = [
    pytest.mark.netns,
    pytest.mark.integration,
]
needs.netns()

# Unique per test process, so parallel runs (or another engineer's testbed) never collide.
NAME = f"pr{os.getpid() % 10**6}"
# 20 Mbit/s, not more: tbf's bucket (two 64 KB packets at least) then bridges a sender stalled ~50 ms by a
# busy CPU without losing rate, so the figure is the cap and not the machine's load (2 shared cores in CI).
CAP_MBIT = 20


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    yield d
    # Whatever a failing test left behind goes too (by this test's own prefix only).
    if netns.leftovers(NAME) or netns.read_state(NAME, d):
        netns.down(NAME, d)


@pytest.mark.timeout(120)
def test_probe_measures_the_tbf_cap_and_the_plan_enters_each_region_once(state_dir, tmp_path):
    from p2psync import keys
    from p2psync.testbed import nodes
    from topology.tree import Plan

    # Region a: the trainer and a-0, uncapped towards the core; region b: b-0 and b-1 behind a
    # 20 Mbit/s link each way. No added delay: the delay line is a user-space process, and on a loaded
    # machine its scheduling, not the cap, would set the rate (the testbed's own tests cover delays).
    cfg = from_dict({"name": NAME, "trainer_region": "a", "default_latency_ms": 0,
                     "regions": [{"name": "a", "wan_mbit": 0, "nodes": 1},
                                 {"name": "b", "wan_mbit": CAP_MBIT, "nodes": 2}]})
    keydir, publish, work = tmp_path / "keys", tmp_path / "publish", tmp_path / "work"
    for d in (publish, work):
        d.mkdir()
    keys.write_pair(keys.generate(), keydir)
    plan_path, measured_path = tmp_path / "plan.json", tmp_path / "measured.json"
    with Testbed.up(cfg, state_dir) as tb:
        region = {m.id: m.region for m in tb.machines.values()}
        assert sorted(region.values()) == ["a", "a", "b", "b"]
        # Any tree will do: the nodes only need to be up and serving their probe endpoints.
        parents = {"a-0": ["trainer"], "b-0": ["trainer"], "b-1": ["b-0"]}
        ns = nodes.start(tb, parents, work, keydir, TOKEN, publish)
        try:
            out = tb.run("core", [*nodes.CLI, "plan", "--probe", *ns.urls.values(), "--token", TOKEN,
                                  "--probe-bytes", str(8 << 20), "--rtt-samples", "3", "--parallel", "1", "--no-sim",
                                  "--tls-dir", str(ns.tls_dir),
                                  "-o", str(plan_path), "--save-measurements", str(measured_path)],
                         capture_output=True, text=True, timeout=90)
        finally:
            ns.stop()
    assert out.returncode == 0, out.stderr[-3000:]

    results = json.loads(measured_path.read_text())["probe"]["results"]
    seen = ", ".join(f"{r['src']}->{r['dst']} {r['bandwidth_bps'] / 1e6:.1f} Mbit/s" for r in results)
    print(f"measured: {seen}")  # shown with -s, and with a failure
    cross = [r for r in results if region[r["src"]] != region[r["dst"]]]
    inside = [r for r in results if region[r["src"]] == region[r["dst"]]]
    # Both directions of the capped link, and every pair inside region b (all pairs in a small region).
    assert {(region[r["src"]], region[r["dst"]]) for r in cross} == {("a", "b"), ("b", "a")}, seen
    assert {(r["src"], r["dst"]) for r in inside} >= {("b-0", "b-1"), ("b-1", "b-0"), ("trainer", "a-0")}
    for r in cross:
        mbit = r["bandwidth_bps"] / 1e6
        assert CAP_MBIT * 0.7 <= mbit <= CAP_MBIT * 1.3, f"{r['src']} -> {r['dst']} across the cap; all: {seen}"
    # Inside a region nothing is capped: every pair clearly above the cap, typically far above it (a
    # single pair can be held back by a CPU-starved node process on a busy machine; the median cannot).
    for r in inside:
        assert r["bandwidth_bps"] / 1e6 > 1.5 * CAP_MBIT, f"{r['src']} -> {r['dst']} inside a region; all: {seen}"
    assert statistics.median(r["bandwidth_bps"] for r in inside) / 1e6 > 5 * CAP_MBIT, seen
    # The printed matrix and plan come with the command's output.
    assert "trainer" in out.stdout and "b-1" in out.stdout

    plan = Plan.load(plan_path)
    assert set(plan.parents) == {"a-0", "b-0", "b-1"}
    entries = [(c, p) for c, p in plan.parents.items() if region[c] != region[p]]
    assert len(entries) == 1 and region[entries[0][0]] == "b", plan.parents  # over the WAN once, into b
