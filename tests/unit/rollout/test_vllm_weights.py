"""The in-place sparse apply of the vLLM backend, on a transformers model's parameters (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p2psync import keys
from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.errors import CodecError, FingerprintMismatch, TensorTableMismatch, WrongBase
from p2psync.state import ModelState
from rollout.engines.vllm.placement.rules import LayoutError, place
from rollout.engines.vllm.apply.weights import LiveWeights, UnwritableParameter
from rollout_helpers import live_snapshot

SPECIAL = [0x7FC1, 0xFFA5, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7F81]


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _delta(old: ModelState, seed: int = 1, special: bool = True):
    new = old.clone()
    g = np.random.default_rng(seed)
    for n in new:
        w = new.words(n)
        idx = g.choice(w.shape[0], size=max(1, w.shape[0] // 50), replace=False)
        w[idx] ^= g.integers(1, 8, size=idx.shape[0]).astype(w.dtype)
    if special:
        name = next(n for n in new if n.endswith("input_layernorm.weight"))
        new.words(name)[:len(SPECIAL)] = SPECIAL
    new.invalidate()
    priv = keys.generate()
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=4096))
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=64 << 10, private_key=priv)
    return new, m, enc.chunks


def _words(model: torch.nn.Module, state: ModelState) -> list[str]:
    params = dict(model.named_parameters())
    return [n for n in state if not np.array_equal(params[n].detach().reshape(-1).view(torch.int16).numpy(),
                                                   state.words(n).view(np.int16))]


@pytest.mark.parametrize("in_place", [True, False], ids=["host-words", "segment-copies"])
def test_delta_lands_bit_exact_with_every_bit_pattern(in_place):
    model = _model()
    old = live_snapshot(model)
    live = LiveWeights(model, old.specs)
    live.host_memory = in_place  # False: the path a GPU-resident model takes
    assert live.fingerprint == old.fingerprint
    new, m, chunks = _delta(old)
    assert live.apply_delta(m, chunks) == new.fingerprint
    assert _words(model, new) == []
    assert live.audit() == new.fingerprint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_resident_weights_take_a_delta_bit_exact_and_refuse_bad_ones():
    """The path every CUDA engine takes: decode on the host, scatter into device memory, read back."""
    model = _model()
    old = live_snapshot(model)
    model.to("cuda")
    live = LiveWeights(model, old.specs)
    assert not live.host_memory and live.fingerprint == old.fingerprint
    new, m, chunks = _delta(old)
    with pytest.raises(CodecError):  # truncated chunk: nothing written
        live.apply_delta(m, [chunks[0][:-7], *chunks[1:]])
    changes, _ = live.decode(m, chunks)
    with pytest.raises(FingerprintMismatch):  # a read-back that does not hash as signed: undone
        live.commit(changes, "0" * 32)
    assert live.audit() == old.fingerprint
    assert live.apply_delta(m, chunks) == new.fingerprint
    assert live.audit() == new.fingerprint
    assert _words(model.cpu(), new) == []


def test_bad_artifacts_change_nothing():
    model = _model()
    old = live_snapshot(model)
    live = LiveWeights(model, old.specs)
    new, m, chunks = _delta(old)
    with pytest.raises(CodecError):  # truncated chunk
        live.apply_delta(m, [chunks[0][:-7], *chunks[1:]])
    with pytest.raises(CodecError):  # a chunk missing
        live.apply_delta(m, chunks[:-1])
    assert _words(model, old) == [] and live.audit() == old.fingerprint
    live.apply_delta(m, chunks)
    with pytest.raises(WrongBase):  # the same delta again: its base is gone
        live.apply_delta(m, chunks)
    assert _words(model, new) == []


@pytest.mark.parametrize("in_place", [True, False], ids=["host-words", "segment-copies"])
def test_a_write_that_does_not_read_back_as_planned_is_undone(in_place):
    model = _model()
    old = live_snapshot(model)
    live = LiveWeights(model, old.specs)
    live.host_memory = in_place
    new, m, chunks = _delta(old)
    changes, _ = live.decode(m, chunks)
    with pytest.raises(FingerprintMismatch):
        live.commit(changes, "0" * 32)  # the read-back words cannot hash to this
    assert _words(model, old) == [] and live.audit() == old.fingerprint


def test_unknown_names_and_unwritable_parameters_are_refused():
    model = _model()
    old = live_snapshot(model)
    with pytest.raises(TensorTableMismatch):
        LiveWeights(model, [*old.specs[:-1], type(old.specs[0])("nowhere.weight", "BF16", (4,))])
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(UnwritableParameter, match="size 0"):
        LiveWeights(model, [s for s in old.specs if s.name != "model.layers.0.mlp.down_proj.weight"] +
                    [type(old.specs[0])("model.layers.0.mlp.down_proj.weight", "BF16", (0,))])
    model = _model()
    handle = torch.zeros(1)
    model.model.layers[0].mlp.up_proj.cpu_linear = lambda x, w, b: x @ handle  # closes over a packed copy
    with pytest.raises(UnwritableParameter, match="packed"):
        LiveWeights(model, old.specs)


WIDENED = ("model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate_proj.weight")
"""Parameters turned ``float32`` (as vLLM keeps some MoE routers) under the ``bfloat16`` table's tensors."""


