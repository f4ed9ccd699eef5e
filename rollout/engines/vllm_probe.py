"""Placement of checkpoint tensors in a vLLM model, learnt from the model's own loaders.

vLLM's ``model.load_weights`` (and the ``weight_loader`` of each parameter it
calls) knows every layout: fused q/k/v and gate/up shards, experts stacked in
FusedMoE's ``w13_weight`` / ``w2_weight``, renames (``hf_to_vllm_mapper``),
transposed or permuted loads, padded vocabularies, tensor- and expert-parallel
slices (a rank's loader skips what it does not hold). :func:`derive` asks it:

1. every parameter's ``.data`` is swapped, for the duration of one call, for a
   probe: ``float64`` filled with ``-1`` for the parameters of one layer (the
   batch), and a one-element tensor expanded to the parameter's shape for every
   other parameter (a write into it raises, so nothing outside the batch is
   ever written, and it costs no memory);
2. the batch's checkpoint tensors are fed through ``load_weights`` as
   ``float64`` tensors holding element ids (exact below 2**53);
3. each probe is read back: where an id landed is where that checkpoint element
   lives; the pairs are compressed into strided blocks
   (:mod:`rollout.engines.vllm_placement`);
4. the original ``.data`` is put back (``finally``): the live weights are never
   written, only their tensors swapped out and back.

A batch whose loader reaches outside its layer is probed again with every
parameter as a probe. Post-load transforms that vLLM applies to the loaded
weights are either replayed on probes (CPU MoE experts' blocked repacking, by
vLLM's own ``process_weights_after_loading`` on a stand-in layer) or refused
naming the layer (quantized layers, CPU GEMM handles, padded expert sizes).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from p2psync.state import TensorSpec
from rollout.engines.vllm_layout import LayoutError
from rollout.engines.vllm_placement import Placement, compress

logger = logging.getLogger(__name__)

_NUM = re.compile(r"\.(\d+)\.")
LAST_DERIVE_S: float | None = None
"""Seconds the last :func:`derive` in this process took (benchmarks read it)."""


def _layer_key(name: str) -> int | None:
    m = _NUM.search("." + name)
    return int(m.group(1)) if m else None


def derive(model: Any, specs: Sequence[TensorSpec]) -> dict[str, Placement]:
    """Where each checkpoint tensor of ``specs`` lives in ``model`` on this rank (see module doc).

    Tensors this rank holds nothing of are absent from the result. Raises :class:`LayoutError`
    naming the tensor when vLLM's loader refuses it or writes computed (not copied) values."""
    import torch

    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    batches: dict[int | None, list[TensorSpec]] = {}
    for s in specs:
        batches.setdefault(_layer_key(s.name), []).append(s)
    owners: dict[int | None, list[str]] = {}
    for n in params:
        owners.setdefault(_layer_key(n), []).append(n)
    found: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    with torch.no_grad():
        for key, batch in batches.items():
            try:
                got = _probe(model, params, batch, owners.get(key, []))
            except _Outside:
                got = _probe(model, params, batch, list(params))
            for name, hits in got.items():
                found.setdefault(name, []).extend(hits)
    out: dict[str, Placement] = {}
    shapes = {s.name: tuple(s.shape) for s in specs}
    for name, hits in found.items():
        targets = {h[0] for h in hits}
        if len(targets) > 1:
            raise LayoutError(f"{name}: vLLM's loader spreads it over several parameters ({sorted(targets)})")
        param = hits[0][0]
        ck = np.concatenate([h[1] for h in hits])
        dst = np.concatenate([h[2] for h in hits])
        dst = _post_load(model, param, params[param], dst)
        out[name] = compress(name, param, shapes[name], ck, dst)
    global LAST_DERIVE_S
    LAST_DERIVE_S = time.perf_counter() - t0
    logger.info("p2psync: placement of %d tensors derived from vLLM's loaders in %.2f s", len(out), LAST_DERIVE_S)
    return out


class _Outside(Exception):
    """The loader wrote outside the batch's parameters (into a guard)."""


