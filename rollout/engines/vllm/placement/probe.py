"""Placement of checkpoint tensors in a vLLM model, learnt from the model's own loaders.

vLLM's ``model.load_weights`` (and the ``weight_loader`` of each parameter it
calls) knows every layout: fused q/k/v and gate/up shards, experts stacked in
FusedMoE's ``w13_weight`` / ``w2_weight``, renames (``hf_to_vllm_mapper``),
transposed or permuted loads, padded vocabularies, tensor- and expert-parallel
slices (a rank's loader skips what it does not hold). :func:`derive` asks it:

1. every parameter's ``.data`` is swapped, for the duration of one call, for a
   probe: zeros for the parameters of one layer (the batch; on the CPU from
   the kernel's zero pages, so a probe costs only the pages the loader writes),
   and a one-element tensor expanded to the parameter's shape for every other
   parameter (a write into it raises, so nothing outside the batch is ever
   written, and it costs no memory);
2. the batch's checkpoint tensors are fed through ``load_weights`` as ``float32``
   tensors holding element ids ``1, 2, ...`` (0 is a word the loader did not
   write, or zeroed: a padded vocabulary's rows), in passes of 2**24 ids (each
   exact in ``float32``) for a batch of more elements;
3. each probe is read back after each pass: where an id landed is where that
   checkpoint element lives; read as maximal runs (id and position both going
   up by one) in one compiled pass per probe
   (:class:`rollout.engines.vllm.placement.readback.Readback`), compressed into
   strided blocks (:mod:`rollout.engines.vllm.placement.boxes`);
4. the original ``.data`` is put back (``finally``): the live weights are never
   written, only their tensors swapped out and back.

A load that copies blocks gives a few runs per tensor; a transposed or permuted
load gives one per element and is read back by a scatter of its ids instead. A
batch whose loader reaches outside its layer is probed again with every
parameter as a probe. Layers alike (same checkpoint names up to the layer
number, shapes, dtypes, parameters, module classes, weight loaders and expert
maps) are probed once: every other one is predicted from the first and checked
by probing a few of its tensors of small parameters, one per kind of weight
loader (a mismatch probes it whole). Inside a probed layer, experts are placed
once per kind of expert tensor: the first two and the last are probed, the
others predicted at the step between the first two, the last checking it.
Post-load transforms that vLLM applies to the loaded weights are either
replayed on probes or refused naming the layer
(:mod:`rollout.engines.vllm.placement.repack`); experts moved alike by a per-expert
repacking are moved element by element once per kind and shifted by whole
blocks. Vocabulary tensors that ``load_weights`` hands untouched to vLLM's stock
embedding loader are placed by that loader's rule, not probed
(:mod:`rollout.engines.vllm.placement.vocab`). A parameter kept in another dtype than its
checkpoint tensor's (a ``float32`` router, a ``float32`` checkpoint served in ``bfloat16``) is
placed with the conversion recorded (``Placement.cast``) when it is a float conversion
``Tensor.copy_`` makes, else refused naming the tensor (:mod:`rollout.engines.vllm.placement.casts`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from p2psync.state import TensorSpec
from rollout.engines.vllm.placement import cache
from rollout.engines.vllm.placement.rules import LayoutError
from rollout.engines.vllm.placement.boxes import Family, Placement, compress, compress_runs, expand_runs, same
from rollout.engines.vllm.placement.readback import PASS_IDS, ComputedValues, Readback, Runs
from rollout.engines.vllm.placement.repack import expert_block, layer_of, moe_experts, post_load, repacked, transformed_reason
from rollout.engines.vllm.placement.vocab import guard, vocab_rows

logger = logging.getLogger(__name__)

_NUM = re.compile(r"\.(\d+)\.")
LAST_DERIVE_S: float | None = None
"""Seconds the last :func:`derive` in this process took (benchmarks read it)."""


def _layer_key(name: str) -> int | None:
    m = _NUM.search("." + name)
    return int(m.group(1)) if m else None


def derive(model: Any, specs: Sequence[TensorSpec], rules: bool = True) -> dict[str, Placement]:
    """Where each checkpoint tensor of ``specs`` lives in ``model`` on this rank (see module doc).

    Layers alike (the same checkpoint names, shapes and dtypes up to the layer number, the same
    parameters, module classes and weight loaders) are placed alike: the first of them is probed
    whole, every other one is predicted from it and checked by probing its smaller tensors (a
    mismatch probes that layer whole). With ``rules``, vocabulary tensors handed untouched to
    vLLM's own embedding loader are placed by its rule instead of probed
    (:func:`rollout.engines.vllm.placement.vocab.vocab_rows`). Tensors this rank holds nothing of are absent
    from the result. Raises :class:`LayoutError` naming the tensor when vLLM's loader refuses it or
    writes computed (not copied) values."""
    import torch

    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    out: dict[str, Placement] = vocab_rows(model, params, specs) if rules else {}
    ruled = {pl.param for pl in out.values()}
    batches: dict[int | None, list[TensorSpec]] = {}
    for s in specs:
        if s.name not in out:
            batches.setdefault(_layer_key(s.name), []).append(s)
    owners: dict[int | None, list[str]] = {}
    for n in params:
        if n not in ruled:
            owners.setdefault(_layer_key(n), []).append(n)
    templates: dict[tuple[Any, ...], tuple[int | None, dict[str, Placement]]] = {}
    reused = 0
    with torch.no_grad():
        for key, batch in batches.items():
            own = owners.get(key, [])
            sig = _signature(model, params, batch, own, key) if key is not None else None
            got = None
            if key is not None and sig is not None and sig in templates:
                got = _reuse(model, params, batch, key, *templates[sig])
                reused += got is not None
            if got is None:
                got = _place_layer(model, params, batch, own)
                if sig is not None and sig not in templates:
                    templates[sig] = (key, got)
            out.update(got)
    record_casts(specs, params, out)
    global LAST_DERIVE_S
    LAST_DERIVE_S = time.perf_counter() - t0
    logger.info("p2psync: placement of %d tensors derived from vLLM's loaders in %.2f s (%d of %d layers "
                "predicted from a layer alike, %d vocabulary tensors by the embedding loader's rule)",
                len(out), LAST_DERIVE_S, reused, len(batches), len(ruled))
    return out


def _place(model: Any, params: dict[str, Any], batch: list[TensorSpec], probed: list[str]
           ) -> dict[str, Placement]:
    """The placements of ``batch``, probed with ``probed`` as probes (every parameter when the loader
    writes outside them)."""
    try:
        got = _probe(model, params, batch, probed)
    except _Outside:
        got = _probe(model, params, batch, list(params))
    out: dict[str, Placement] = {}
    moved: dict[tuple[Any, ...], Placement] = {}
    for s in batch:
        if s.name not in got:
            continue
        param, (ck, dst, lengths) = got[s.name]
        if not repacked(model, param):
            out[s.name] = compress_runs(s.name, param, tuple(s.shape), ck, dst, lengths)
            continue
        # An expert's elements moved by the layer's repacking: when they lie in one expert's block
        # and the repacking is alike per expert, the first of its kind is moved element by element
        # and the others are that placement shifted by whole blocks.
        block = expert_block(model, param) or 0
        base = int(dst.min()) // block * block if block else 0
        inside = bool(block) and int((dst + lengths).max()) <= base + block
        key = (param, tuple(s.shape), ck.tobytes(), (dst - base).tobytes(), lengths.tobytes())
        if inside and key in moved:
            out[s.name] = _shifted(moved[key], s.name, base)
            continue
        eck, edst = expand_runs(ck, dst - base, lengths)
        pl = compress(s.name, param, tuple(s.shape), eck, post_load(model, param, params[param], edst),
                      ck_sorted=True)
        if inside:
            moved[key] = pl
        out[s.name] = _shifted(pl, s.name, base) if base else pl
    return out


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _place_layer(model: Any, params: dict[str, Any], batch: list[TensorSpec], own: list[str]
                 ) -> dict[str, Placement]:
    """:func:`_place` of a layer, its experts placed once per tensor kind: of each kind (the same
    name but for the expert number, and shape; four or more experts) only the first two and the
    last experts are probed; the others are predicted by the step between the first two, and the
    last one checks the prediction (a mismatch, or a sampled expert this rank does not hold, probes
    the layer whole)."""
    groups: dict[tuple[str, tuple[int, ...]], list[tuple[int, TensorSpec]]] = {}
    for s in batch:
        m = _EXPERT.search(s.name)
        if m:
            kind = (s.name[:m.start()] + ".experts.*." + s.name[m.end():], tuple(s.shape))
            groups.setdefault(kind, []).append((int(m.group(1)), s))
    groups = {k: sorted(v, key=lambda x: x[0]) for k, v in groups.items() if len(v) >= 4}
    if not groups:
        return _place(model, params, batch, own)
    grouped = {s.name for v in groups.values() for _, s in v}
    sampled = {v[i][1].name for v in groups.values() for i in (0, 1, len(v) - 1)}
    got = _place(model, params, [s for s in batch if s.name not in grouped or s.name in sampled], own)
    for v in groups.values():
        (ea, sa), (eb, sb), (ec, sc) = v[0], v[1], v[-1]
        pa, pb, pc = got.get(sa.name), got.get(sb.name), got.get(sc.name)
        step = _expert_step(pa, pb, eb - ea)
        if pa is None or pc is None or step is None or not same(_shifted(pa, sc.name, (ec - ea) * step), pc):
            logger.info("p2psync: the experts of %s are not placed at a fixed step: probed whole", sa.name)
            return _place(model, params, batch, own)
        for e, s in v:
            got[s.name] = _shifted(pa, s.name, (e - ea) * step)
    return got


def _expert_step(pa: Placement | None, pb: Placement | None, apart: int) -> int | None:
    """The parameter offset from one expert to the next, if ``pb`` is ``pa`` shifted by ``apart`` of them."""
    if pa is None or pb is None or pa.param != pb.param or len(pa.families) != len(pb.families):
        return None
    shift = None
    for f, g in zip(pa.families, pb.families):
        if f.dims != g.dims or not np.array_equal(f.ck, g.ck) or f.dst.shape[0] == 0:
            return None
        d = g.dst - f.dst
        if not (d == d[0]).all() or (shift is not None and int(d[0]) != shift):
            return None
        shift = int(d[0])
    if shift is None or shift % apart:
        return None
    return shift // apart


def _shifted(pl: Placement, name: str, delta: int) -> Placement:
    return Placement(name, pl.param, pl.shape, [Family(f.dims, f.ck, f.dst + delta) for f in pl.families], pl.counted,
                     pl.cast)


def _norm(name: str, key: int | None) -> str:
    """``name`` with its layer number (the first ``.N.``) replaced by ``#``."""
    return name if key is None else _NUM.sub(".#.", "." + name, count=1)[1:]


