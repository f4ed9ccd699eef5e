"""verl's checkpoint engine ``p2psync`` (verl is an optional extra: ``pip install p2psync[verl]``).

Importing this package registers the engine in verl's ``CheckpointEngineRegistry``; a verl run
selects it with ``actor_rollout_ref.rollout.checkpoint_engine.backend=p2psync`` and
``custom_backend_module=trainer.verl`` (docs/INTEGRATIONS.md, "verl"). The trainer side
(:mod:`trainer.verl.engine`) publishes what verl's ``send_weights`` streams; the rollout side
(:mod:`rollout.verl`) has the vLLM engine verl launched pull it through p2psync's worker backend.
"""

from trainer.verl.engine import BACKEND, P2PSyncCheckpointEngine

__all__ = ["BACKEND", "P2PSyncCheckpointEngine"]