def _widen(model: torch.nn.Module) -> None:
    for n in WIDENED:
        module = model.get_submodule(n.rsplit(".", 1)[0])
        module.weight = torch.nn.Parameter(module.weight.detach().float(), requires_grad=False)


def _live32(model: torch.nn.Module, name: str) -> np.ndarray:
    return dict(model.named_parameters())[name].detach().reshape(-1).view(torch.int32).numpy().view(np.uint32)


@pytest.mark.parametrize("in_place", [True, False], ids=["host-words", "segment-copies"])
def test_a_float32_parameter_of_a_bfloat16_tensor_takes_the_widened_words(in_place):
    """The live words are the checkpoint's widened as ``Tensor.copy_`` widens them (NaN payloads
    included); the fingerprint and the audit are the checkpoint's; a refused delta writes nothing."""
    model = _model()
    old = live_snapshot(model)
    _widen(model)
    live = LiveWeights(model, old.specs)
    live.host_memory = in_place
    assert {pl.name: pl.cast for pl in live.places if pl is not None and pl.cast} == dict.fromkeys(WIDENED, "float32")
    assert live.fingerprint == old.fingerprint == live.audit()
    new, m, chunks = _delta(old)
    changes, _ = live.decode(m, chunks)
    with pytest.raises(FingerprintMismatch):  # a refused delta: every float32 word as it was
        live.commit(changes, "0" * 32)
    assert all(np.array_equal(_live32(model, n), old.words(n).astype(np.uint32) << 16) for n in WIDENED)
    assert live.audit() == old.fingerprint
    assert live.apply_delta(m, chunks) == new.fingerprint
    for n in WIDENED:
        widened = torch.from_numpy(new.words(n).view(np.int16)).view(torch.bfloat16).float()  # vLLM's load
        assert np.array_equal(_live32(model, n), widened.view(torch.int32).numpy().view(np.uint32))
        assert np.array_equal(_live32(model, n), new.words(n).astype(np.uint32) << 16)
        assert np.array_equal(live.read(n), new.words(n))
    assert sorted(_words(model, new)) == sorted(WIDENED)  # every other tensor bit-exact as bfloat16
    assert live.audit() == new.fingerprint


def test_a_float32_word_that_is_no_widening_fails_the_audit_naming_the_tensor():
    model = _model()
    old = live_snapshot(model)
    _widen(model)
    live = LiveWeights(model, old.specs)
    model.model.layers[0].input_layernorm.weight.data[3] += 1e-6  # low 16 bits set
    with pytest.raises(LayoutError, match="model.layers.0.input_layernorm.weight: a live float32 word"):
        live.audit()


def test_a_parameter_of_a_dtype_no_float_cast_gives_is_refused_naming_it():
    """(Rounded tensors, a float32 table over bfloat16 parameters: test_vllm_rounded.)"""
    model = _model()
    old = live_snapshot(model)
    specs = [type(s)(s.name, "I16", s.shape) if s.name == WIDENED[0] else s for s in old.specs]
    with pytest.raises(LayoutError, match=f"{WIDENED[0]}: vLLM's loader converts it from int16 to bfloat16"):
        LiveWeights(model, specs)


def _qkv(rank: int, tp: int, heads: int = 4, kv: int = 2, hd: int = 8):
    return SimpleNamespace(tp_rank=rank, tp_size=tp, head_size=hd, num_heads=heads // tp,
                           num_kv_heads=max(1, kv // tp), num_kv_head_replicas=max(1, tp // kv))


def test_layout_of_fused_and_tensor_parallel_pieces():
    """Rows of q/k/v and gate/up inside the fused parameters, per rank (TP=2 and kv heads replicated at TP=4)."""
    hidden = 32
    for tp, rank in ((1, 0), (2, 1), (4, 3)):
        layers = SimpleNamespace(qkv_proj=_qkv(rank, tp),
                                 gate_up_proj=SimpleNamespace(tp_rank=rank, tp_size=tp, output_sizes=[64, 64]))
        model = SimpleNamespace(packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                        "gate_up_proj": ["gate_proj", "up_proj"]},
                                l=layers, config=SimpleNamespace(tie_word_embeddings=False))
        params = {"l.qkv_proj.weight": None, "l.gate_up_proj.weight": None}
        q = place(model, "l.q_proj.weight", (32, hidden), params)
        k = place(model, "l.k_proj.weight", (16, hidden), params)
        v = place(model, "l.v_proj.weight", (16, hidden), params)
        up = place(model, "l.up_proj.weight", (64, hidden), params)
        nq, nkv = 32 // tp, max(8, 16 // tp)
        assert (q.param, q.rows, q.at_row) == ("l.qkv_proj.weight", (rank * nq, (rank + 1) * nq), 0)
        kv_rank = rank // max(1, tp // 2)
        assert (k.rows, k.at_row) == ((kv_rank * nkv, (kv_rank + 1) * nkv), nq)
        assert (v.rows, v.at_row) == ((kv_rank * nkv, (kv_rank + 1) * nkv), nq + nkv)
        assert k.counted == (rank % max(1, tp // 2) == 0)
        assert (up.rows, up.at_row) == ((rank * 64 // tp, (rank + 1) * 64 // tp), 64 // tp)
        assert q.whole == (tp == 1)