def _renamed(name: str, key: int) -> str:
    return _NUM.sub(f".{key}.", "." + name.replace(".#.", ".\0."), count=0)[1:] if False else \
        ("." + name).replace(".#.", f".{key}.", 1)[1:]


def _loader_id(p: Any) -> str:
    fn = getattr(p, "weight_loader", None)
    fn = getattr(fn, "__func__", fn)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _signature(model: Any, params: dict[str, Any], batch: list[TensorSpec], own: list[str], key: int
               ) -> tuple[Any, ...] | None:
    """What a layer's placement depends on, up to its layer number (None: not comparable)."""
    parts: list[Any] = [tuple((_norm(s.name, key), tuple(s.shape), s.dtype) for s in batch)]
    for n in own:
        p = params[n]
        _, layer = layer_of(model, n)
        extra: Any = None
        emap = getattr(layer, "expert_map", None) if layer is not None else None
        if emap is not None:
            extra = tuple(emap.reshape(-1).tolist())
        fe = moe_experts(layer)
        parts.append((_norm(n, key), tuple(p.shape), str(p.dtype), type(p).__name__, _loader_id(p),
                      type(layer).__name__, type(fe).__name__ if fe is not None else None, extra,
                      type(getattr(layer, "quant_method", None)).__name__))
    return tuple(parts)


