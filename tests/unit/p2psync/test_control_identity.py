"""Results are attributed to the node whose TLS certificate delivered them (the trainer's coordinator
on a real socket, clients presenting real node certificates of the tests' CA)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import tlsutil

from p2psync import config, keys
from p2psync.control.api import ResponseResult
from p2psync.node import Node

TOKEN = "unit-test-token-identity"


async def _post(url: str, body: dict, as_node: str) -> tuple[int, dict]:
    conn = tlsutil.node_tls(as_node).connector()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}, connector=conn) as s:
        async with s.post(url, data=json.dumps(body)) as r:
            return r.status, await r.json(content_type=None)


def test_a_result_counts_only_from_the_node_that_holds_the_lease_and_is_recorded_as_its(tmp_path):
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    cfg = config.load(overrides={"id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"),
                                 "cluster_token": TOKEN, "trainer_public_key": str(tmp_path / "keys/trainer.pub"),
                                 "trainer_private_key": str(tmp_path / "keys/trainer.key")})

    async def go():
        tr = await Node.create(cfg)
        try:
            base = tr.address + "/v1/control"
            assert base.startswith("https://")
            tr.coordinator.submit("w1", {"prompt_ids": [1]}, responses=1)
            status, got = await _post(base + "/lease", {"node": "a", "max_items": 1, "wait": 1}, as_node="a")
            assert status == 200, got
            [grant] = got["grants"]
            result = {"node": "a", "work_id": "w1", "lease_id": grant["lease_id"],
                      "responses": {"0": ResponseResult([7, 8], [-0.1, -0.2], [0, 0], "stop").to_json()}}
            # b, with its own valid certificate, submits a's result in a's name: refused.
            status, err = await _post(base + "/complete", result, as_node="b")
            assert status == 403 and "certificate names 'b'" in err["error"]
            # In its own name, for a lease a holds: refused (the lease is not b's).
            status, err = await _post(base + "/complete", {**result, "node": "b"}, as_node="b")
            assert status == 409
            # A client certificate (an operator, the CLI) cannot act as a node at all.
            conn = tlsutil.client_tls().connector()
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}, connector=conn) as s:
                async with s.post(base + "/complete", data=json.dumps(result)) as r:
                    assert r.status == 403 and "client certificate" in (await r.json())["error"]
            assert tr.coordinator.pending() == 1  # nothing was recorded
            status, ok = await _post(base + "/complete", result, as_node="a")
            assert status == 200 and ok["accepted"] is True
            r = await anext(tr.coordinator.results())
            assert (r.work_id, r.node) == ("w1", "a") and r.responses[0].tokens == [7, 8]
            assert tr.coordinator.pending() == 0
        finally:
            await tr.close()

    asyncio.run(go())


def test_plain_http_needs_saying_so_and_urls_must_match_the_choice(tmp_path):
    from p2psync.errors import ConfigError

    common = {"id": "r", "role": "rollout", "data_dir": str(tmp_path), "cluster_token": TOKEN,
              "trainer_public_key": "x"}
    with pytest.raises(ConfigError, match=r"parents: 'http://a:1' must be an https:// URL"):
        config.load(overrides={**common, "parents": ["http://a:1"]})
    with pytest.raises(ConfigError, match=r"gossip.seeds: 'https://a:1' must be an http:// URL"):
        config.load(overrides={**common, "parents": ["http://a:1"], "gossip": {"seeds": ["https://a:1"]},
                               "tls": {"enabled": False}})
    assert config.load(overrides={**common, "parents": ["https://a:1"]}).tls.enabled is True
