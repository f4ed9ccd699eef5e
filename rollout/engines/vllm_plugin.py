"""vLLM plugin entry point (``vllm.general_plugins`` = ``p2psync = rollout.engines.vllm_plugin:register``).

vLLM runs :func:`register` in each of its processes (front end, engine core,
workers) before a model loads. It registers the ``p2psync`` weight-transfer
backend (:mod:`rollout.engines.vllm_backend`, imported only when chosen) and, on
the CPU platform, turns off vLLM's oneDNN repacking of linear weights: repacked
layers keep a size-0 ``weight`` and compute with a private copy, so an in-place
update could not reach them. Plain weights cost some CPU throughput (measured
-8 % tokens/s on a tiny model, more on larger ones); set
``P2PSYNC_VLLM_KEEP_ONEDNN=1`` to keep repacking (the backend then refuses to
bind those layers, naming them). GPU platforms are not touched.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the ``p2psync`` backend (idempotent) and keep CPU linear weights writable."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "p2psync" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("p2psync", "rollout.engines.vllm_backend",
                                                    "P2PSyncWeightTransfer")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("P2PSYNC_VLLM_KEEP_ONEDNN", "") != "1":
        import vllm._custom_ops as ops

        ops._supports_onednn = False
