"""Control-plane services in real nodes on loopback (one process, real HTTP): the coordinator's
lease API and its errors, migration with the full token history, hand-back on stop, gossip
membership, the live plan followed by the nodes' parent choice, forged entries refused."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import tlsutil

from p2psync import config, keys
from p2psync.control.api import ResponseResult
from p2psync.errors import LeaseExpired
from p2psync.gossip.items import CoordEntry, MemberEntry, plan_shard
from p2psync.gossip.messages import Delta, Report, dumps
from p2psync.gossip.signing import signer
from p2psync.node import Node

pytestmark = pytest.mark.timeout(90)

TOKEN = "test-cluster-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = {"gossip": {"interval": 0.1, "suspect_after": 1.0, "dead_after": 1.0}}


class Keys:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.priv = keys.generate()
        keys.write_pair(self.priv, root / "keys")

    def cfg(self, name: str, role: str, *, seeds: list[str] = (), parents: list[str] = (), **over) -> config.NodeConfig:
        o = json.loads(json.dumps(FAST))
        o["gossip"]["seeds"] = list(seeds)
        for k, v in over.items():
            o.setdefault(k, {}).update(v)
        extra = {"trainer_private_key": str(self.root / "keys/trainer.key")} if role == "trainer" else {}
        return config.load(overrides=o, id=name, role=role, data_dir=str(self.root / name), cluster_token=TOKEN,
                           trainer_public_key=str(self.root / "keys/trainer.pub"), parents=list(parents) or None,
                           **extra)


async def _until(pred, timeout: float = 20.0, what: str = "condition"):
    async with asyncio.timeout(timeout):
        while not (v := pred()):
            await asyncio.sleep(0.05)
    return v


async def _post(url: str, body, raw: bytes | None = None, as_node: str | None = None) -> tuple[int, dict]:
    """POST as the node the body names (its certificate; ``as_node``: another node's)."""
    node = as_node or (body.get("node") if isinstance(body, dict) else None) or "client"
    async with aiohttp.ClientSession(headers=AUTH, connector=tlsutil.node_tls(str(node)).connector()) as s:
        async with s.post(url, data=raw if raw is not None else json.dumps(body)) as r:
            return r.status, await r.json(content_type=None)


def _result(tokens: list[int], version: int = 0) -> ResponseResult:
    return ResponseResult(tokens, [-1.0] * len(tokens), [version] * len(tokens), "stop")


def test_lease_api_errors_leave_state_untouched(tmp_path):
    k = Keys(tmp_path)

    async def go():
        tr = await Node.create(k.cfg("trainer", "trainer", control={"lease_ttl": 3.0}))
        try:
            tr.coordinator.submit("w1", {"p": 1}, responses=2)
            base = tr.address + "/v1/control"
            before = tr.coordinator.table.counts()
            assert (await _post(base + "/lease", None, raw=b"not json"))[0] == 400
            assert (await _post(base + "/lease", {"max_items": 1}))[0] == 400  # no node
            assert (await _post(base + "/lease", {"node": "a", "max_items": 0}))[0] == 400
            assert (await _post(base + "/renew", {"node": "a", "work_id": "nope", "lease_id": 1}))[0] == 404
            assert tr.coordinator.table.counts() == before
            status, got = await _post(base + "/lease", {"node": "a", "max_items": 1, "wait": 1})
            assert status == 200 and [g["work_id"] for g in got["grants"]] == ["w1"]
            lid = got["grants"][0]["lease_id"]
            prog = {"node": "a", "work_id": "w1", "lease_id": lid, "response": 0, "offset": 0, "tokens": [1, 2],
                    "logprobs": [-1.0], "versions": [0, 0]}
            assert (await _post(base + "/progress", prog))[0] == 400  # lengths differ
            assert (await _post(base + "/progress", {**prog, "logprobs": [-1.0, -1.0], "response": 5}))[0] == 400
            status, gap = await _post(base + "/progress", {**prog, "logprobs": [-1.0, -1.0], "offset": 3})
            assert status == 409 and gap["kind"] == "gap" and gap["have"] == 0
            assert tr.coordinator.table.tokens("w1") == {0: ()}
            assert (await _post(base + "/complete", {"node": "a", "work_id": "w1", "lease_id": lid,
                                                     "responses": {"0": _result([1]).to_json()}}))[0] == 400
            assert tr.coordinator.table.counts()["completed"] == 0
            await asyncio.sleep(3.5)  # the lease expires (nobody renews it)
            status, exp = await _post(base + "/renew", {"node": "a", "work_id": "w1", "lease_id": lid})
            assert status == 409 and exp["kind"] == "expired"
            assert (await _post(base + "/progress", {**prog, "logprobs": [-1.0, -1.0]}))[0] == 409
            assert tr.coordinator.table.counts()["queued"] == 1
            assert tr.coordinator.pending() == 1
        finally:
            await tr.close()

    asyncio.run(go())


def test_work_goes_by_the_version_a_lease_request_states_not_a_stale_gossip_report(tmp_path):
    """A node's gossip report waits for its next gossip round; the version its lease request states
    is fresher. A node that took the head since its report gets work at once; a bad version field is
    refused with nothing granted; a later report (a restarted node, say) wins over an older request."""
    k = Keys(tmp_path)

    async def go():
        tr = await Node.create(k.cfg("trainer", "trainer", control={"max_staleness": 1}))
        try:
            co, g = tr.coordinator, tr.gossip.gossip
            co._head = lambda: 5  # the trainer published version 5
            g.reports["a"] = (time.time(), Report("a", 0, (3,), 0.0, 0.0))  # last round a held 3
            co.submit("w1", {"p": 1})
            base = tr.address + "/v1/control"
            status, got = await _post(base + "/lease", {"node": "a", "max_items": 1, "wait": 0.3})
            assert status == 200 and got["grants"] == []  # 3 < 5 - 1: outside the bound
            for bad in (-1, "5", True, 1.5):
                status, err = await _post(base + "/lease", {"node": "a", "max_items": 1, "wait": 0, "version": bad})
                assert status == 400 and "version" in err["error"]
            assert co.table.counts()["queued"] == 1
            status, got = await _post(base + "/lease", {"node": "a", "max_items": 1, "wait": 1, "version": 5})
            assert status == 200 and [x["work_id"] for x in got["grants"]] == ["w1"]
            co.submit("w2", {"p": 2})
            g.reports["a"] = (time.time() + 1, Report("a", 1, (2,), 0.0, 0.0))  # restarted, holds 2 now
            status, got = await _post(base + "/lease", {"node": "a", "max_items": 1, "wait": 0.3})
            assert status == 200 and got["grants"] == []
        finally:
            await tr.close()

    asyncio.run(go())


def test_migration_keeps_full_history_and_results_come_once(tmp_path):
    k = Keys(tmp_path)

    async def go():
        tr = await Node.create(k.cfg("trainer", "trainer"))
        a = await Node.create(k.cfg("a", "rollout", seeds=[tr.address], parents=[tr.address]))
        b = await Node.create(k.cfg("b", "rollout", seeds=[tr.address], parents=[tr.address]))
        try:
            await _until(lambda: a.work.coordinator_url() and b.work.coordinator_url())
            tr.coordinator.submit("w1", {"prompt_ids": [1]}, responses=2)
            tr.coordinator.submit("w1", {"prompt_ids": [2]}, responses=2)  # idempotent
            [g] = await a.work.request(2, wait=5)
            assert g.work_id == "w1" and g.resume == {} and g.done == {}
            await a.work.progress(g, 0, 0, [10, 11, 12], [-0.1, -0.2, -0.3], [4, 4, 5])
            await a.work.progress(g, 1, 0, [20], [-0.9], [5], finish_reason="stop")
            await a.work.progress(g, 0, 2, [13, 14], [-0.35, -0.4], [5, 5])  # overlap: replaces token 2
            await a.close()  # stop hands back the grant at once, with its tokens
            [g2] = await b.work.request(1, wait=5)
            assert g2.lease_id > g.lease_id
            assert g2.resume == {0: ([10, 11, 13, 14], [-0.1, -0.2, -0.35, -0.4], [4, 4, 5, 5])}
            assert g2.done == {1: ResponseResult([20], [-0.9], [5], "stop").to_json()}
            final = {0: ResponseResult([10, 11, 13, 14, 15], [-0.1, -0.2, -0.35, -0.4, -0.5], [4, 4, 5, 5, 6], "stop"),
                     1: ResponseResult.from_json(g2.done[1])}
            assert await b.work.complete(g2, final) is True
            it = tr.coordinator.results()
            r = await anext(it)
            assert (r.work_id, r.node, r.migrated) == ("w1", "b", True)
            assert r.responses == [final[0], final[1]] and r.payload == {"prompt_ids": [1]}
            assert tr.coordinator.pending() == 0
            # The old holder's late result is a duplicate: dropped, not yielded again.
            status, dup = await _post(tr.address + "/v1/control/complete", {
                "node": "a", "work_id": "w1", "lease_id": g.lease_id,
                "responses": {str(i): x.to_json() for i, x in final.items()}})
            assert status == 200 and dup["accepted"] is False
            with pytest.raises(LeaseExpired):
                await b.work.progress(g2, 0, 0, [1], [0.0], [0])  # completed: no longer held
            with pytest.raises(asyncio.TimeoutError):
                async with asyncio.timeout(0.3):
                    await anext(it)
        finally:
            await b.close()
            await tr.close()

    asyncio.run(go())


def test_gossip_membership_live_plan_and_parent_switch(tmp_path):
    k = Keys(tmp_path)

    # Saved probe figures (as `p2psync plan --probe` writes them): a 1 Gbit/s trainer uplink shared
    # by two children is a tighter share than the relay's 10 Gbit/s, so the relay feeds the leaf.
    from topology.model import NetworkModel, NodeSpec

    measured = tmp_path / "measurements.json"
    NetworkModel([NodeSpec("trainer", "default", "trainer", uplink_bps=1e9, downlink_bps=1e9),
                  NodeSpec("relay", "default", "relay", uplink_bps=10e9, downlink_bps=10e9),
                  NodeSpec("leaf", "default", "rollout", uplink_bps=1e9, downlink_bps=1e9)]).save(measured)

    async def go():
        tr = await Node.create(k.cfg("trainer", "trainer", probe={"measurements": str(measured)}))
        relay = await Node.create(k.cfg("relay", "relay", seeds=[tr.address], parents=[tr.address]))
        # The leaf joins a tree that already has the relay (a join is placed where it is best; the
        # nodes already placed are not moved for it).
        await _until(lambda: any(n["id"] == "relay" and n["parent"] for n in tr.cluster()))
        leaf = await Node.create(k.cfg("leaf", "rollout", seeds=[tr.address], parents=[tr.address]))
        try:
            def full():
                c = {n["id"]: n for n in leaf.cluster()}
                return len(c) == 3 and all(n["status"] == "alive" for n in c.values()) and c["leaf"]["parent"] and c
            c = await _until(full)
            assert set(c["relay"]) >= {"id", "role", "region", "address", "version", "status", "parent"}
            assert c["relay"]["address"] == relay.address and c["trainer"]["parent"] is None
            # The relay is planned as the leaf's parent, and the leaf pulls from it first, its
            # configured parent second.
            assert c["leaf"]["parent"] == "relay"
            await _until(lambda: leaf.upstream.parents.candidates == [relay.address, tr.address])
            # The relay leaves: the coordinator re-plans and the leaf goes back to the trainer.
            await relay.close()
            await _until(lambda: {n["id"]: n for n in tr.cluster()}["relay"]["status"] == "left")
            await _until(lambda: leaf.upstream.parents.candidates == [tr.address])
            assert {n["id"]: n["parent"] for n in tr.cluster()}["leaf"] == "trainer"
        finally:
            await leaf.close()
            await tr.close()

    asyncio.run(go())


def test_forged_coordinator_entries_are_refused(tmp_path):
    k = Keys(tmp_path)

    async def go():
        tr = await Node.create(k.cfg("trainer", "trainer"))
        leaf = await Node.create(k.cfg("leaf", "rollout", seeds=[tr.address], parents=[tr.address]))
        try:
            g = leaf.gossip.gossip
            await _until(lambda: g.coord.plan is not None)
            plan_before = g.coord.plan
            url = leaf.address + "/v1/gossip"
            hdr = {**AUTH, "X-P2PSync-Gossip-From": "http://127.0.0.1:9"}
            evil = {"epoch": 99, "root": "trainer", "parents": {"leaf": "relay-evil"}}
            # A relay claiming the trainer as writer: unsigned, signed by another key, or altered.
            other = signer(keys.generate())
            shard = f"plan/{plan_shard('leaf')}"
            good = signer(k.priv)(CoordEntry(shard, 10**15, "trainer",
                                             {"epoch": 1, "root": "trainer", "parents": {"leaf": "trainer"}}))
            forged = [CoordEntry(shard, 10**15, "trainer", evil),
                      other(CoordEntry(shard, 10**15, "trainer", evil)),
                      CoordEntry(shard, 10**15, "trainer", evil, good.signature)]
            # A relay with a valid certificate of its own, forging what the coordinator writes.
            async with aiohttp.ClientSession(headers=hdr, connector=tlsutil.node_tls("relay-evil").connector()) as s:
                for e in forged:
                    async with s.post(url, data=dumps(Delta("relay-evil", coord=(e,)))) as r:
                        assert r.status == 204
                async with s.post(url, data=b'{"format": 1, "type": "nope"}') as r:
                    assert r.status == 400
                async with s.post(url, data=dumps(Delta("x")), headers={"X-P2PSync-Gossip-From": ""}) as r:
                    assert r.status == 400
            assert g.coord.rejected >= 3
            assert "relay-evil" not in g.coord.plan[2].values() and g.coord.plan[0] == plan_before[0]
            assert leaf.upstream.parents.candidates[0] != "relay-evil"
        finally:
            await leaf.close()
            await tr.close()

    asyncio.run(go())


def test_gossip_takes_bodies_to_its_own_limit_and_refuses_larger_unread(tmp_path):
    """After a partition heals a node relearns nearly the whole member table: ``/v1/gossip`` takes a
    Delta of 2,000 members (~370 KB, over the node's general 64 KiB body limit) and merges them; one
    over ``gossip.max_body_bytes`` is refused (413) with none merged, and the general limit still
    holds on every other endpoint."""
    k = Keys(tmp_path)

    def members(prefix: str, n: int) -> tuple[MemberEntry, ...]:
        return tuple(MemberEntry(id=f"{prefix}{i:05d}", address=f"https://10.1.{i // 256}.{i % 256}:7070",
                                 role="rollout", region="r01", node_class="preemptible", versions=(3, 4))
                     for i in range(n))

    async def go():
        nowhere = ["https://127.0.0.1:9"]
        leaf = await Node.create(k.cfg("leaf", "rollout", seeds=nowhere, parents=nowhere,
                                       gossip={"max_body_bytes": 1 << 20}))
        try:
            g = leaf.gossip.gossip
            hdr = {**AUTH, "X-P2PSync-Gossip-From": "https://127.0.0.1:9"}
            fits, over = dumps(Delta("relay-x", members("a", 2000))), dumps(Delta("relay-x", members("b", 6000)))
            assert 64 << 10 < len(fits) < 1 << 20 < len(over)
            async with aiohttp.ClientSession(headers=hdr, connector=tlsutil.node_tls("relay-x").connector()) as s:
                async with s.post(leaf.address + "/v1/gossip", data=fits) as r:
                    assert r.status == 204
                async with s.post(leaf.address + "/v1/gossip", data=over) as r:
                    assert r.status == 413
                async with s.post(leaf.address + "/v1/head", data=fits) as r:
                    assert r.status == 413
            assert sum(1 for m in g.members.entries if m.startswith("a")) == 2000
            assert not any(m.startswith("b") for m in g.members.entries)
        finally:
            await leaf.close()

    asyncio.run(go())


def test_progress_many_records_each_report_or_refuses_the_whole_malformed_batch(tmp_path):
    """One request carries every open response's progress: each report gets the answer the single
    call would give (recorded, gap, unknown work, lost lease), in order; a malformed report or too
    many reports refuse the whole request with nothing recorded."""
    k = Keys(tmp_path)

    async def go():
        from p2psync.control.bodies import MAX_REPORTS

        tr = await Node.create(k.cfg("trainer", "trainer"))
        try:
            co = tr.coordinator
            co.submit("w1", {"p": 1}, responses=2)
            co.submit("w2", {"p": 2}, responses=1)
            base = tr.address + "/v1/control"
            status, got = await _post(base + "/lease", {"node": "a", "max_items": 2, "wait": 1})
            lease = {g["work_id"]: g["lease_id"] for g in got["grants"]}
            assert status == 200 and set(lease) == {"w1", "w2"}

            def rep(wid, response=0, offset=0, tokens=(1, 2), **kw):
                return {"work_id": wid, "lease_id": lease.get(wid, 99), "response": response, "offset": offset,
                        "tokens": list(tokens), "logprobs": [-1.0] * len(tokens), "versions": [0] * len(tokens), **kw}

            good = rep("w1")
            for bad in ({**rep("w2"), "tokens": "x"}, {**rep("w2"), "logprobs": [-1.0]}, {**rep("w2"), "offset": None},
                        {**rep("w2"), "finish_reason": ""}, "not an object"):
                status, err = await _post(base + "/progress_many", {"node": "a", "reports": [good, bad]})
                assert status == 400 and err["error"].startswith("reports.1"), err
            status, err = await _post(base + "/progress_many", {"node": "a", "reports": [good] * (MAX_REPORTS + 1)})
            assert status == 400
            assert co.table.tokens("w1") == {} and co.table.tokens("w2") == {}  # nothing recorded

            status, got = await _post(base + "/progress_many", {"node": "a", "reports": [
                good, rep("w1", 1, 0, (7,), finish_reason="stop"), rep("w2", offset=4), rep("nope"), rep("w1", 5),
                {**rep("w2"), "lease_id": lease["w2"] + 1000}]})
            assert status == 200
            r = got["results"]
            assert r[0] == {"have": 2} and r[1] == {"have": 1}
            assert r[2]["status"] == 409 and r[2]["kind"] == "gap" and r[2]["have"] == 0
            assert r[3]["status"] == 404 and r[4]["status"] == 400
            assert r[5]["status"] == 409 and r[5]["kind"] == "expired"
            assert co.table.tokens("w1") == {0: (1, 2), 1: (7,)} and co.table.tokens("w2") == {0: ()}
        finally:
            await tr.close()

    asyncio.run(go())


def test_a_group_of_long_responses_is_delivered_and_progress_goes_in_one_request(tmp_path):
    """Control bodies have their own limit: a finished group of 8 responses of 1000 tokens (~240 KB
    of JSON, over the node's general 64 KiB body limit) is accepted; progress on two grants goes in
    one call, a report the coordinator has a gap for is re-sent from what it has, a lost lease
    fails only its own report; a body over the control limit is refused (413) with nothing recorded."""
    k = Keys(tmp_path)

    async def go():
        from p2psync.control.api import ProgressReport

        tr = await Node.create(k.cfg("trainer", "trainer", control={"max_body_bytes": 1 << 20}))
        a = await Node.create(k.cfg("a", "rollout", seeds=[tr.address], parents=[tr.address]))
        try:
            await _until(lambda: a.work.coordinator_url())
            co = tr.coordinator
            co.submit("w1", {"prompt_ids": [1]}, responses=8)
            co.submit("w2", {"prompt_ids": [2]}, responses=1)
            co.submit("w3", {"prompt_ids": [3]}, responses=1)
            grants = {g.work_id: g for g in await a.work.request(3, wait=5)}
            assert set(grants) == {"w1", "w2", "w3"}
            g1, g2, g3 = grants["w1"], grants["w2"], grants["w3"]
            n = 1000
            lp = [-0.123456789012] * n
            out = await a.work.progress_many([ProgressReport(g1, r, 0, list(range(n)), lp, [3] * n)
                                              for r in range(8)] + [ProgressReport(g2, 0, 0, [5], [-0.5], [3])])
            assert out == [None] * 9
            assert co.table.tokens("w1") == {r: tuple(range(n)) for r in range(8)}
            # the coordinator has 1000 tokens of response 0; the client believes it acknowledged 1200
            a.work._held[("w1", g1.lease_id)].acked[0] = 1200
            a.work._held[("w1", g1.lease_id)].tokens[0].extend(range(n, 1300))
            a.work._held[("w1", g1.lease_id)].logprobs[0].extend([-0.2] * 300)
            a.work._held[("w1", g1.lease_id)].versions[0].extend([4] * 300)
            co.table.release(time.time(), "a", "w3", g3.lease_id)  # w3's lease is no longer a's
            out = await a.work.progress_many([ProgressReport(g1, 0, 1300, [], [], []),
                                              ProgressReport(g3, 0, 0, [9], [-0.9], [4])])
            assert out[0] is None and isinstance(out[1], LeaseExpired)
            assert co.table.tokens("w1")[0] == tuple(range(1300))  # re-sent from 1000
            final = {r: ResponseResult(list(range(n)), lp, [3] * n, "length") for r in range(8)}
            final[0] = ResponseResult(list(range(1300)), [-0.123456789012] * n + [-0.2] * 300, [3] * n + [4] * 300,
                                      "length")
            assert await a.work.complete(g1, final) is True
            r = await anext(co.results())
            assert r.work_id == "w1" and r.responses[0] == final[0] and len(r.responses) == 8
            # over the control limit (1 MiB here): refused before it is read, nothing recorded
            big = {"node": "a", "work_id": "w2", "lease_id": g2.lease_id,
                   "responses": {"0": ResponseResult([1] * 60000, [-0.123456789012] * 60000, [3] * 60000,
                                                     "stop").to_json()}}
            status, err = await _post(tr.address + "/v1/control/complete", big)
            assert status == 413 and co.table.counts()["completed"] == 1
        finally:
            await a.close()
            await tr.close()

    asyncio.run(go())