_CHECK_ELEMENTS = 1 << 20
"""A predicted layer is checked by probing its tensors whose parameter is at most this large."""


def _reuse(model: Any, params: dict[str, Any], batch: list[TensorSpec], key: int, tkey: int | None,
           template: dict[str, Placement]) -> dict[str, Placement] | None:
    """``batch``'s placements predicted from the layer alike ``template`` (layer ``tkey``), checked by
    probing its tensors of small parameters; None when the check fails (the caller probes it whole)."""
    assert tkey is not None
    pred: dict[str, Placement] = {}
    for s in batch:
        t = template.get(_renamed(_norm(s.name, key), tkey))
        if t is not None:
            pred[s.name] = replace(t, name=s.name, param=_renamed(_norm(t.param, tkey), key))
    if any(pl.param not in params for pl in pred.values()):
        return None
    small = sorted((s for s in batch if s.name in pred and params[pred[s.name].param].numel() <= _CHECK_ELEMENTS),
                   key=lambda s: params[pred[s.name].param].numel())
    check: list[TensorSpec] = []
    seen: set[str] = set()
    for first in (True, False):  # one tensor per kind of weight loader first, then others up to 4
        loaders = {_loader_id(params[pred[s.name].param]) for s in check}
        for s in small:
            param = pred[s.name].param
            if len(check) < 4 and param not in seen and (not first or _loader_id(params[param]) not in loaders):
                seen.add(param)
                loaders.add(_loader_id(params[param]))
                check.append(s)
    if not check:
        return None
    try:
        got = _place(model, params, check, sorted({pred[s.name].param for s in check}))
    except LayoutError:
        return None
    if sorted(got) != sorted(s.name for s in check) or any(not same(got[s.name], pred[s.name]) for s in check):
        logger.info("p2psync: layer %s is not placed as layer %s, alike in shapes: probed whole", key, tkey)
        return None
    return pred


