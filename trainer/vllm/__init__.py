"""The trainer side of the vLLM integration: p2psync as vLLM's trainer-side weight-transfer engine.

- :mod:`.info`: :class:`P2PSyncTrainerInitInfo` (``backend = "p2psync"``), what a trainer passes
  ``WeightTransferTrainerFactory.trainer_init``, and its typed refusals.
- :mod:`.engine`: :class:`~trainer.vllm.engine.P2PSyncTrainerEngine`: runs the trainer node,
  publishes each version from the ``WeightSource`` and drives vLLM's workers through the client.
- :mod:`.source`: from a ``WeightSource`` to what the publisher reads, per trainer rank.
- :mod:`.plugin`: registers the engine with vLLM (entry point ``p2psync-trainer``; importing this
  package registers it too).

Imports vLLM (its trainer-side base classes); the rest of ``trainer`` does not.
"""

from trainer.vllm.info import InitInfoError, P2PSyncTrainerInitInfo
from trainer.vllm.plugin import register

register()

__all__ = ["InitInfoError", "P2PSyncTrainerInitInfo", "register"]
