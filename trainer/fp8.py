"""FP8 versions of a published table, laid out as vLLM's FP8 checkpoints hold them.

What an FP8 rollout would receive: every linear weight ``X.weight`` [N, K] of the
bf16 table becomes ``float8_e4m3fn`` words of the same shape plus float32 scales,
under the names vLLM 0.32's ``Fp8LinearMethod`` registers
(``model_executor/layers/quantization/fp8.py``):

- **blockwise** (``quantization_config.weight_block_size: [128, 128]``, the
  DeepSeek-V3 layout): ``X.weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)],
  one per 128x128 block; the last row and column of blocks may be partial. Despite
  its name it is the dequantization multiplier: ``w ~= words * scale``.
- **per tensor**: ``X.weight_scale`` float32 of shape [] (one per checkpoint tensor,
  so q, k and v each have their own; vLLM requantizes fused shards to their largest
  scale after loading).

Tensors FP8 checkpoints keep in bf16 (:func:`is_fp8_linear`): embeddings and the
LM head, norms (1-D), MoE router gates. Rounding follows vLLM's own quantizers, so
the words are the ones vLLM would compute from the same bf16 weights:

- blockwise as ``vllm.utils.deep_gemm.per_block_cast_to_fp8``: the block's
  ``amax`` in float32 clamped below at 1e-4, ``scale = amax / 448``,
  ``words = e4m3fn(w * (1 / scale))`` rounded to nearest even;
- per tensor as vLLM's online per-tensor quantization: ``scale = amax / 448``
  (true division in float32, ``amax`` clamped below at 1e-12 so an all-zero weight
  has a finite scale), ``words = e4m3fn(clamp(w * (1 / scale), -448, 448))``
  (its static quant kernel multiplies by the reciprocal).

Another quantizer (true division instead of the reciprocal, another clamp, scales
rounded to powers of two as UE8M0 checkpoints do) gives other words for some
elements: a bit-exact FP8 rollout needs the trainer to run the very quantizer the
engine's checkpoint was made with (docs/ROLLOUT.md, "FP8 rollouts").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
BLOCK = (128, 128)
BLOCK_AMAX_FLOOR = 1e-4
"""``per_block_cast_to_fp8``'s lower clamp of a block's amax."""
TENSOR_AMAX_FLOOR = 1e-12
SCHEMES = ("block", "tensor")

_KEEP = re.compile(r"(^|\.)(embed_tokens|embed|wte|lm_head|gate|router|shared_expert_gate)\.weight$")


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 checkpoint holds the checkpoint tensor ``name`` of ``shape`` in FP8: the 2-D
    weights of linear layers (attention and MLP projections, experts). Embeddings, the LM head,
    norms and biases (1-D) and router gates (``mlp.gate``, ``shared_expert_gate``) stay in the
    model's dtype, as DeepSeek-V3's and Qwen3-MoE's FP8 checkpoints keep them."""
    return len(shape) == 2 and name.endswith(".weight") and _KEEP.search(name) is None


def _check(w: torch.Tensor, what: str) -> None:
    if w.ndim != 2:
        raise ValueError(f"{what}: FP8 quantization takes a 2-D weight, got shape {tuple(w.shape)}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: FP8 quantization takes a bf16, fp16 or float32 weight, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"{what}: FP8 quantization takes a non-empty weight")


def quantize_block(w: torch.Tensor, block: tuple[int, int] = BLOCK, what: str = "weight"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words, scale_inv)`` of the 2-D weight ``w``: ``float8_e4m3fn`` words of ``w``'s shape and
    float32 scales [ceil(N/bn), ceil(K/bk)] (module doc). Raises ``ValueError`` naming ``what`` for
    a weight that is not 2-D floating point, or that holds a NaN or infinity (no finite scale
    describes it)."""
    _check(w, what)
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"{what}: block sizes must be positive, got {block}")
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    x = w
    if (gn * bn, gk * bk) != (n, k):
        x = torch.zeros((gn * bn, gk * bk), dtype=w.dtype)  # zeros do not change a block's amax
        x[:n, :k] = w
    view = x.view(gn, bn, gk, bk)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{what}: holds a NaN or an infinity; FP8 scales need finite weights")
    scale = amax.clamp(BLOCK_AMAX_FLOOR) / FP8_MAX
    words = (view * (1.0 / scale)).to(FP8).view(gn * bn, gk * bk)
    if x is not w:
        words = words[:n, :k]
    return words.contiguous(), scale.view(gn, gk).contiguous()


def quantize_tensor(w: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(words, scale)`` of the 2-D weight ``w`` with one float32 scale of shape [] (module doc);
    the same errors as :func:`quantize_block`."""
    _check(w, what)
    amax = w.abs().amax().float()
    if not bool(torch.isfinite(amax)):
        raise ValueError(f"{what}: holds a NaN or an infinity; FP8 scales need finite weights")
    scale = amax.clamp(TENSOR_AMAX_FLOOR) / torch.tensor(FP8_MAX, dtype=torch.float32)
    words = (w.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return words.contiguous(), scale.reshape(()).contiguous()


def dequantize(words: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """float32 ``words * scale``, each scale broadcast over its block (a scale of shape [] over all)."""
    if scale.ndim == 0:
        return words.float() * scale
    bn, bk = block
    n, k = words.shape
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return words.float() * full


def fp8_checkpoint(table: Mapping[str, torch.Tensor], scheme: str = "block",
                   block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of the published ``table`` (checkpoint names to tensors, in order):
    each tensor :func:`is_fp8_linear` names becomes its words under the same name followed by
    its scales (``X.weight_scale_inv`` blockwise, ``X.weight_scale`` per tensor); every other
    tensor is kept as it is. ``scheme``: ``"block"`` or ``"tensor"`` (``ValueError`` otherwise)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in table.items():
        if not is_fp8_linear(name, tuple(t.shape)):
            out[name] = t
            continue
        if scheme == "block":
            out[name], out[name + "_scale_inv"] = quantize_block(t, block, what=name)
        else:
            out[name], out[name + "_scale"] = quantize_tensor(t, what=name)
    return out