def record_casts(specs: Sequence[TensorSpec], params: dict[str, Any], places: dict[str, Placement]) -> None:
    """Set each placement's ``cast`` where its parameter's dtype is not the checkpoint tensor's: the
    probe's ids landed there as copies (a computed value is refused by the readback), so vLLM's load
    is a dtype conversion of the copy; raises :class:`LayoutError` naming the tensor for a pair of
    dtypes that is not placed (:func:`rollout.engines.vllm.placement.casts.cast_for`)."""
    from p2psync import dtypes
    from rollout.engines.vllm.placement.casts import cast_for, dtype_name

    for s in specs:
        pl = places.get(s.name)
        if pl is None:
            continue
        cast = cast_for(s.name, dtypes.from_code(s.dtype).torch_dtype(), params[pl.param].dtype)
        pl.cast = None if cast is None else dtype_name(params[pl.param].dtype)


class _Outside(Exception):
    """The loader wrote outside the batch's parameters (into a guard)."""


def _probe(model: Any, params: dict[str, Any], batch: list[TensorSpec], probed: list[str]
           ) -> dict[str, tuple[str, Runs]]:
    """:func:`_probe_once`; where a loader computes values, the batch's tensors are probed one at a
    time to name the one it computes from (the word read back names it only when it is an id)."""
    try:
        return _probe_once(model, params, batch, probed)
    except ComputedValues:
        if len(batch) > 1:
            for s in batch:
                _probe_once(model, params, [s], probed)
        raise


