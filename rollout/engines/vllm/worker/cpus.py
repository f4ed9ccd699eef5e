"""The CPUs a vLLM worker's update may run on: its own, and those vLLM's thread binding leaves free.

On CPU, vLLM binds each worker's OpenMP threads to a list of cores
(``VLLM_CPU_OMP_THREADS_BIND``; ``auto``: one list per local rank, and a few
cores reserved for the engine core and front end), and the worker's main thread
is one of those threads: every thread it starts inherits that binding, so
without a change of affinity the apply's helper threads would all share the
worker's cores. An update runs on the worker's main thread between two model
steps: the worker's own OpenMP cores are idle then, and so are the cores that no
rank is bound to (the engine core waits for the update's reply). The cores of the
other local ranks are not: they apply the same update at the same time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def _parse(text: str) -> set[int]:
    """``"0-3,6"`` or ``"{0,1}"`` -> {0, 1, 2, 3, 6}."""
    out: set[int] = set()
    for part in text.strip().strip("{}").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _ranks_cpus(vllm_config: Any) -> list[set[int]]:
    """The core lists vLLM binds its local ranks to ([] if it binds none or they are unknown)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "nobind":
        return []
    if bind != "auto":
        return [_parse(s) for s in bind.split("|")]
    if vllm_config is None:
        return []
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        return [set(c) for c in OMPProcessManager(vllm_config).cpu_lists]
    except Exception as exc:  # noqa: BLE001 - unknown: then only this worker's own cores count
        logger.info("p2psync: vLLM's CPU binding is unknown (%r); the update uses this worker's cores", exc)
        return []


def own_cpus() -> set[int]:
    """The CPUs the calling thread may run on (empty where that is unknown)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()


def update_cpus(vllm_config: Any = None) -> set[int]:
    """The CPUs this worker's update may use (see module doc); never empty."""
    try:
        own = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
    try:
        allowed = os.sched_getaffinity(os.getppid()) | own
    except OSError:
        allowed = set(own)
    ranks = _ranks_cpus(vllm_config)
    if not ranks:
        return allowed if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind" else set(own)
    busy = set().union(*(c for c in ranks if not c <= own))  # the other ranks' cores
    return (allowed - busy) | own