def _probe(model: Any, params: dict[str, Any], batch: list[TensorSpec], probed: list[str]
           ) -> dict[str, list[tuple[str, np.ndarray, np.ndarray]]]:
    """Feed ``batch`` through ``model.load_weights`` with ``probed`` parameters as probes (module doc)."""
    import torch

    live = {n: p.data for n, p in params.items()}
    probes: dict[str, Any] = {}
    bases = np.zeros(len(batch) + 1, dtype=np.int64)
    for i, s in enumerate(batch):
        bases[i + 1] = bases[i] + s.numel
    if int(bases[-1]) >= 1 << 53:
        raise LayoutError(f"{batch[0].name}: a layer of more than 2**53 elements cannot be probed")
    wanted = set(probed)
    try:
        for n, p in params.items():
            if n in wanted:
                probes[n] = torch.full(tuple(p.shape), -1.0, dtype=torch.float64, device=p.device)
                p.data = probes[n]
            else:
                p.data = torch.full((1,) * max(1, p.dim()), -1.0, dtype=torch.float64,
                                    device=p.device).reshape((1,) * p.dim()).expand(tuple(p.shape))

        def feed(items: list[tuple[int, TensorSpec]]) -> None:
            model.load_weights((s.name, (torch.arange(s.numel, dtype=torch.float64) + float(bases[i])
                                         ).reshape(tuple(s.shape))) for i, s in items)

        try:
            feed(list(enumerate(batch)))
        except Exception as exc:
            if _guard_error(exc) and len(wanted) < len(params):
                raise _Outside() from exc
            _name_culprit(feed, batch, params, exc)
    finally:
        for n, p in params.items():
            p.data = live[n]
    got: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for n, probe in probes.items():
        v = probe.reshape(-1).cpu().numpy()
        dst = np.flatnonzero(v >= 0)
        if dst.shape[0] == 0:
            continue
        vals = v[dst]
        ids = vals.astype(np.int64)
        if not np.array_equal(ids.astype(np.float64), vals) or int(ids.max()) >= int(bases[-1]):
            owner = batch[min(len(batch) - 1, int(np.searchsorted(bases, ids[0], side="right")) - 1)].name
            raise LayoutError(f"{owner}: vLLM's loader computes the values of {n} from the checkpoint "
                              "(not a copy of its elements); it cannot be updated in place")
        which = np.searchsorted(bases, ids, side="right") - 1
        order = np.argsort(which, kind="stable")
        which, ids, dst = which[order], ids[order], dst[order]
        cuts = np.flatnonzero(np.diff(which)) + 1
        for part_w, part_i, part_d in zip(np.split(which, cuts), np.split(ids, cuts), np.split(dst, cuts)):
            k = int(part_w[0])
            got.setdefault(batch[k].name, []).append((n, part_i - bases[k], part_d))
    return got


def _guard_error(exc: BaseException) -> bool:
    text = str(exc)
    return "single memory location" in text or "refer to a single memory" in text


def _name_culprit(feed: Any, batch: list[TensorSpec], params: dict[str, Any], exc: Exception) -> None:
    """Raise :class:`LayoutError` naming the first tensor the loader fails on alone."""
    for i, s in enumerate(batch):
        try:
            feed([(i, s)])
        except Exception as one:
            if _guard_error(one):
                continue
            empty = sorted(n for n, p in params.items() if p.numel() == 0 and _layer_key(n) == _layer_key(s.name))
            hint = f" (size-0 parameters, repacked at load: {empty})" if empty else ""
            raise LayoutError(f"{s.name}: vLLM's loader cannot place it: {type(one).__name__}: {one}{hint}") from one
    raise LayoutError(f"{batch[0].name}...: vLLM's loader failed on the layer's tensors together: "
                      f"{type(exc).__name__}: {exc}") from exc


# --- transformed copies --------------------------------------------------------------------
def layer_of(model: Any, param: str) -> tuple[str, Any]:
    name = param.rsplit(".", 1)[0] if "." in param else ""
    return name, (model.get_submodule(name) if name else model)


def _moe_experts(layer: Any) -> Any:
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def transformed_reason(model: Any, param: str) -> str | None:
    """Why the live parameter ``param`` is not where the loader's copy of the checkpoint stays
    (None: it is, possibly through a transform :func:`derive` replays)."""
    lname, layer = layer_of(model, param)
    qm = getattr(layer, "quant_method", None)
    if qm is not None and not type(qm).__name__.startswith("Unquantized"):
        return f"layer {lname} is quantized ({type(qm).__name__}): its parameters hold a transformed copy"
    fe = _moe_experts(layer)
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


