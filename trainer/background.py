"""A trainer node on its own event-loop thread, for plain (synchronous) training loops.

::

    with BackgroundNode(config) as bg:
        pub = bg.publisher(model)          # version 0 published when this returns
        for batch in data:
            ...; opt.step()
            pub.publish_sync()
        pub.close_sync()

The node serves followers from its thread while the training loop runs in the
caller's; :class:`trainer.publisher.Publisher` hands each artifact to the node
on that loop. Used by the TRL callback (:mod:`trainer.trl_callback`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from p2psync.config import NodeConfig


class BackgroundNode:
    """Owns one event-loop thread and the :class:`~p2psync.node.Node` running on it."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.node: Any = None
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"node-{config.id}", daemon=True)

    def start(self) -> BackgroundNode:
        from p2psync.node import Node

        self._thread.start()
        self.node = self.call(Node.create(self.config))
        self.call(self.node.loaded.wait())
        return self

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the node's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def publisher(self, model: Any, **kwargs: Any) -> Any:
        """A started :class:`~trainer.publisher.Publisher` for ``model`` (version 0 published)."""
        from trainer.publisher import Publisher

        pub = Publisher(model, self.node, loop=self.loop, **kwargs)
        try:
            pub.start_sync()
        except BaseException:
            pub._shutdown()
            raise
        return pub

    def stop(self) -> None:
        if self.node is not None:
            self.call(self.node.close())
            self.node = None
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> BackgroundNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
