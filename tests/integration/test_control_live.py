"""The live control plane with real ``p2psync node`` processes on loopback: gossip membership, the
live plan, leases and migration, under kill -9, SIGSTOP and SIGTERM (preemption).

The trainer runs ``tests.control_jobs:trainer`` (submits work, writes each accepted result to a
file); rollout nodes run ``tests.control_jobs:rollout`` (slow, deterministic fake tokens whose
values say which node made them and at which position).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from nodeproc import Cluster, Proc, Workload, at_version, get_json, wait_for

from tests.control_jobs import tag

pytestmark = pytest.mark.integration

# Fast failure detection and short leases, so that the test takes seconds, not minutes (but not so
# fast that a node starved of CPU on a shared 2-core machine is taken for dead every few seconds).
CONTROL = ["--gossip.interval=0.5", "--gossip.suspect_after=5", "--gossip.dead_after=5",
           "--gossip.report_interval=2", "--control.lease_ttl=4", "--control.replan_delay=0.2"]


def _job_files(root: Path, work: int, max_new_tokens: int, token_delay: float) -> tuple[Path, Path, Path]:
    """Results file and job configs; the trainer job submits once ``root / "start"`` exists."""
    out, logs = root / "results.jsonl", root / "worklogs"
    logs.mkdir()
    tj, rj = root / "trainer-job.json", root / "rollout-job.json"
    tj.write_text(json.dumps({"work": work, "responses": 2, "max_new_tokens": max_new_tokens, "out": str(out),
                              "start_file": str(root / "start")}))
    rj.write_text(json.dumps({"token_delay": token_delay, "report_every": 4, "log_dir": str(logs)}))
    return out, tj, rj


def _results(out: Path) -> tuple[list[dict], bool]:
    if not out.exists():
        return [], False
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return [x for x in lines if "work_id" in x], any(x.get("done") for x in lines)


def _check_exactly_once(results: list[dict], work: int, max_new_tokens: int) -> None:
    ids = [r["work_id"] for r in results]
    assert sorted(ids) == [f"w{i:03d}" for i in range(work)], ids  # each work id once, none lost
    for r in results:
        assert len(r["responses"]) == 2
        for resp in r["responses"]:
            toks = resp["tokens"]
            assert len(toks) == len(resp["logprobs"]) == len(resp["versions"]) == max_new_tokens, r["work_id"]
            # Every position made once, in order: no token lost or repeated across a migration.
            assert [t % 10_000 for t in toks] == list(range(max_new_tokens)), (r["work_id"], toks)
            assert resp["logprobs"] == [-0.5 - (i % 7) / 10 for i in range(max_new_tokens)]


def _producers(resp: dict) -> list[int]:
    """Tags of the nodes that made a response, in order of the positions they made."""
    out: list[int] = []
    for t in resp["tokens"]:
        if not out or out[-1] != t // 10_000:
            out.append(t // 10_000)
    return out


def _holds_work(tr: Proc, p: Proc, logs: Path, min_tokens: int) -> str | None:
    """A work id that the coordinator says ``p`` holds and on which ``p`` has had at least
    ``min_tokens`` tokens of one response accepted by the coordinator (per its job log)."""
    held = get_json(tr.url + "/v1/control/status")["holders"].get(p.name, [])
    log = logs / f"{p.name}.jsonl"
    if not held or not log.exists():
        return None
    reported: dict[str, int] = {}
    for line in log.read_text().splitlines():
        if line.strip() and "reported" in (x := json.loads(line)):
            reported[x["work_id"]] = max(reported.get(x["work_id"], 0), x["reported"])
    return next((w for w in held if reported.get(w, 0) >= min_tokens), None)


def _cluster(p: Proc) -> dict[str, dict]:
    return {n["id"]: n for n in get_json(p.url + "/v1/cluster")["nodes"]}


def _all_at(procs: list[Proc], version: int, fingerprint: str) -> None:
    for p in procs:
        s = wait_for(lambda p=p: at_version(p, version), 150, f"{p.name} at version {version}")
        assert s["version"] == version and s["fingerprint"] == fingerprint, (p.name, s["version"])


@pytest.mark.timeout(400)
def test_relay_killed_and_rollout_stopped_mid_step(cluster: Cluster, tmp_path: Path):
    work, max_new = 10, 24
    out, tj, rj = _job_files(tmp_path, work, max_new, token_delay=0.06)
    w = Workload(cluster.priv, numel=1_200_000, fraction=0.5)
    w.snapshot(cluster.publish_dir)
    # Saved probe figures (as `p2psync plan --probe` writes them): a 1 Gbit/s trainer uplink, so the
    # planner feeds the rollout nodes through the 10 Gbit/s relays rather than directly.
    from topology.model import NetworkModel, NodeSpec

    measured = tmp_path / "measurements.json"
    NetworkModel([NodeSpec("trainer", "default", "trainer", uplink_bps=1e9, downlink_bps=1e9),
                  *(NodeSpec(f"relay-{i}", "default", "relay", uplink_bps=10e9, downlink_bps=10e9) for i in range(2)),
                  *(NodeSpec(f"rollout-{i}", "default", "rollout", uplink_bps=1e9, downlink_bps=1e9)
                    for i in range(4))]).save(measured)
    tr = cluster.start("trainer", "trainer", publish=True,
                       extra=[*CONTROL, f"--probe.measurements={measured}", "--job", "tests.control_jobs:trainer",
                              "--job-config", str(tj)])
    gossip = [*CONTROL, f"--gossip.seeds={tr.url}"]
    relays = [cluster.start(f"relay-{i}", "relay", [tr.url], extra=[*gossip, "--testing.serve_delay=0.25"])
              for i in range(2)]
    relay_urls = {r.url: r for r in relays}
    kids = [cluster.start(f"rollout-{i}", "rollout", [relays[i % 2].url, tr.url],
                          extra=[*gossip, "--limits.parallel_streams=2", "--job", "tests.control_jobs:rollout",
                                 "--job-config", str(rj)]) for i in range(4)]
    everyone = [tr, *relays, *kids]
    _all_at(everyone, 0, w.fingerprints[0])
    # Gossip: the trainer knows every node alive, and has planned a parent for each.
    view = wait_for(lambda: (c := _cluster(tr)) and len(c) == 7 and all(n["status"] == "alive" for n in c.values())
                    and all(c[p.name]["parent"] for p in everyone[1:]) and c, 30, "a full, planned cluster")
    assert view["trainer"]["parent"] is None and view["trainer"]["role"] == "trainer"
    (tmp_path / "start").touch()

    # SIGSTOP a rollout node while it is generating, once it has reported some tokens.
    frozen = kids[3]
    held = wait_for(lambda: _holds_work(tr, frozen, tmp_path / "worklogs", 4), 60,
                    f"{frozen.name} holding work with tokens reported", interval=0.05)
    frozen.kill(signal.SIGSTOP)

    # The plan puts rollout nodes under the relays (10x the trainer's uplink), and they follow it.
    def under_relay():
        c = _cluster(tr)
        return any(c[k.name]["parent"] in {r.name for r in relays} and k.status()["parent"] in relay_urls
                   for k in kids[:3])
    wait_for(under_relay, 60, "a rollout node pulling from a relay, as planned")

    # kill -9 the relay that a node is pulling a delta from, mid-transfer.
    w.step(cluster.publish_dir)

    def mid_transfer():
        for k in [*kids[:3], *relays]:
            s = k.status()
            for t in s["transfers"].values():
                if 0 < t["chunks_held"] < t["chunks"] and s["parent"] in relay_urls:
                    return k, s["parent"]
        return None

    child, parent_url = wait_for(mid_transfer, 60, "a transfer through a relay in progress", interval=0.02)
    victim = relay_urls[parent_url]
    victim.kill(signal.SIGKILL)
    victim.popen.wait(10)
    survivors = [p for p in everyone if p is not victim and p is not frozen]
    _all_at(survivors, 1, w.fingerprints[1])

    # The coordinator saw the relay die and re-planned without it: nobody's planned parent is it.
    def replanned():
        c = _cluster(tr)
        return (c.get(victim.name, {}).get("status") in ("suspect", "dead", None)
                and all(n["parent"] != victim.name for n in c.values()) and c)
    wait_for(replanned, 30, "a plan without the killed relay")

    # The frozen node's lease expires; its work moves on with its tokens. Then it wakes up.
    def moved_on():
        holders = get_json(tr.url + "/v1/control/status")["holders"]
        return (any(held in ws for n, ws in holders.items() if n != frozen.name)
                or any(r["work_id"] == held for r in _results(out)[0]))
    wait_for(moved_on, 60, "the frozen node's work to move to another node")
    frozen.kill(signal.SIGCONT)
    survivors.append(frozen)
    w.step(cluster.publish_dir)
    w.step(cluster.publish_dir)
    results = wait_for(lambda: (r := _results(out))[1] and r[0], 120, "every work id completed")
    _all_at(survivors, 3, w.fingerprints[3])

    _check_exactly_once(results, work, max_new)
    by_id = {r["work_id"]: r for r in results}
    moved = by_id[held]
    assert moved["migrated"], moved
    # The migrated response continues from the frozen node's tokens: its prefix, then another node.
    made = [_producers(resp) for resp in moved["responses"]]
    assert any(p[0] == tag(frozen.name) and len(p) > 1 for p in made), made
    status = get_json(tr.url + "/v1/control/status")
    assert status["completed"] == work and status["pending"] == 0 and status["leased"] == 0


@pytest.mark.timeout(400)
def test_thirty_percent_of_rollout_nodes_preempted_loses_nothing(cluster: Cluster, tmp_path: Path):
    work, max_new = 14, 24
    out, tj, rj = _job_files(tmp_path, work, max_new, token_delay=0.1)
    w = Workload(cluster.priv)
    w.snapshot(cluster.publish_dir)
    tr = cluster.start("trainer", "trainer", publish=True,
                       extra=[*CONTROL, "--job", "tests.control_jobs:trainer", "--job-config", str(tj)])
    kids = [cluster.start(f"rollout-{i}", "rollout", [tr.url],
                          extra=[*CONTROL, f"--gossip.seeds={tr.url}", "--gossip.node_class=preemptible",
                                 "--job", "tests.control_jobs:rollout", "--job-config", str(rj)])
            for i in range(6)]
    _all_at([tr, *kids], 0, w.fingerprints[0])
    (tmp_path / "start").touch()
    # Preempt 2 of 6 (a third) while each holds work with tokens reported.
    preempted = kids[:2]
    # Both at once, then preempt at once: waiting for one while the other finishes its work would
    # leave nothing of it to migrate.
    def both_hold():
        h = {p.name: _holds_work(tr, p, tmp_path / "worklogs", 4) for p in preempted}
        return all(h.values()) and h
    held = wait_for(both_hold, 60, "the nodes to preempt holding work with tokens reported", interval=0.05)
    for p in preempted:
        p.kill(signal.SIGTERM)
    for p in preempted:
        assert p.popen.wait(30) == 0, p.log.read_text()[-2000:]
        assert "handed back" in p.log.read_text()
    # Their leases moved at once (no ttl wait): nothing is held by them any more.
    holders = get_json(tr.url + "/v1/control/status")["holders"]
    assert not any(p.name in holders for p in preempted), holders
    w.step(cluster.publish_dir)
    results = wait_for(lambda: (r := _results(out))[1] and r[0], 120, "every work id completed")
    _check_exactly_once(results, work, max_new)
    status = get_json(tr.url + "/v1/control/status")
    assert status["completed"] == work and status["pending"] == 0  # late duplicates (if any) were dropped
    by_id = {r["work_id"]: r for r in results}
    for p in preempted:
        r = by_id[held[p.name]]
        assert r["migrated"] and r["node"] != p.name, r
        assert any(_producers(x)[0] == tag(p.name) for x in r["responses"]), r  # continued from its tokens
    # The leavers are known as left, the others alive; every survivor holds the head bit-exact.
    c = wait_for(lambda: (c := _cluster(tr)) and all(c[p.name]["status"] == "left" for p in preempted) and c,
                 20, "the preempted nodes known as left")
    assert all(c[p.name]["status"] == "alive" for p in kids[2:])
    _all_at([tr, *kids[2:]], 1, w.fingerprints[1])
