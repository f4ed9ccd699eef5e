"""verl 0.9.1's checkpoint-engine registry resolving ``p2psync``, and a verl-shaped weight sync on CPU:
the trainer side publishes what ``send_weights`` streams, the rollout side has a real vLLM engine
(``p2psync`` backend) reach it, bit-exact, through verl's own ``CheckpointEngineWorker.update_weights``
and vLLM ``ServerAdapter.update_weights``.

verl's Ray actors, NCCL and its vLLM HTTP server do not run here (no GPU, no Ray cluster): the
manager's steps are called as ``CheckpointEngineManager.update_weights`` calls them, and the
adapter's Ray handle to the vLLM server is a stand-in that forwards its ``collective_rpc`` /
``clear_kv_cache`` / ``set_global_steps`` to an offline ``vllm.LLM``. Needs the ``verl`` extra's
venv (``bash tools/verl_venv.sh``), where ``bash tools/test.sh`` runs the tests marked ``verl``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch


import tlsutil  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True, scope="module")
def _verl_installed() -> None:
    """verl and vLLM import here (the verl venv), or the run fails under CI=true (skips elsewhere)."""
    import needs

    needs.module("vllm")
    needs.module("verl.checkpoint_engine", "bash tools/verl_venv.sh builds .venv-verl, where tools/test.sh runs it")

TOKEN = "verl-test-token"
STEPS = 3


def test_verl_registry_resolves_p2psync_with_verl_base_classes():
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("trainer.verl")  # what verl does with checkpoint_engine.custom_backend_module
    cls = CheckpointEngineRegistry.get("p2psync")
    actor = CheckpointEngineRegistry.new("p2psync", is_master=False, bucket_size=1 << 20)
    rollout = CheckpointEngineRegistry.new("p2psync", bucket_size=1 << 20, rollout={"token": TOKEN})
    assert issubclass(cls, CheckpointEngine)
    assert isinstance(actor, cls) and isinstance(actor, CheckpointEngine)
    assert type(rollout).__module__ == "rollout.verl" and isinstance(rollout, CheckpointEngine)
    assert actor.wire_format == rollout.wire_format == "delta_flush"
    meta = [{"role": "trainer", "url": "https://h:1", "version": 4, "public_key": "K"}, {}, {"role": "rollout"},
            {"role": "rollout"}]
    a, r = cls.build_topology(2, 2, meta)
    assert a == {} and r == {"trainer": [meta[0], meta[0]]}


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return asyncio.to_thread(self.fn, *args, **kwargs)  # awaitable, as a Ray ObjectRef is


class ServerHandle:
    """Stands in for the Ray handle of verl's ``vLLMHttpServer``, over an offline ``vllm.LLM``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[str] = []
        self.steps: list[int] = []
        self.collective_rpc = _Remote(self._rpc)
        self.clear_kv_cache = _Remote(lambda: self._log("clear_kv_cache", lambda llm: llm.reset_prefix_cache()))
        self.set_global_steps = _Remote(self.steps.append)

    def _log(self, what: str, call: Any) -> Any:
        self.calls.append(what)
        with self.engine.calling() as llm:
            return call(llm)

    def _rpc(self, method: str, timeout: Any = None, args: tuple = (), kwargs: dict | None = None) -> None:
        # vLLMHttpServer.collective_rpc awaits the engine's and returns nothing
        self._log(method, lambda llm: llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs))


def _adapter(handle: ServerHandle) -> Any:
    """verl's vLLM ``ServerAdapter`` as the leader rank of replica 0 holds it (built without Ray)."""
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    adapter = object.__new__(ServerAdapter)
    adapter.server_handle = handle
    adapter._has_server, adapter.replica_rank, adapter.rollout_rank = True, 0, 0
    adapter.use_shm, adapter._delta_weight_transfer_engine_initialized = False, False
    return adapter


