"""Checkpoint tensors vLLM rounds at load (a ``float32`` checkpoint served in ``bfloat16``): the rounding,
and the live weights that keep the checkpoint's words beside the rounded ones (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2psync import keys
from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
from p2psync.errors import FingerprintMismatch
from p2psync.state import ModelState, TensorSpec
from rollout.engines.vllm.apply.kept import CheckpointUnreadable, NotTheLoadedCheckpoint
from rollout.engines.vllm.apply.weights import LiveWeights
from rollout.engines.vllm.placement.casts import Rounding, Widening, cast_for
from rollout.engines.vllm.placement.rules import LayoutError
from rollout.engines.vllm.worker.checkpoint import read_folder
from rollout_helpers import live_snapshot

F32_SPECIAL = np.array([
    0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x3F808001,  # ties to even (down, up), near ties
    0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F808000,  # NaNs: payloads, signalling, signs
    0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,  # inf, -inf, rounding up to inf
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807FFFFF,  # subnormals (ties among them)
    0x80000000, 0x00000000, 0x33800000, 0x387FE000,  # -0.0, 0.0, float16 underflow / subnormal edge
], dtype=np.uint32)


def _copied(words: np.ndarray, src: torch.dtype, dst: torch.dtype) -> np.ndarray:
    """What vLLM's load writes: ``Tensor.copy_`` of the checkpoint tensor into a ``dst`` parameter."""
    signed = {2: torch.int16, 4: torch.int32}
    t = torch.from_numpy(words.view({2: np.int16, 4: np.int32}[words.itemsize])).view(src)
    param = torch.empty(t.shape, dtype=dst)
    param.copy_(t)
    return param.view(signed[param.element_size()]).numpy().view({2: np.uint16, 4: np.uint32}[param.element_size()])


def _rne_bf16(words: np.ndarray) -> np.ndarray:
    """Round to nearest, ties to even, of non-NaN ``float32`` words to ``bfloat16`` (integer arithmetic)."""
    w = words.astype(np.uint64)
    return ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16)


def test_rounding_is_the_one_torch_copy_makes_at_load():
    rng = np.random.default_rng(0)
    words = np.concatenate([F32_SPECIAL, rng.integers(0, 1 << 32, size=100_000, dtype=np.uint64).astype(np.uint32)])
    cast = cast_for("x", torch.float32, torch.bfloat16)
    assert isinstance(cast, Rounding) and not cast.readable
    got = cast.to_live(words)
    assert got.dtype == np.uint16 and np.array_equal(got, _copied(words, torch.float32, torch.bfloat16))
    nan = np.isnan(words.view(np.float32))
    assert np.array_equal(got[~nan], _rne_bf16(words[~nan]))  # not merely torch against itself
    assert got[0] == 0x3F80 and got[1] == 0x3F82 and got[13] == 0x7F80 and got[21] == 0x8000
    for a, b, src in [(torch.float32, torch.float16, words), (torch.bfloat16, torch.float16, got),
                      (torch.float16, torch.bfloat16, _copied(words, torch.float32, torch.float16))]:
        c = cast_for("x", a, b)
        assert isinstance(c, Rounding) and np.array_equal(c.to_live(src), _copied(src, a, b))
    with pytest.raises(LayoutError, match="x: vLLM rounds it from float32 to bfloat16"):
        cast.to_checkpoint(got, "x")


def test_pairs_other_than_float_casts_stay_refused_and_widening_stays_exact():
    assert isinstance(cast_for("x", "bfloat16", "float32"), Widening)
    assert cast_for("x", "float32", "float32") is None
    with pytest.raises(LayoutError, match="x: vLLM's loader narrows it from float32 to int8"):
        cast_for("x", "float32", "int8")
    with pytest.raises(LayoutError, match="x: vLLM's loader converts it from bfloat16 to float64"):
        cast_for("x", "bfloat16", "float64")


