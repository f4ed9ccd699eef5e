"""Copies vLLM transforms after loading: replayed on placements where p2psync can, refused otherwise.

After ``load_weights`` vLLM may move or rewrite a layer's loaded weights
(``process_weights_after_loading``). :func:`post_load` moves the positions a
probe found (:mod:`rollout.engines.vllm_probe`) through such a move when it is a
permutation p2psync can replay: the CPU MoE experts' blocked repacking, replayed
by vLLM's own code on a stand-in layer holding element ids. A layer whose live
parameter holds anything else (quantized, repacked in a way that cannot be
replayed, padded) is named by :func:`transformed_reason` and refused at init.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout.engines.vllm_layout import LayoutError


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
    if qm is not None and not type(qm).__name__.startswith("Unquantized"):
        return f"layer {lname} is quantized ({type(qm).__name__}): its parameters hold a transformed copy"
    fe = moe_experts(layer)
    if fe is not None and _replays(fe) is None and _overrides_post_load(fe):
        return (f"layer {lname} repacks its experts after loading ({type(fe).__name__}) in a way p2psync "
                "cannot replay")
    return None


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
    if not repacked(model, param):
        return dst
    lname, layer = layer_of(model, param)
    fe = moe_experts(layer)
    assert fe is not None
    short = param.rsplit(".", 1)[-1]
    if _replays(fe) is None:
        raise LayoutError(transformed_reason(model, param) or f"layer {lname}: unknown expert repacking")
    if getattr(fe, "_use_zentorch", False):
        return dst
    shapes = {n: tuple(getattr(layer, n).shape) for n in ("w13_weight", "w2_weight")}
    experts = shapes[short][0]
    if experts >= 2:
        # The repacking is per expert when two experts repack as one does, shifted by a block:
        # then only one expert's permutation is replayed and kept.
        two = _moe_perm(fe, layer, short, {n: (2,) + shp[1:] for n, shp in shapes.items()})
        block = two.shape[0] // 2
        if np.array_equal(two[block:], two[:block] + block):
            return (dst // block) * block + two[:block][dst % block]
    return _moe_perm(fe, layer, short, shapes)[dst]


_PERMS: dict[tuple[Any, ...], np.ndarray] = {}


def _moe_perm(fe: Any, layer: Any, short: str, shapes: dict[str, tuple[int, ...]]) -> np.ndarray:
    """Where vLLM's CPU experts' ``process_weights_after_loading`` moves each element of ``short``
    in parameters of ``shapes``: replayed on a stand-in layer holding element ids in raw 16-bit
    words (low, then high half), checked to be a permutation."""
    import torch

    key = (type(fe).__name__, fe.isa, tuple(shapes.items()), short)
    if key in _PERMS:
        return _PERMS[key]
    n = int(np.prod(shapes[short]))
    ids = np.arange(1, n + 1, dtype=np.int64)  # 0 marks padding
    halves = []
    for shift in (0, 16, 32):
        if shift and not (ids >> shift).any():
            break
        fake = torch.nn.Module()
        for name, shp in shapes.items():
            words = ((ids >> shift) & 0xFFFF).astype(np.uint16) if name == short else \
                np.zeros(int(np.prod(shp)), dtype=np.uint16)
            t = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).reshape(shp)
            fake.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
        for attr in ("moe_config", "activation"):  # what the experts' post-load step reads of its layer
            object.__setattr__(fake, attr, getattr(layer, attr, None))
        fe.process_weights_after_loading(fake)
        out = getattr(fake, short).data
        halves.append(out.reshape(-1).view(torch.int16).numpy().view(np.uint16).astype(np.int64) << shift)
    after = np.bitwise_or.reduce(halves) if len(halves) > 1 else halves[0]
    seen = np.zeros(n + 1, dtype=bool)
    if after.shape[0] == n and int(after.min()) >= 1 and int(after.max()) <= n:
        seen[after] = True  # n values in [1, n] covering all of them: a permutation (no sort)
    if not seen[1:].all():
        raise LayoutError(f"{short}: vLLM's expert repacking ({type(fe).__name__}) is not a permutation of "
                          "the loaded elements")
    perm = np.empty(n, dtype=np.int64)
    perm[after - 1] = np.arange(n, dtype=np.int64)
    _PERMS[key] = perm
    return perm
