"""Functions vLLM's workers run through ``collective_rpc``: the p2psync backend's status, audit and words.

Module-level (``collective_rpc`` sends a function by reference and the worker
imports it); each finds the worker's :class:`~rollout.engines.vllm.worker.backend.P2PSyncWeightTransfer`.
"""

from __future__ import annotations

from typing import Any

from p2psync.errors import P2PSyncError
from rollout.engines.vllm.worker.backend import P2PSyncWeightTransfer


def backend(worker: Any) -> P2PSyncWeightTransfer:
    """The p2psync backend of the vLLM worker ``worker`` (a typed refusal if it has another)."""
    eng = getattr(worker, "weight_transfer_engine", None)
    if eng is None:
        eng = getattr(getattr(worker, "worker", None), "weight_transfer_engine", None)
    if not isinstance(eng, P2PSyncWeightTransfer):
        raise P2PSyncError(f"vLLM's weight-transfer backend is {type(eng).__name__}, not p2psync "
                           "(build the LLM with weight_transfer_config={'backend': 'p2psync'})")
    return eng


def rpc_status(worker: Any) -> dict[str, Any]:
    """:meth:`P2PSyncWeightTransfer.status` of the backend in this worker."""
    return backend(worker).status()


def rpc_audit(worker: Any) -> str | None:
    """The fingerprint recomputed from every live parameter word (None before the first update)."""
    return backend(worker).audit()


def rpc_read(worker: Any, names: list[str], live: bool = False) -> dict[str, bytes]:
    """Raw bytes of the checkpoint words of tensors ``names`` as held by the engine, or with ``live``
    of the parameter's words (converted where vLLM converts the tensor at load); tests and audits."""
    weights = backend(worker).live
    if weights is None:
        raise P2PSyncError("no weights bound yet (no update applied)")
    return {n: weights.read(n, live).tobytes() for n in names}


def rpc_read_held(worker: Any, names: list[str], live: bool = False) -> dict[str, tuple[bytes, bytes]]:
    """:func:`rpc_read` with the checkpoint positions this rank holds: ``name -> (positions as int64
    bytes, ascending; words there)``, so that the ranks' reads of a sharded tensor can be told apart."""
    import numpy as np

    weights = backend(worker).live
    if weights is None:
        raise P2PSyncError("no weights bound yet (no update applied)")
    out = {}
    for n in names:
        place = weights.places[[s.name for s in weights.specs].index(n)]
        pos = (np.empty(0, dtype=np.int64) if place is None
               else np.sort(np.concatenate([ck for ck, _ in place.chunks()])))
        out[n] = (pos.astype(np.int64).tobytes(), weights.read(n, live).tobytes())
    return out
