"""Vocabulary tensors placed by the rule of vLLM's embedding loader, checked through the model's own
``load_weights`` at no memory (:func:`vocab_rows`).

:func:`rollout.engines.vllm.placement.probe.derive` learns placements by feeding element ids
through the loaders into probes of each parameter's size. For the vocabulary
(embedding and untied head, the largest tensors of most models) that costs a
vocabulary-sized probe and ids, on a GPU engine in device memory, for what the
stock ``VocabParallelEmbedding.weight_loader`` does by a fixed rule: this rank's
rows of the vocabulary at the parameter's first rows. The rule is used only where
``load_weights`` is seen to hand the tensor to that loader untouched; a test on
real vLLM modules shows it agrees with the probe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from p2psync.state import TensorSpec
from rollout.engines.vllm.placement.boxes import Placement, compress_runs

logger = logging.getLogger(__name__)


def vocab_rows(model: Any, params: dict[str, Any], specs: Sequence[TensorSpec]) -> dict[str, Placement]:
    """The placements of the vocabulary tensors that ``model.load_weights`` hands untouched to the
    stock loader of vLLM's ``VocabParallelEmbedding`` (``ParallelLMHead`` too), by that loader's rule:
    this rank's vocabulary rows ``[org_vocab_start_index, org_vocab_end_index)`` at the parameter's
    first rows (the padding rows after them zeroed).

    Probing such a tensor costs a vocabulary-sized probe and ids (on a GPU engine, device memory) for
    a placement the loader's rule gives. That the rule applies is checked through
    ``load_weights`` itself, at no memory: each candidate is fed as a zero-stride tensor with every
    parameter a guard that raises on a write, and its ``weight_loader`` swapped for a recorder, which
    must be called once, for that parameter, with the very tensor fed (not renamed, converted or
    computed from it, e.g. a normalised head). Anything else (a write, an error, another call)
    leaves the tensor to the probe, which places or refuses it."""
    import torch

    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )
    except ImportError:
        return {}
    rows: dict[str, tuple[int, int]] = {}
    for s in specs:
        if s.name not in params or "." not in s.name or "weight_loader" not in vars(params[s.name]):
            continue
        param: Any = params[s.name]
        layer: Any = model.get_submodule(s.name.rsplit(".", 1)[0])
        fn = getattr(param.weight_loader, "__func__", None)
        si = getattr(layer, "shard_indices", None)
        embedding = isinstance(layer, VocabParallelEmbedding)
        if not (embedding and layer.weight is param and si is not None
                and fn is VocabParallelEmbedding.weight_loader
                and type(getattr(layer, "quant_method", None)) is UnquantizedEmbeddingMethod
                and getattr(param, "output_dim", None) == 0 and getattr(param, "packed_dim", None) is None
                and si.num_added_elements == 0 and param.dim() == 2
                and tuple(s.shape) == (int(layer.org_vocab_size), int(param.shape[1]))):
            continue
        start, stop = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
        if 0 <= start <= stop <= int(param.shape[0]):
            rows[s.name] = (start, stop)
    if not rows:
        return {}
    shapes = {s.name: tuple(s.shape) for s in specs if s.name in rows}
    fed = {n: torch.zeros((1, 1), dtype=params[n].dtype, device=params[n].device).expand(shapes[n]) for n in rows}
    calls: dict[str, list[tuple[Any, Any, Any]]] = {n: [] for n in rows}
    live = {n: p.data for n, p in params.items()}
    loaders = {n: params[n].weight_loader for n in rows}

    def recorder(name: str) -> Any:
        return lambda param, weight, *more, **kw: calls[name].append((param, weight, (more, kw)))

    try:
        for n, p in params.items():
            p.data = guard(p)
        for n in rows:
            params[n].weight_loader = recorder(n)
        model.load_weights(iter(fed.items()))
    except Exception as exc:  # the rule's check failed: probe them
        logger.info("p2psync: the vocabulary tensors are probed (vLLM's load_weights did more than hand them to "
                    "the embedding loader: %s: %s)", type(exc).__name__, exc)
        return {}
    finally:
        for n, p in params.items():
            p.data = live[n]
        for n, fn in loaders.items():
            params[n].weight_loader = fn
    out: dict[str, Placement] = {}
    for n, (start, stop) in rows.items():
        got, f = calls[n], fed[n]
        w = got[0][1] if len(got) == 1 else None
        if (w is None or got[0][0] is not params[n] or got[0][2] != ((), {}) or w.data_ptr() != f.data_ptr()
                or w.shape != f.shape or w.stride() != f.stride() or w.dtype != f.dtype):
            continue
        if stop > start:  # rows [start, stop) of the checkpoint: one run at the parameter's start
            width = int(params[n].shape[1])
            out[n] = compress_runs(n, n, shapes[n], np.array([start * width]), np.zeros(1, np.int64),
                                   np.array([(stop - start) * width]))
    return out


def guard(p: Any) -> Any:
    """A stand-in for ``p.data`` that costs no memory and raises on any write (one element, expanded)."""
    import torch

    return torch.zeros((1,) * max(1, p.dim()), dtype=torch.float32,
                       device=p.device).reshape((1,) * p.dim()).expand(tuple(p.shape))
