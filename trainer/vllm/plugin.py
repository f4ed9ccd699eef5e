"""vLLM plugin entry point of the trainer side (``vllm.general_plugins``: ``p2psync-trainer =
trainer.vllm.plugin:register``).

Registers :class:`trainer.vllm.engine.P2PSyncTrainerEngine` in vLLM's ``WeightTransferTrainerFactory``
under ``p2psync`` (imported only when chosen). vLLM runs every general plugin in each of its
processes; importing :mod:`trainer.vllm` (where the init info lives) registers it too, so a
trainer process that never loads vLLM's plugins finds the backend as soon as it builds the init
info. Registering again is harmless. The worker side registers itself the same way
(``rollout.engines.vllm.plugin``); neither names the other.
"""

from __future__ import annotations

ENGINE = ("trainer.vllm.engine", "P2PSyncTrainerEngine")
"""Module and class of the trainer engine, for vLLM's lazy registry."""


def register() -> None:
    """Register the ``p2psync`` trainer engine with vLLM (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from trainer.vllm.info import BACKEND

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, *ENGINE)
