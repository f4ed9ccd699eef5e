"""Gossip control plane: membership, failure detection and coordinator state (sans-IO).

:class:`~p2psync.gossip.protocol.GossipNode` is the state machine a node drives;
:mod:`p2psync.gossip.messages` holds its wire messages; :mod:`p2psync.gossip.sim`
drives many nodes in one process for tests and scale figures.
"""

from p2psync.errors import NotCoordinator
from p2psync.gossip.coordinator_state import CoordinatorState
from p2psync.gossip.membership import DetectorConfig, MemberTable
from p2psync.gossip.messages import MemberEntry
from p2psync.gossip.protocol import GossipConfig, GossipNode

__all__ = ["CoordinatorState", "DetectorConfig", "GossipConfig", "GossipNode", "MemberEntry", "MemberTable",
           "NotCoordinator"]
