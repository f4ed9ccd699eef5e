"""Copies vLLM transforms after loading: replayed on placements where p2psync can, refused otherwise.

After ``load_weights`` vLLM may move or rewrite a layer's loaded weights
(``process_weights_after_loading``). :func:`post_load` moves the positions a
probe found (:mod:`rollout.engines.vllm.placement.probe`) through such a move when it is a
permutation p2psync can replay: the CPU MoE experts' blocked repacking, replayed
by vLLM's own code on a stand-in layer holding element ids. A layer whose live
parameter holds anything else (quantized, repacked in a way that cannot be
replayed, padded) is named by :func:`transformed_reason` and refused at init.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout.engines.vllm.placement.rules import LayoutError

QUANTIZED_WHY = ("a quantized layer computes with words and scales that vLLM's load or the checkpoint's quantizer "
                 "made from the weights (FP8, INT8, ...), not with the trainer's published words, so p2psync "
                 "cannot keep it bit-exact (docs/ROLLOUT.md, 'FP8 rollouts')")
"""Why a quantized engine is refused: the one text the engine's init check and the placement's
refusal of a quantized layer share."""


def layer_of(model: Any, param: str) -> tuple[str, Any]:
    name = param.rsplit(".", 1)[0] if "." in param else ""
    return name, (model.get_submodule(name) if name else model)


def moe_experts(layer: Any) -> Any:
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def transformed_reason(model: Any, param: str) -> str | None:
    """Why the live parameter ``param`` is not where the loader's copy of the checkpoint stays
    (None: it is, possibly through a transform :func:`derive` replays)."""
    lname, layer = layer_of(model, param)
    qm = getattr(layer, "quant_method", None)
    if qm is not None and not isinstance(qm, _unquantized()):
        return f"layer {lname} is quantized ({type(qm).__name__}): {QUANTIZED_WHY}"
    fe = moe_experts(layer)
    if fe is not None and _replays(fe) is None and _overrides_post_load(fe):
        return (f"layer {lname} repacks its experts after loading ({type(fe).__name__}) in a way p2psync "
                "cannot replay")
    return None


def _unquantized() -> tuple[type, ...]:
    """vLLM's quantization methods that keep the checkpoint's words as loaded (CPU and CUDA builds)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod


def _overrides_post_load(fe: Any) -> bool:
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    base = getattr(mk, "FusedMoEExpertsModular", None) or getattr(mk, "FusedMoEPermuteExpertsUnpermute", None)
    own = type(fe).process_weights_after_loading
    return base is None or own is not getattr(base, "process_weights_after_loading", None)


def _replays(fe: Any) -> Any:
    """The CPU experts class whose repacking can be replayed on probes (None: not one)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # pragma: no cover - a build without CPU MoE
        return None
    if not isinstance(fe, CPUUnquantizedExperts):
        return None
    if getattr(fe, "_use_zentorch", False):
        return fe
    cfg = fe.moe_config
    if type(fe)._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
        return None  # padded: the live shape is not the loader's
    return fe


def repacked(model: Any, param: str) -> bool:
    """Whether ``param``'s layer moves its elements after loading (:func:`post_load` is not the identity)."""
    _, layer = layer_of(model, param)
    fe = moe_experts(layer)
    return fe is not None and _overrides_post_load(fe) and param.rsplit(".", 1)[-1] in ("w13_weight", "w2_weight")