# --- live weights ----------------------------------------------------------------------------
def _served() -> tuple[torch.nn.Module, ModelState]:
    """A float32 checkpoint (its table) and the model served from it in bfloat16 (rounded by ``to``)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = live_snapshot(model)
    return model.to(torch.bfloat16), state


def _reader(state: ModelState):
    """The checkpoint ``state`` as a :data:`~rollout.engines.vllm.apply.kept.Reader` (a box of each tensor)."""
    def read(specs, boxes):
        return {s.name: state.words(s.name).reshape(s.shape)[tuple(slice(a, b) for a, b in box)].reshape(-1).copy()
                for s, box in zip(specs, boxes)}
    return read


NORM = "model.layers.0.input_layernorm.weight"


def _delta(old: ModelState, seed: int = 1, base: int = 0):
    """A delta of float32 words: low-bit changes (most round to the same bfloat16 word), and
    :data:`F32_SPECIAL` in a norm weight."""
    new = old.clone()
    g = np.random.default_rng(seed)
    for n in new:
        w = new.words(n)
        idx = g.choice(w.shape[0], size=max(1, w.shape[0] // 50), replace=False)
        w[idx] ^= (g.integers(1, 1 << 20, size=idx.shape[0]) << (seed % 4)).astype(w.dtype)
    new.words(NORM)[:len(F32_SPECIAL)] = F32_SPECIAL
    new.invalidate()
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=4096))
    m = build_manifest(enc, model_id="t", base_version=base, target_version=base + 1, chunk_size=64 << 10,
                       private_key=keys.generate())
    return new, m, enc.chunks


def _live16(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16).copy()
            for n, p in model.named_parameters()}


def _rounded(state: ModelState, names) -> dict[str, np.ndarray]:
    return {n: _copied(state.words(n), torch.float32, torch.bfloat16) for n in names}


@pytest.mark.parametrize("in_place", [True, False], ids=["host-words", "segment-copies"])
def test_a_rounded_checkpoint_takes_float32_deltas_bit_exact_and_keeps_its_words(in_place):
    """Live words are the rounding of the trainer's float32 words after every delta; the fingerprint,
    the audit and the read-back are the float32 checkpoint's; a refused commit restores both."""
    model, old = _served()
    live = LiveWeights(model, old.specs, checkpoint=_reader(old))
    live.host_memory = in_place  # False: the path a GPU-resident model takes
    assert {pl.cast for pl in live.places if pl is not None} == {"bfloat16"}
    assert live.fingerprint == old.fingerprint == live.audit()
    new, m, chunks = _delta(old)
    changes, _ = live.decode(m, chunks)
    with pytest.raises(FingerprintMismatch):  # refused after writing: live and kept words as they were
        live.commit(changes, "0" * 32)
    assert all(np.array_equal(live.read(n), old.words(n)) for n in old)
    assert all(np.array_equal(_live16(model)[n], w) for n, w in _rounded(old, old).items())
    assert live.audit() == old.fingerprint
    assert live.apply_delta(m, chunks) == new.fingerprint
    newer, m2, chunks2 = _delta(new, seed=2, base=1)
    assert live.apply_delta(m2, chunks2) == newer.fingerprint
    got = _live16(model)
    for n, want in _rounded(newer, newer).items():
        assert np.array_equal(got[n], want), n
        assert np.array_equal(live.read(n), newer.words(n)), n
    assert live.audit() == newer.fingerprint


def test_a_snapshot_writes_the_rounded_and_the_kept_words():
    model, old = _served()
    live = LiveWeights(model, old.specs, checkpoint=_reader(old))
    new, _, _ = _delta(old)
    enc = encode_snapshot(new, CodecOptions(chunk_size=64 << 10))
    m = build_manifest(enc, model_id="t", target_version=1, chunk_size=64 << 10, private_key=keys.generate())
    assert live.load_snapshot(m, enc.chunks) == new.fingerprint
    assert all(np.array_equal(_live16(model)[n], w) for n, w in _rounded(new, new).items())
    assert all(np.array_equal(live.read(n), new.words(n)) for n in new)


def test_the_kept_words_must_be_the_checkpoint_vllm_loaded():
    model, old = _served()
    with pytest.raises(CheckpointUnreadable, match="no reader"):
        LiveWeights(model, old.specs)
    other = old.clone()
    other.words(NORM)[5] ^= 0x10000  # rounds to another bfloat16 word
    other.invalidate()
    with pytest.raises(NotTheLoadedCheckpoint, match=f"{NORM}: element 5 .* the engine does not hold that"):
        LiveWeights(model, old.specs, checkpoint=_reader(other))
    short = lambda specs, boxes: {s.name: old.words(s.name)[:-1] for s in specs}  # noqa: E731
    with pytest.raises(CheckpointUnreadable, match="no tensor of that name, dtype and size"):
        LiveWeights(model, old.specs, checkpoint=short)
    low = old.clone()
    low.words(NORM)[5] ^= 0x1  # the same bfloat16 word: it holds that checkpoint as far as vLLM can tell
    low.invalidate()
    assert LiveWeights(model, old.specs, checkpoint=_reader(low)).fingerprint == low.fingerprint


def test_a_live_word_written_outside_p2psync_fails_reads_naming_the_tensor():
    model, old = _served()
    live = LiveWeights(model, old.specs, checkpoint=_reader(old))
    model.model.layers[0].input_layernorm.weight.data[3] += 1.0
    with pytest.raises(LayoutError, match=f"{NORM}: a live bfloat16 word .* is not the conversion"):
        live.audit()
    new, m, chunks = _delta(old)
    with pytest.raises(LayoutError, match=NORM):  # its base words are checked as decoded
        live.apply_delta(m, chunks)


def test_the_loaded_folder_is_read_for_the_rounded_tensors_only(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: an index names each file
    assert (tmp_path / "model.safetensors.index.json").exists()
    state = live_snapshot(model)
    names = [NORM, "model.layers.0.mlp.down_proj.weight"]
    specs = [s for s in state.specs if s.name in names]
    got = read_folder(str(tmp_path), specs)
    assert sorted(got) == sorted(names) and all(np.array_equal(got[n], state.words(n)) for n in names)
    with pytest.raises(CheckpointUnreadable, match="is not a local folder"):
        read_folder("Qwen/Qwen3-0.6B", specs)
    with pytest.raises(CheckpointUnreadable, match="holds it as F32 .* as BF16"):
        read_folder(str(tmp_path), [TensorSpec(NORM, "BF16", specs[0].shape if specs[0].name == NORM
                                               else specs[1].shape)])
    with pytest.raises(CheckpointUnreadable, match="nowhere.weight: .*no tensor of that name"):
        read_folder(str(tmp_path), [TensorSpec("nowhere.weight", "F32", (4,))])
