"""``following``: the adapter follow loop as a task a caller waits on, and leaves cleanly.

Driven with a node and slots of the shapes ``follow`` uses (no vLLM): what a caller sees is that
``until`` returns once the version is loaded, and that a version the slots refuse ends the loop
with that typed error, raised from ``until`` (not a hang) and from leaving the block."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2psync import adapter
from p2psync.errors import AdapterMismatch
from rollout.engines.vllm.lora import following

CONFIG = adapter.AdapterConfig("policy", 2, 4.0, ("q_proj",), "f" * 32)


class _Node:
    """What ``follow`` reads of a node: the state and version applied, and a feed of manifests."""

    def __init__(self) -> None:
        self.state = None
        self.version = None
        self._feed: asyncio.Queue = asyncio.Queue()

    def apply(self, version: int) -> None:
        g = torch.Generator().manual_seed(version)
        t = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(2, 8, generator=g),
             "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(8, 2, generator=g)}
        self.state, self.version = adapter.adapter_state(t, CONFIG), version
        self._feed.put_nowait(type("M", (), {"model_id": adapter.stream_id("policy"), "target_version": version}))

    async def subscribe(self):
        while True:
            yield await self._feed.get()


class _Slots:
    """Loads every version up to ``refuse_from``; refuses from there on (as a misfit adapter is)."""

    def __init__(self, refuse_from: int = 1 << 30) -> None:
        self.versions: list[int] = []
        self.refuse_from = refuse_from

    def loaded(self, name: str) -> list[int]:
        return list(self.versions)

    def load(self, name: str, state, version: int) -> int:
        if version >= self.refuse_from:
            raise AdapterMismatch(name, f"version {version} does not fit")
        adapter.split_state(state)
        self.versions.append(version)
        return version


def test_until_returns_once_each_version_is_loaded():
    async def go():
        node, slots = _Node(), _Slots()
        async with following(node, slots) as f:
            for v in range(3):
                node.apply(v)
                async with asyncio.timeout(10):
                    await f.until("policy", v)
                assert slots.loaded("policy")[-1] == v
        assert f.task.done()

    asyncio.run(go())


def test_a_refused_version_is_raised_by_until_and_by_leaving():
    async def go():
        node, slots = _Node(), _Slots(refuse_from=1)
        with pytest.raises(AdapterMismatch):
            async with following(node, slots) as f:
                node.apply(0)
                await f.until("policy", 0)
                node.apply(1)
                async with asyncio.timeout(10):
                    await f.until("policy", 1)
        assert slots.loaded("policy") == [0]

    asyncio.run(go())


def test_a_loop_that_died_unawaited_is_raised_on_leaving():
    async def go():
        node, slots = _Node(), _Slots(refuse_from=0)
        with pytest.raises(AdapterMismatch):
            async with following(node, slots):
                node.apply(0)
                await asyncio.sleep(0.5)  # the loop dies on version 0; nobody calls until

    asyncio.run(go())
