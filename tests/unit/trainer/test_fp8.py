"""FP8 checkpoints of a published table (trainer.fp8): vLLM's layout and rounding, and their deltas
bit-exact through the codec's 1-byte words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2psync import dtypes
from p2psync.codec.decode import Applier
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.state import ModelState
from trainer.fp8 import FP8_MAX, dequantize, fp8_checkpoint, is_fp8_linear, quantize_block, quantize_tensor


def _weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def _within_fp8_rounding(w: torch.Tensor, words: torch.Tensor, scale_full: torch.Tensor) -> None:
    """|w - words * scale| <= half an e4m3 step of w / scale: 2^-4 relative for normals,
    2^-10 absolute below the smallest normal (2^-6), plus float32 slack."""
    x = w.float() / scale_full
    err = (w.float() - words.float() * scale_full).abs() / scale_full
    bound = torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, 2.0 ** -10)) * (1 + 1e-5) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


def test_blockwise_layout_scales_and_round_trip_with_partial_edge_blocks() -> None:
    w = _weight((300, 200))  # 3 x 2 blocks; the last row of blocks holds 44 rows, the last column 72
    w[290, 199] = 0.75  # the edge block's amax: its scale must come from its own elements only
    words, scale = quantize_block(w)
    assert words.dtype == torch.float8_e4m3fn and words.shape == (300, 200)
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            blk = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert scale[i, j].item() == pytest.approx(blk.abs().max().float().item() / FP8_MAX, rel=1e-6)
            # the element of largest magnitude lands on the largest FP8 value
            assert words[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float().abs().max().item() == FP8_MAX
    assert scale[2, 1].item() == pytest.approx(0.75 / FP8_MAX, rel=1e-6)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    _within_fp8_rounding(w, words, full)
    assert torch.equal(dequantize(words, scale), words.float() * full)


def test_per_tensor_layout_and_round_trip() -> None:
    w = _weight((96, 130), seed=1)
    words, scale = quantize_tensor(w)
    assert words.shape == (96, 130) and words.dtype == torch.float8_e4m3fn
    assert scale.shape == () and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(w.abs().max().float().item() / FP8_MAX, rel=1e-6)
    _within_fp8_rounding(w, words, scale.expand(96, 130))
    zeros, zscale = quantize_tensor(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert torch.isfinite(zscale) and not bool(zeros.float().any())  # an all-zero weight: a finite scale


@pytest.mark.slow
@pytest.mark.timeout(600)  # importing vLLM: 20 s idle, minutes on a loaded machine
def test_blockwise_words_and_scales_are_vllms_own() -> None:
    """The same bits as vLLM's block quantizer (``per_block_cast_to_fp8``), edge blocks included."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    # A block where multiplying by the reciprocal of the scale and dividing by it round one
    # element to different words (a subnormal FP8 value): the quantizer must multiply, as vLLM's.
    odd = torch.zeros(128, 128, dtype=torch.bfloat16)
    odd[0, 0], odd[1, 1] = 0.008056640625, 1.2293457984924316e-07
    divided = (odd[1, 1].float() / (odd[0, 0].float() / FP8_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert int(quantize_block(odd)[0].view(torch.uint8)[1, 1]) != int(divided)
    for shape, seed in (((256, 384), 2), ((300, 200), 3), ((130, 1), 4), (odd, 0)):
        w = shape if isinstance(shape, torch.Tensor) else _weight(shape, seed)
        shape = tuple(w.shape)
        ours, our_scale = quantize_block(w)
        theirs, their_scale = deep_gemm.per_block_cast_to_fp8(w, [128, 128])
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), shape
        assert torch.equal(our_scale.view(torch.int32), their_scale.view(torch.int32)), shape


@pytest.mark.parametrize("bad, why", [
    (torch.ones(4), "2-D"),
    (torch.ones(2, 2, dtype=torch.int32), "bf16, fp16 or float32"),
    (torch.tensor([[1.0, float("nan")]]), "NaN or an infinity"),
    (torch.tensor([[1.0, float("inf")]]), "NaN or an infinity"),
])
def test_weights_that_have_no_fp8_form_are_refused_naming_the_tensor(bad: torch.Tensor, why: str) -> None:
    for quant in (quantize_block, quantize_tensor):
        with pytest.raises(ValueError, match=why) as e:
            quant(bad, what="model.layers.0.mlp.up_proj.weight")
        assert "model.layers.0.mlp.up_proj.weight" in str(e.value)


def test_checkpoint_quantizes_linear_weights_and_keeps_the_rest() -> None:
    names = {"model.embed_tokens.weight": (64, 32), "model.layers.0.input_layernorm.weight": (32,),
             "model.layers.0.self_attn.q_proj.weight": (32, 32), "model.layers.0.mlp.gate.weight": (4, 32),
             "model.layers.0.mlp.experts.0.gate_proj.weight": (16, 32),
             "model.layers.0.mlp.shared_expert_gate.weight": (1, 32), "lm_head.weight": (64, 32)}
    table = {n: torch.ones(s, dtype=torch.bfloat16) for n, s in names.items()}
    assert [n for n, s in names.items() if is_fp8_linear(n, s)] == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"]
    block = fp8_checkpoint(table, "block")
    assert list(block) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                           "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                           "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
                           "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv",
                           "model.layers.0.mlp.shared_expert_gate.weight", "lm_head.weight"]
    assert block["model.layers.0.mlp.gate.weight"] is table["model.layers.0.mlp.gate.weight"]
    tensor = fp8_checkpoint(table, "tensor")
    assert tensor["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    with pytest.raises(ValueError, match="scheme"):
        fp8_checkpoint(table, "channel")


def test_fp8_checkpoint_deltas_are_bit_exact_through_one_byte_words() -> None:
    """Two versions' FP8 checkpoints (one AdamW-sized step apart, plus FP8 NaN and -0 words the
    quantizer never writes) are a delta the receiver applies to exactly the new words and scales."""
    v0 = {"model.layers.0.self_attn.q_proj.weight": _weight((256, 300), 5),
          "model.layers.0.mlp.down_proj.weight": _weight((200, 128), 6),
          "model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}
    g = torch.Generator().manual_seed(7)
    v1 = {n: (t.float() + 1e-4 * torch.randn(t.shape, generator=g)).to(torch.bfloat16) for n, t in v0.items()}
    for scheme in ("block", "tensor"):
        old, new = fp8_checkpoint(v0, scheme), fp8_checkpoint(v1, scheme)
        q = new["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8).view(-1)
        q[0], q[1] = 0x7F, 0x80  # NaN and -0.0 words
        base, target = ModelState(old), ModelState(new)
        assert {s.dtype for s in base.specs} == {"F8_E4M3", "F32", "BF16"}
        enc = encode_delta(base, target, CodecOptions(chunk_size=64 << 10, segment_elements=4096))
        changed = sum(enc.changed)
        assert 0 < changed < sum(s.numel for s in base.specs)
        out = base.clone()
        ap = Applier(out, kind=enc.kind, specs=enc.specs, n_chunks=len(enc.chunks),
                     target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)
        ap.add_chunks(enumerate(enc.chunks), 2)
        ap.commit()
        for name in target:
            assert np.array_equal(out.words(name), target.words(name)), (scheme, name)
        assert out.fingerprint == target.fingerprint == out.audit()
        assert dtypes.from_code("F8_E4M3").width == 1
