"""TRL integration: publish a ``GRPOTrainer``'s weights after every optimizer step.

::

    from trainer.trl_callback import P2PSyncCallback
    cb = P2PSyncCallback(node_config)               # starts a trainer node beside the training loop
    GRPOTrainer(model=..., reward_funcs=..., args=..., callbacks=[cb]).train()

Version 0 (a snapshot) is published in ``on_train_begin``; each ``on_step_end``
(after the optimizer step) starts publishing the next version, which is encoded
and handed to the node while the next step runs (see :mod:`trainer.publisher`).
``on_train_end`` waits for the last version. Under ``torch.distributed`` (FSDP2
through accelerate) every rank runs the callback; only rank 0 starts a node.
Needs the ``trl`` extra (``pip install p2psync[trl]``); this module imports only
``transformers`` itself.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from p2psync.config import NodeConfig

logger = logging.getLogger(__name__)


class P2PSyncCallback(TrainerCallback):
    """Publishes after each optimizer step. ``node_config``: the trainer node to run (rank 0).

    ``publisher_options`` go to :class:`~trainer.publisher.Publisher` (``dtype``, ``bucket_bytes``, ...).
    """

    def __init__(self, node_config: NodeConfig | None, **publisher_options: Any) -> None:
        self.node_config = node_config
        self.options = publisher_options
        self.background: Any = None
        self.publisher: Any = None

    @property
    def node(self) -> Any:
        return self.background.node if self.background is not None else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001 - TRL's signature
        from trainer.background import BackgroundNode
        from trainer.publisher import Publisher

        if model is None:
            raise ValueError("model: the trainer passed no model to the callback")
        rank = getattr(args, "process_index", 0)
        if rank == 0:
            if self.node_config is None:
                raise ValueError("node_config: rank 0 needs the trainer node's config")
            self.background = BackgroundNode(self.node_config).start()
            self.publisher = Publisher(model, self.background.node, loop=self.background.loop, **self.options)
        else:
            self.publisher = Publisher(model, None, **self.options)
        self.publisher.start_sync()
        logger.info("p2psync: published version %s before training", self.publisher.version)

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.publisher is not None:
            self.publisher.publish_sync()

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        try:
            if self.publisher is not None:
                self.publisher.close_sync()
        finally:
            self.close_node()

    def close_node(self) -> None:
        """Stop the node (after training; followers then stop getting new versions)."""
        if self.background is not None:
            self.background.stop()
            self.background = None
