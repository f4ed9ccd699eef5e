"""The vLLM adapter. Pure parts (CPU mirror, which tensors a delta touched, names, RPC batching, the
worker-extension glue) run everywhere; the end-to-end tests need vLLM and a GPU and skip otherwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import trained_versions

from p2psync.errors import FingerprintMismatch, WrongBase
from rollout.engine import EngineConfig, SeqRequest
from rollout.vllm import (
    EXTENSION,
    CheckpointMirror,
    NameMap,
    P2PSyncWorkerExtension,
    batches,
    changed_tensors,
    sampling_params,
)


@pytest.fixture(scope="module")
def versions():
    return trained_versions(steps=3)


def _words_differ(a, b) -> list[str]:
    return [n for n in a if not (a.words(n) == b.words(n)).all()]


def test_mirror_applies_real_deltas_and_names_exactly_the_touched_tensors(versions):
    mirror = CheckpointMirror.copy_of(versions.states[0], 0)
    assert mirror.state.tensor("model.norm.weight").data_ptr() != \
        versions.states[0].tensor("model.norm.weight").data_ptr()  # a copy, not a view
    for m, chunks in versions.deltas:
        before = mirror.state.clone()
        fp, names = mirror.apply(m, chunks)
        assert fp == m.target_fingerprint == mirror.state.audit()
        assert mirror.version == m.target_version
        assert names == _words_differ(before, mirror.state)  # nothing more, nothing less, table order
        assert _words_differ(mirror.state, versions.states[m.target_version]) == []
    snap, _ = versions.snapshot
    assert changed_tensors(snap) == [s.name for s in versions.states[0].specs]


def test_mirror_refuses_wrong_base_and_bad_copies(versions):
    mirror = CheckpointMirror.copy_of(versions.states[0], 0)
    before = mirror.state.clone()
    with pytest.raises(WrongBase):
        mirror.apply(*versions.deltas[2])
    assert mirror.version == 0 and _words_differ(before, mirror.state) == []
    with pytest.raises(FingerprintMismatch):
        CheckpointMirror.copy_of(versions.states[0], 0, expected_fingerprint=versions.states[1].fingerprint)


def test_names_and_rpc_batches():
    nm = NameMap({"transformer.wte.weight": "model.embed_tokens.weight"}, frozenset({"lm_head.weight"}))
    assert nm("transformer.wte.weight") == "model.embed_tokens.weight"
    assert nm("lm_head.weight") is None and nm("model.norm.weight") == "model.norm.weight"
    ts = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    parts = list(batches(ts, max_bytes=60))
    assert [[n for n, _ in p] for p in parts] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [n for p in parts for n, _ in p] == [n for n, _ in ts]
    assert all(sum(t.numel() * 2 for _, t in p) <= 60 or len(p) == 1 for p in parts)


def test_mirror_weights_use_checkpoint_names(versions):
    mirror = CheckpointMirror.copy_of(versions.states[0], 0)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    got = mirror.weights(names, NameMap(skip=frozenset({"model.norm.weight"})))
    assert [n for n, _ in got] == ["model.embed_tokens.weight"]
    assert got[0][1].data_ptr() == mirror.state.tensor("model.embed_tokens.weight").data_ptr()


def test_worker_extension_hands_tensors_to_the_models_loader():
    """The glue only: what vLLM's worker would call, with a torch module standing in for the model."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
            self.calls = []

        def load_weights(self, weights):
            self.calls.append([(n, t.clone()) for n, t in weights])
            return {n for n, _ in weights}

    class Worker(P2PSyncWorkerExtension):
        def __init__(self):
            self.model_runner = type("R", (), {"model": Model()})()
            self.device = torch.device("cpu")

    w = Worker()
    t = torch.tensor([1.5, -0.0, float("nan")], dtype=torch.bfloat16)
    assert w.p2psync_load_weights([("model.norm.weight", t)]) == 1
    (call,) = w.model_runner.model.calls
    assert call[0][0] == "model.norm.weight" and torch.equal(call[0][1].view(torch.int16), t.view(torch.int16))
    assert w.p2psync_model_dtype() == "torch.bfloat16"
    assert EXTENSION == f"{P2PSyncWorkerExtension.__module__}.{P2PSyncWorkerExtension.__qualname__}"


def test_sampling_params_follow_the_request():
    r = SeqRequest([1, 2], 10, temperature=0.0, top_p=0.9, stop_token_ids=[7], seed=3, prefix=[4, 5, 6])
    p = sampling_params(r)
    assert p["max_tokens"] == 7 and p["temperature"] == 0.0 and p["top_p"] == 0.9 and p["seed"] == 3
    assert p["stop_token_ids"] == [7] and p["ignore_eos"] and p["logprobs"] == 0


# --- with vLLM (skipped here: vLLM cannot be installed on the development machine) -------------
@pytest.mark.gpu
def test_vllm_engine_tracks_versions_bit_exactly_and_generates(versions):
    pytest.importorskip("vllm", reason="vLLM is not installed (it cannot be on the CPU development machine)")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    from rollout.hf import HFEngine
    from rollout.vllm import VLLMEngine

    cfg = EngineConfig(engine="vllm", preset="tiny", vllm={"gpu_memory_utilization": 0.2, "enforce_eager": True})
    eng = VLLMEngine.build(cfg)
    ref = HFEngine.build(EngineConfig(preset="tiny"))
    try:
        eng.load(versions.states[0], 0)
        ref.load(versions.states[0], 0)
        for m, chunks in versions.deltas:
            assert eng.apply(m, chunks) == m.target_fingerprint
            ref.apply(m, chunks)
        reqs = [SeqRequest([5, 9, 17, 33], 12, temperature=1.0, seed=11),
                SeqRequest([7, 3], 10, temperature=0.0, seed=12)]
        a = eng.generate(reqs)
        b = eng.generate(reqs)
        assert [s.tokens for s in a] == [s.tokens for s in b]
        for s in a:
            assert s.versions == [3] * len(s.tokens)
            want = ref.logprobs_of(s.request.prompt_ids, s.tokens, s.request.temperature)
            assert max(abs(x - y) for x, y in zip(want, s.logprobs)) < 0.1  # GPU vs CPU kernels, same bits
        greedy = ref.generate([dataclasses.replace(reqs[1])])[0]
        assert a[1].tokens[:4] == greedy.tokens[:4]
    finally:
        eng.close()
