"""A push that stalls for one artifact while the stream goes on pushing others (found by the chaos soak,
tools/chaos.py: a corrupted segment cut the trainer's push of delta 75->76 to a relay, its new stream
pushed the next versions, and the relay waited for 75->76's chunks for ever)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from p2psync.node.follower import Follower
from p2psync.transport.push import Pushes

pytestmark = pytest.mark.timeout(30)


def _follower(stall: float) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(stall_timeout=stall)), _pushes=Pushes(),
                           log=logging.getLogger("test.follower"))


def _art(n: int) -> SimpleNamespace:
    return SimpleNamespace(manifest=SimpleNamespace(chunks=[None] * n, artifact_id="delta-75-76"), held=set())


async def _nothing() -> None:
    return None


def test_chunks_of_other_artifacts_do_not_keep_a_stalled_push_waiting(caplog):
    fol, art = _follower(stall=0.3), _art(4)
    art.held.add(0)  # one chunk came before the connection broke

    async def go() -> float:
        async def others() -> None:  # the new stream pushes newer versions, never this one again
            while True:
                await asyncio.sleep(0.02)
                fol._pushes.arrived()

        noise = asyncio.create_task(others())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await asyncio.wait_for(Follower._take_pushed(fol, art, _nothing), 5)
        finally:
            noise.cancel()
        return loop.time() - t0

    with caplog.at_level(logging.WARNING, logger="test.follower"):
        took = asyncio.run(go())
    assert 0.25 < took < 2.0
    assert "push of delta-75-76 stalled at 1 of 4 chunks; pulling the rest" in caplog.text


def test_a_push_that_keeps_delivering_this_artifact_is_waited_for():
    fol, art = _follower(stall=0.3), _art(6)

    async def go() -> None:
        async def feed() -> None:  # slower in all than the stall timeout, but never 0.3 s without a chunk
            for i in range(6):
                await asyncio.sleep(0.15)
                art.held.add(i)
                fol._pushes.arrived()

        feeder = asyncio.create_task(feed())
        await asyncio.wait_for(Follower._take_pushed(fol, art, _nothing), 5)
        await feeder

    asyncio.run(go())
    assert len(art.held) == 6
