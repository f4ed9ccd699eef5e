"""A rollout node whose engine holds the weights drops its own copy and still follows, relays and refuses."""

from __future__ import annotations

import asyncio

import pytest

from p2psync import config
from p2psync.errors import ConfigError
from p2psync.node import Node
from tests.unit.p2psync.test_node_publish import _artifacts, _configs, _same, _states

pytestmark = pytest.mark.timeout(120)


def test_a_node_without_weights_follows_the_signed_chain_and_serves_a_child(tmp_path):
    priv, tr_cfg, common = _configs(tmp_path)
    states = _states()
    arts = _artifacts(priv, states)

    async def go():
        tr = await Node.create(tr_cfg)
        mid = await Node.create(config.load(overrides={**common, "id": "mid", "role": "rollout",
                                                       "data_dir": str(tmp_path / "mid"), "parents": [tr.address]}))
        kid = None
        try:
            await tr.publish(*arts[0])
            await asyncio.wait_for(mid.wait_version(0), 30)
            assert tr.release_weights() is False and _same(tr.state, states[0])  # the trainer keeps its copy
            assert mid.store.cached_bytes > 0  # the snapshot's chunks, kept for children and the engine
            assert mid.release_weights() is True
            assert mid.state is None and mid.status()["holds_weights"] is False
            assert mid.store.cached_bytes == 0  # the engine took them; they stay on disk for late joiners
            assert not (tmp_path / "mid" / "state.p2sa").exists()
            await tr.publish(*arts[1])
            await asyncio.wait_for(mid.wait_version(1), 30)
            assert mid.state is None and mid.fingerprint == states[1].fingerprint
            # A node below it still gets verified artifacts that decode to the trainer's bits.
            kid = await Node.create(config.load(overrides={**common, "id": "kid", "role": "rollout",
                                                           "data_dir": str(tmp_path / "kid"),
                                                           "parents": [mid.address]}))
            for m, c in arts[2:]:
                await tr.publish(m, c)
            await asyncio.wait_for(kid.wait_version(3), 30)
            assert _same(kid.state, states[3]) and mid.fingerprint == kid.fingerprint == tr.fingerprint
            assert mid.state is None
        finally:
            if kid is not None:
                await kid.close()
            await mid.close()
            await tr.close()

    asyncio.run(go())


def test_a_node_that_must_hold_weights_cannot_be_told_not_to(tmp_path):
    _, _, common = _configs(tmp_path)
    with pytest.raises(ConfigError, match="store.hold_weights"):
        config.load(overrides={**common, "id": "t", "role": "trainer", "data_dir": str(tmp_path / "t"),
                               "store": {"hold_weights": False}})