def post_load(model: Any, param: str, live: Any, dst: np.ndarray) -> np.ndarray:
    """``dst`` (flat positions as the loader wrote them) moved through the layer's post-load repacking."""
    moved = _replayed(model, param)
    if moved is None:
        return dst
    one = _per_expert(*moved)
    if one is not None:
        block = one.shape[0]
        return (dst // block) * block + one[dst % block]
    return _moe_perm(*moved)[dst]


def expert_block(model: Any, param: str) -> int | None:
    """The elements of one expert in ``param`` when its post-load repacking moves each expert's
    elements within that expert's block, alike for every expert (then a placement inside one block,
    moved, is the first block's moved and shifted); None otherwise."""
    moved = _replayed(model, param)
    one = None if moved is None else _per_expert(*moved)
    return None if one is None else int(one.shape[0])


def _replayed(model: Any, param: str) -> tuple[Any, Any, str, dict[str, tuple[int, ...]]] | None:
    """``(experts, layer, parameter's short name, both expert parameters' shapes)`` of a repacking
    :func:`post_load` replays; None where it moves nothing. Raises :class:`LayoutError` for a
    repacking it cannot replay."""
    if not repacked(model, param):
        return None
    lname, layer = layer_of(model, param)
    fe = moe_experts(layer)
    assert fe is not None
    if _replays(fe) is None:
        raise LayoutError(transformed_reason(model, param) or f"layer {lname}: unknown expert repacking")
    if getattr(fe, "_use_zentorch", False):
        return None
    shapes = {n: tuple(getattr(layer, n).shape) for n in ("w13_weight", "w2_weight")}
    return fe, layer, param.rsplit(".", 1)[-1], shapes


def _per_expert(fe: Any, layer: Any, short: str, shapes: dict[str, tuple[int, ...]]) -> np.ndarray | None:
    """One expert's permutation, when two experts repack as one does, shifted by a block (then the
    repacking is per expert, and only one expert's is replayed and kept); None otherwise."""
    if shapes[short][0] < 2:
        return None
    key = (type(fe).__name__, fe.isa, tuple(shapes.items()), short, "per expert")
    if key not in _ONE:
        two = _moe_perm(fe, layer, short, {n: (2,) + shp[1:] for n, shp in shapes.items()})
        block = two.shape[0] // 2
        _ONE[key] = two[:block] if np.array_equal(two[block:], two[:block] + block) else None
    return _ONE[key]


_ONE: dict[tuple[Any, ...], np.ndarray | None] = {}


_PERMS: dict[tuple[Any, ...], dict[str, np.ndarray]] = {}


def _moe_perm(fe: Any, layer: Any, short: str, shapes: dict[str, tuple[int, ...]]) -> np.ndarray:
    """Where vLLM's CPU experts' ``process_weights_after_loading`` moves each element of ``short``
    in parameters of ``shapes``: replayed on a stand-in layer holding element ids in raw 16-bit
    words (low, then high half; both parameters in the same replays), checked to be a permutation."""
    import torch

    key = (type(fe).__name__, fe.isa, tuple(shapes.items()))
    if key in _PERMS:
        return _PERMS[key][short]
    sizes = {n: int(np.prod(shp)) for n, shp in shapes.items()}
    top = max(sizes.values())
    ids: Any = np.arange(1, top + 1, dtype=np.uint32 if top < 1 << 32 else np.uint64)  # 0 marks padding
    halves = ids.itemsize // 2
    after = {n: np.zeros(sizes[n], dtype=ids.dtype) for n in shapes}
    for k in range(halves):  # the k-th 16-bit half of every id (little-endian words)
        if k and not top >> (16 * k):
            break
        fake = torch.nn.Module()
        for name, shp in shapes.items():
            words = np.ascontiguousarray(ids[:sizes[name]].view(np.uint16)[k::halves])
            t = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).reshape(shp)
            fake.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        for attr in ("moe_config", "activation"):  # what the experts' post-load step reads of its layer
            object.__setattr__(fake, attr, getattr(layer, attr, None))
        fe.process_weights_after_loading(fake)
        for name in shapes:
            out = getattr(fake, name).data.reshape(-1).view(torch.int16).numpy().view(np.uint16)
            if out.shape[0] == sizes[name]:
                after[name].view(np.uint16)[k::halves] = out
    perms = {}
    for name, n in sizes.items():
        got = after[name]
        perm = np.full(n, -1, dtype=np.int64)
        if n and int(got.min()) >= 1 and int(got.max()) <= n:
            perm[got.astype(np.int64) - 1] = np.arange(n, dtype=np.int64)
        if not n or int(perm.min()) < 0:  # n ids in [1, n] fill every slot only if they are a permutation
            raise LayoutError(f"{name}: vLLM's expert repacking ({type(fe).__name__}) is not a permutation of "
                              "the loaded elements")
        perms[name] = perm
    _PERMS[key] = perms
    return perms[short]
