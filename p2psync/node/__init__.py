"""A p2psync peer: :class:`Node` (the facade, :mod:`.facade`) over its rooms.

- :mod:`.replica`: the weights and versions held, the all-or-nothing apply, housekeeping.
- :mod:`.follower`: parent choice, fetching, push, cut-through, snapshot rebuilds (relays, rollout nodes).
- :mod:`.origin`: publishing and signed snapshots (the trainer node).
- :mod:`.routes`: what the node shows over HTTP (catalogue, status).
- :mod:`.tasks`: the tasks the node owns.
"""

from p2psync.node.facade import Node

__all__ = ["Node"]