def _probe_once(model: Any, params: dict[str, Any], batch: list[TensorSpec], probed: list[str]
                ) -> dict[str, tuple[str, Runs]]:
    """Feed ``batch`` through ``model.load_weights`` with ``probed`` parameters as probes (module doc);
    per tensor held: its parameter and its elements' runs in it as loaded.

    Ids are ``float32``, exact up to 2**24: a batch of more elements is fed in passes of 2**24 ids
    (the tensors holding them; every other element of a tensor fed is 0), each probe read back and
    zeroed again after each pass. Halving the words a ``float64`` id costs matters most in the first
    derive of a process, which pays a page fault for each new page of ids and probes."""
    import torch

    live = {n: p.data for n, p in params.items()}
    probes: dict[str, Any] = {}
    bases = np.zeros(len(batch) + 1, dtype=np.int64)
    for i, s in enumerate(batch):
        bases[i + 1] = bases[i] + s.numel
    total = int(bases[-1])
    wanted = set(probed)
    ids = torch.from_numpy(np.zeros(total, dtype=np.float32))

    def feed(items: list[tuple[int, TensorSpec]]) -> None:
        model.load_weights((s.name, ids[int(bases[i]):int(bases[i + 1])].reshape(tuple(s.shape))) for i, s in items)

    try:
        for n, p in params.items():
            if n in wanted:
                probes[n] = _zeros(tuple(p.shape), p.device)
                p.data = probes[n]
            else:
                p.data = guard(p)
        names = list(probes)
        back = Readback(batch, bases, names)
        for lo in range(0, total, PASS_IDS):
            hi = min(lo + PASS_IDS, total)
            if lo:
                ids[lo - PASS_IDS:lo].zero_()
            torch.arange(1, hi - lo + 1, dtype=torch.float32, out=ids[lo:hi])
            items = [(i, s) for i, s in enumerate(batch) if bases[i] < hi and bases[i + 1] > lo]
            try:
                feed(items)
            except Exception as exc:
                if _guard_error(exc) and len(wanted) < len(params):
                    raise _Outside() from exc
                _name_culprit(feed, items, params, exc)
            held = back.read([np.ascontiguousarray(probes[n].reshape(-1).cpu().numpy()) for n in names], lo, hi - lo)
            if hi < total:
                for n, h in zip(names, held):
                    if h:
                        probes[n].zero_()
    finally:
        for n, p in params.items():
            p.data = live[n]
    return back.placed()


def _zeros(shape: tuple[int, ...], device: Any) -> Any:
    """A ``float32`` zero tensor; on the CPU from numpy's calloc, whose pages the kernel maps on first
    write, so a probe of a stacked expert parameter costs the pages the loader writes, not the whole
    parameter."""
    import torch

    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=np.float32))


def _guard_error(exc: BaseException) -> bool:
    text = str(exc)
    return "single memory location" in text or "refer to a single memory" in text


def _name_culprit(feed: Any, items: list[tuple[int, TensorSpec]], params: dict[str, Any], exc: Exception) -> None:
    """Raise :class:`LayoutError` naming the first tensor of ``items`` the loader fails on alone."""
    for i, s in items:
        try:
            feed([(i, s)])
        except Exception as one:
            if _guard_error(one):
                continue
            empty = sorted(n for n, p in params.items() if p.numel() == 0 and _layer_key(n) == _layer_key(s.name))
            hint = f" (size-0 parameters, repacked at load: {empty})" if empty else ""
            raise LayoutError(f"{s.name}: vLLM's loader cannot place it: {type(one).__name__}: {one}{hint}") from one
    raise LayoutError(f"{items[0][1].name}...: vLLM's loader failed on the layer's tensors together: "
                      f"{type(exc).__name__}: {exc}") from exc


# --- the placements LiveWeights binds ------------------------------------------------------
_CACHE: dict[tuple[int, int, str, int], dict[str, Placement]] = {}


def placements(model: Any, specs: Sequence[TensorSpec], params: dict[str, Any], group: Any) -> dict[str, Placement]:
    """Where this rank holds each tensor of ``specs`` (absent: nowhere), with ``counted`` set so that
    every element counts on exactly one rank (a copy held by several ranks counts on the lowest).

    A vLLM model: derived from its loaders (:func:`derive`; kept per model, rank, table and
    parameter storage in this process, and on disk across restarts by
    :mod:`rollout.engines.vllm.placement.cache`) and checked for transformed copies. Any other module
    (tests' stand-ins): the hand rules of :func:`rollout.engines.vllm.placement.rules.place`."""
    import hashlib

    from p2psync.errors import TensorTableMismatch
    from p2psync.state import table_hash
    from rollout.engines.vllm.placement.rules import check_piece, place
    from rollout.engines.vllm.placement.boxes import from_piece

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
        record_casts(specs, params, out)
        return out
    layout = hash(tuple((n, p.data_ptr(), tuple(p.shape)) for n, p in params.items()))
    key = (id(model), group.rank, table_hash(list(specs)), layout)
    if key not in _CACHE:
        disk = cache.cache_key(model, key[2], params, group.rank, group.size)
        derived = cache.load(disk, specs)
        if derived is None:
            derived = derive(model, specs)
            cache.save(disk, derived)
        else:
            logger.info("p2psync: placement of %d tensors read from the placement cache (%s)", len(derived), disk)
            record_casts(specs, params, derived)
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