def _worker(engine: Any, adapter: Any) -> Any:
    """verl's ``CheckpointEngineWorker`` holding ``engine`` and ``adapter`` (built without Ray)."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    worker = object.__new__(CheckpointEngineWorker)
    worker.checkpoint_engine, worker.server_adapter = engine, adapter
    return worker


def test_verl_sync_leaves_vllm_holding_the_trainers_bits(tmp_path):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from vllm_helpers import build

    from p2psync import keys
    from p2psync.presets import build_model
    from p2psync.state import ModelState

    keys.write_pair(keys.generate(), tmp_path / "keys")
    node = {"id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "trainer"), "cluster_token": TOKEN,
            "trainer_private_key": str(tmp_path / "keys" / "trainer.key"),
            "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"), "store": {"snapshot_interval": 0}}
    # verl hands both sides the same engine_kwargs table
    kwargs = {"node": node, "publisher": {"chunk_size": 64 << 10},
              "rollout": {"token": TOKEN, "node_id": "engine", "tls_dir": str(tlsutil.node_tls("engine").directory),
                          "wait_s": 120}}

    # vLLM starts on other weights than the trainer's (verl may launch it on dummy or stale weights):
    # the first sync must replace every tensor
    build_model("mini", seed=1).to(torch.bfloat16).save_pretrained(tmp_path / "launched")
    model = build_model("mini", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vllm_engine = build(str(tmp_path / "launched"))
    import_external_libs("trainer.verl")
    cls = CheckpointEngineRegistry.get("p2psync")
    actor = CheckpointEngineRegistry.new("p2psync", is_master=True, bucket_size=1 << 20, **kwargs)
    rollout = CheckpointEngineRegistry.new("p2psync", bucket_size=1 << 20, **kwargs)
    handle = ServerHandle(vllm_engine)
    worker = _worker(rollout, _adapter(handle))

    async def sync(global_steps: int) -> dict:
        # CheckpointEngineManager.update_weights: prepare, build_topology, init_process_group, then
        # the actor's send and the rollout's update at once, then finalize
        meta = [actor.prepare(), rollout.prepare()]
        a_kw, r_kw = cls.build_topology(1, 1, meta)
        actor.init_process_group(**{k: v[0] for k, v in a_kw.items()})
        rollout.init_process_group(**{k: v[0] for k, v in r_kw.items()})
        # the FSDP engine's get_per_tensor_param: (HF name, full tensor), lm_head tied to the embedding
        stream = ((n, t.detach()) for n, t in model.state_dict().items())
        metrics, _ = await asyncio.gather(actor.send_weights(stream, global_steps=global_steps),
                                          worker.update_weights(global_steps=global_steps))
        actor.finalize()
        rollout.finalize()
        return metrics

    try:
        published = []
        for step in range(STEPS + 1):
            if step:
                model(torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).loss.backward()
                opt.step()
                opt.zero_grad()
            metrics = asyncio.run(sync(step))
            expected = ModelState({n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()
                                   if n != "lm_head.weight"})
            assert metrics["checkpoint_engine/version"] == step
            assert actor.publisher.fingerprints[step] == expected.fingerprint
            got = vllm_engine.read(list(expected))
            bad = [n for n in expected if got[n] != expected.words(n).tobytes()]
            assert not bad, f"step {step}: vLLM tensors differing from the trainer's bf16: {bad}"
            assert vllm_engine.status()["version"] == step and rollout.version == step
            published.append(actor.publisher.records[-1])
        assert [r.kind for r in published] == ["snapshot"] + ["delta"] * STEPS
        assert all(0 < r.changed_fraction < 1 for r in published[1:])
        # verl's adapter was fed an empty delta_flush stream: it only advanced its step tag
        assert handle.steps == list(range(STEPS + 1))
        assert handle.calls.count("init_weight_transfer_engine") == 1
        assert handle.calls[-4:] == ["start_weight_update", "update_weights", "finish_weight_update",
                                     "clear_kv_cache"]
        assert "update_verl_delta_weights" not in handle.calls
    finally:
        vllm_engine.close()
        actor.close()
