"""A version with requests in flight stays loaded and named until its last request ends, on every path:
the window rule, the API server's request wrap and names, the worker's memory, the offline slots
(no engine: vLLM's RPCs are answered by an in-process stand-in that records them)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from p2psync import adapter
from p2psync.errors import MissingVersion
from rollout.engines.vllm import served_adapters
from rollout.engines.vllm.pins import Pins, kept
from rollout.engines.vllm.worker.adapter_source import AdapterSource, _Held


def test_the_window_counts_the_newest_versions_and_pinned_ones_stay_beside_it():
    assert kept([1, 2, 3, 4], 2) == [3, 4]
    assert kept([1, 2, 3, 4], 2, pinned={1}) == [1, 3, 4]
    assert kept([1, 2, 3, 4], 2, pinned={4}) == [3, 4]  # a pinned version in the window takes its place
    assert kept([3], 2, pinned={1}) == [3]  # a pin on a version not loaded keeps nothing
    pins = Pins()
    pins.start("p", 1)
    pins.start("p", 1)
    pins.start("q", 1)
    assert pins.pinned("p") == {1} and pins.count("p", 1) == 2
    assert pins.finish("p", 1) is False
    assert pins.finish("p", 1) is True  # the last one
    assert pins.pinned("p") == set() and pins.pinned("q") == {1}
    with pytest.raises(ValueError, match="no request in flight"):
        pins.finish("p", 1)
    assert pins.pinned("q") == {1}


def _models(versions) -> SimpleNamespace:
    reqs = {f"policy@v{v}": SimpleNamespace(lora_name=f"policy@v{v}", lora_path=f"p2psync:policy@{v}", lora_int_id=v)
            for v in versions}
    return SimpleNamespace(lora_requests=reqs)


class Engine:
    """Stands in for vLLM's ``AsyncLLM``: ``generate`` yields ``n`` outputs, ``collective_rpc`` is recorded."""

    def __init__(self) -> None:
        self.rpcs: list[tuple] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, *args[:2]))
        return [[]]

    async def generate(self, prompt, params, request_id, *, lora_request=None):
        for i in range(3):
            await asyncio.sleep(0)
            yield i


def test_a_request_in_flight_keeps_its_version_named_and_the_workers_told_once_it_ends(monkeypatch):
    monkeypatch.setenv("P2PSYNC_LORA_WINDOW", "2")
    monkeypatch.setattr(served_adapters, "PINS", Pins())
    models = _models([1])
    monkeypatch.setattr(served_adapters, "_served", {"policy": models})
    eng = Engine()
    generate = served_adapters.pinning(Engine.generate)

    async def run() -> None:
        served_adapters._settle(models, "policy")
        v1 = models.lora_requests["policy"]
        stream = generate(eng, [1], None, "r1", lora_request=v1)
        assert await anext(stream) == 0  # running on version 1
        assert served_adapters.PINS.pinned("policy") == {1}
        for v in (2, 3):
            models.lora_requests.update(_models([v]).lora_requests)
            keep, _ = served_adapters._settle(models, "policy")
            assert keep == list(range(1, v + 1))  # version 1 stays once the window has moved past it
        assert sorted(models.lora_requests) == ["policy", "policy@v1", "policy@v2", "policy@v3"]
        assert models.lora_requests["policy"].lora_int_id == 3
        assert [x async for x in stream] == [1, 2]  # finishes whole
        await asyncio.sleep(0)  # the keep message's task
        assert sorted(models.lora_requests) == ["policy", "policy@v2", "policy@v3"]
        assert eng.rpcs == [("p2psync_keep_adapters", "policy", [2, 3])]
        assert served_adapters.PINS.pinned("policy") == set()
        # A request that read a name the window dropped before it started: vLLM's not-found (404).
        from vllm.exceptions import VLLMNotFoundError

        with pytest.raises(VLLMNotFoundError, match="policy@v1"):
            await anext(generate(eng, [1], None, "r2", lora_request=v1))
        # A request abandoned mid-way (client gone) lets its version go too.
        models.lora_requests.update(_models([4]).lora_requests)
        stream = generate(eng, [1], None, "r3", lora_request=models.lora_requests["policy@v2"])
        await anext(stream)
        served_adapters._settle(models, "policy")
        assert "policy@v2" in models.lora_requests
        await stream.aclose()
        await asyncio.sleep(0)
        assert sorted(models.lora_requests) == ["policy", "policy@v3", "policy@v4"]
        assert eng.rpcs[-1] == ("p2psync_keep_adapters", "policy", [3, 4])

    pytest.importorskip("vllm")
    asyncio.run(run())


def test_the_worker_keeps_what_the_api_server_says_and_never_a_late_message_undoes_a_newer_one(monkeypatch):
    monkeypatch.setenv("P2PSYNC_LORA_WINDOW", "2")
    src = AdapterSource()
    h = src._held["policy"] = _Held(None, 5, None, {v: f"lora-{v}" for v in (1, 3, 4, 5)})  # type: ignore[arg-type]
    assert src.keep("policy", [1, 3, 4], 7) == [1, 3, 4, 5]  # 5 is newer than the message knew: kept
    assert src.keep("policy", [4, 5], 9) == [4, 5]
    assert src.keep("policy", [1, 3, 4, 5], 8) == [4, 5]  # older than the last applied: ignored
    assert h.models == {4: "lora-4", 5: "lora-5"}


class LLM:
    """Stands in for ``vllm.LLM`` behind ``collective_rpc``: the registered adapter ids of one worker."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def collective_rpc(self, fn, args=()):
        if fn.__name__ == "rpc_lora_limits":
            return [{"max_lora_rank": 8, "modules": ["q_proj"], "max_cpu_loras": 4, "registered": []}]
        if fn.__name__ == "rpc_lora_add":
            self.ids.add(args[0])
            return [{"ok": True}]
        assert fn.__name__ == "rpc_lora_remove"
        self.ids -= set(args[0])
        return [sorted(self.ids)]


def test_a_batch_pins_its_version_in_the_offline_slots_until_it_lets_go():
    from rollout.engines.vllm.lora import AdapterSlots

    config = adapter.AdapterConfig("policy", 2, 4.0, ("q_proj",), "f" * 32)
    p = "base_model.model.model.layers.0.self_attn.q_proj"

    def state(seed: int):
        g = torch.Generator().manual_seed(seed)
        return adapter.adapter_state({f"{p}.lora_A.weight": torch.randn(2, 8, generator=g).bfloat16(),
                                      f"{p}.lora_B.weight": torch.randn(8, 2, generator=g).bfloat16()}, config)

    llm = LLM()
    slots = AdapterSlots(llm, base_fingerprint="f" * 32, window=2)
    slots.load("policy", state(1), 1)
    release = slots.pin("policy", 1)
    held = slots.pin("policy", 1)  # a second batch on the same version
    id1 = slots.request("policy", 1).lora_int_id
    for v in (2, 3):
        slots.load("policy", state(v), v)
    assert slots.loaded("policy") == [1, 2, 3] and id1 in llm.ids
    release()
    release()  # idempotent: the other batch still holds version 1
    assert slots.loaded("policy") == [1, 2, 3]
    held()
    assert slots.loaded("policy") == [2, 3] and id1 not in llm.ids and len(llm.ids) == 2
    with pytest.raises(MissingVersion):
        slots.pin("policy", 1)
    with pytest.raises(MissingVersion):
        slots.request("policy", 1)