def _post_load(model: Any, param: str, live: Any, dst: np.ndarray) -> np.ndarray:
    """``dst`` (flat positions as the loader wrote them) moved through the layer's post-load repacking."""
    lname, layer = layer_of(model, param)
    fe = _moe_experts(layer)
    short = param.rsplit(".", 1)[-1]
    if fe is None or not _overrides_post_load(fe) or short not in ("w13_weight", "w2_weight"):
        return dst
    if _replays(fe) is None:
        raise LayoutError(transformed_reason(model, param) or f"layer {lname}: unknown expert repacking")
    if getattr(fe, "_use_zentorch", False):
        return dst
    return _moe_perm(fe, layer, short)[dst]


_PERMS: dict[tuple[Any, ...], np.ndarray] = {}


def _moe_perm(fe: Any, layer: Any, short: str) -> np.ndarray:
    """Where vLLM's CPU experts' ``process_weights_after_loading`` moves each element of ``short``:
    replayed on a stand-in layer holding element ids in raw 16-bit words (low, then high half),
    checked to be a permutation."""
    import torch

    shapes = {n: tuple(getattr(layer, n).shape) for n in ("w13_weight", "w2_weight")}
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
    if after.shape[0] != n or not np.array_equal(np.sort(after), ids):
        raise LayoutError(f"{short}: vLLM's expert repacking ({type(fe).__name__}) is not a permutation of "
                          "the loaded elements")
    perm = np.empty(n, dtype=np.int64)
    perm[after - 1] = np.arange(n, dtype=np.int64)
    _PERMS[key] = perm
    return perm


# --- the placements LiveWeights binds ------------------------------------------------------
_CACHE: dict[tuple[int, int, str, int], dict[str, Placement]] = {}


def placements(model: Any, specs: Sequence[TensorSpec], params: dict[str, Any], group: Any) -> dict[str, Placement]:
    """Where this rank holds each tensor of ``specs`` (absent: nowhere), with ``counted`` set so that
    every element counts on exactly one rank (a copy held by several ranks counts on the lowest).

    A vLLM model: derived from its loaders (:func:`derive`, cached per model, rank, table and
    parameter storage) and
    checked for transformed copies. Any other module (tests' stand-ins): the hand rules of
    :func:`rollout.engines.vllm_layout.place`."""
    import hashlib

    from p2psync.errors import TensorTableMismatch
    from p2psync.state import table_hash
    from rollout.engines.vllm_layout import check_piece, place
    from rollout.engines.vllm_placement import from_piece

    if not callable(getattr(model, "load_weights", None)):
        out: dict[str, Placement] = {}
        unknown = []
        for s in specs:
            try:
                piece = place(model, s.name, tuple(s.shape), params, group.rank)
            except LayoutError:
                unknown.append(s.name)
                continue
            shape = tuple(params[piece.param].shape)
            check_piece(piece, shape)
            out[s.name] = from_piece(piece, shape)
        if unknown:
            raise TensorTableMismatch(unknown=unknown)
        return out
    layout = hash(tuple((n, p.data_ptr(), tuple(p.shape)) for n, p in params.items()))
    key = (id(model), group.rank, table_hash(list(specs)), layout)
    if key not in _CACHE:
        derived = derive(model, specs)
        for pl in derived.values():
            why = transformed_reason(model, pl.param)
            if why is not None:
                raise LayoutError(f"{pl.name}: {why}")
        if group.size > 1:
            mine = [hashlib.sha1(derived[s.name].key().encode()).hexdigest()[:16] if s.name in derived else ""
                    for s in specs]
            every = [t.split(",") for t in group.texts(",".join(mine))]
            for k, s in enumerate(specs):
                if mine[k] and any(every[r][k] == mine[k] for r in range(group.rank)):
                    derived[s.name].counted = False  # a lower rank holds the same copy
        _CACHE.clear()  # one model per process: keep the newest only
        _CACHE[key] = derived
    return _CACHE[key]
