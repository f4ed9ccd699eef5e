"""Getting a vLLM worker ready, when vLLM builds the backend, to apply its first update at full speed.

A fresh worker otherwise loads the codec's compiled kernels (1-4 s, more on a
loaded machine; :mod:`p2psync.codec.precompile`) and imports the fetch path
(HTTP client, signatures) inside its first update. :func:`start` does both in a
daemon thread while the engine starts and serves: the codec's own warm-up for
the model's word types, then :func:`exercise`, which applies a small delta
through :class:`~rollout.engines.vllm.apply.weights.LiveWeights` on parameters of its
own, one stored as the checkpoint is and one transposed (the host-memory and
the device-copy paths), so that every kernel of the apply, with the array types
the apply passes, is ready, and compiles the placement probe's loops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


def model_codes(model: Any) -> tuple[str, ...]:
    """The codec's codes of the word types of ``model``'s parameters (those it supports)."""
    from p2psync import dtypes
    from p2psync.errors import CodecError

    codes = set()
    for dt in {p.dtype for p in model.parameters()}:
        try:
            codes.add(dtypes.from_torch(dt).code)
        except CodecError:
            pass
    return tuple(sorted(codes))


def exercise(codes: Iterable[str]) -> None:
    """Apply a small delta and its inverse to a parameter of each word type in ``codes``."""
    import numpy as np
    import torch

    from p2psync import dtypes, keys
    from p2psync.artifact import build_manifest
    from p2psync.codec import context
    from p2psync.codec.encode import CodecOptions, encode_delta
    from p2psync.state import ModelState
    from p2psync.transport import client  # noqa: F401 - the fetch path's imports
    from rollout.engines.vllm.placement import kernels as probe_kernels
    from rollout.engines.vllm.placement.boxes import compress
    from rollout.engines.vllm.apply.weights import LiveWeights

    probe_kernels.warm()  # the placement probe's loops (an engine derives its placement at bind)
    priv = keys.generate()
    opts = CodecOptions(chunk_size=64 << 10, threads=1, segment_elements=4096, zstd_level=1)
    for code in codes:
        d = dtypes.from_code(code)
        g = torch.Generator().manual_seed(0)
        module = torch.nn.Module()
        param = torch.nn.Parameter(torch.randn(64, 128, generator=g).to(d.torch_dtype()), requires_grad=False)
        module.register_parameter("w", param)
        # "t" is held transposed (a strided block: read through a view, written by the mapped pass)
        module.register_parameter("t", torch.nn.Parameter(param.detach().t().contiguous(), requires_grad=False))
        old = ModelState([("w", param.detach().clone()), ("t", param.detach().clone())])
        new = old.clone()
        for name in ("w", "t"):
            w = new.words(name)
            key = w & d.word.type(context.key_mask(d))
            idx = np.arange(w.shape[0])
            w[(key < np.median(key)) & (idx % 2 == 0)] += d.word.type(1)
            w[idx % 61 == 0] += d.word.type(40)
        new.invalidate()
        ck = np.arange(64 * 128, dtype=np.int64)
        places = {"w": compress("w", "w", (64, 128), ck, ck),
                  "t": compress("t", "t", (64, 128), ck, (ck % 128) * 64 + ck // 128)}
        live = LiveWeights(module, old.specs, threads=2, places=places)
        for host, (a, b, base, target) in zip((True, False), ((old, new, 0, 1), (new, old, 1, 2))):
            enc = encode_delta(a, b, opts)
            m = build_manifest(enc, model_id="warm", base_version=base, target_version=target,
                               chunk_size=opts.chunk_size, private_key=priv)
            live.host_memory = host  # False: the path of a model on a device (host copies per segment)
            live.apply_delta(m, enc.chunks)


_started: threading.Thread | None = None


def start(model: Any, cpus: set[int] | None = None) -> threading.Thread:
    """Warm the codec and :func:`exercise` the apply in a daemon thread (once per process), on
    ``cpus`` if given: the cores the worker's own thread does not run on, so that the warm-up does
    not slow the engine's start or the placement derived at bind on that thread."""
    global _started
    if _started is None:
        from p2psync.codec import precompile

        codes = model_codes(model)
        _started = precompile.start(codes, extra=lambda: exercise(codes), cpus=cpus)
    return _started


def pending() -> bool:
    """Whether the warm-up of :func:`start` is still running."""
    return _started is not None and _started.is_alive()
