"""Gossip control plane: membership, failure detection and coordinator state (sans-IO).

:class:`~p2psync.gossip.protocol.GossipNode` is the state machine a node drives, with the settings
of :mod:`p2psync.gossip.config` and the exchange's answers (anti-entropy) in :mod:`p2psync.gossip.exchange`;
:mod:`p2psync.gossip.items` the table's items (members, coordinator entries) and
:mod:`p2psync.gossip.messages` the wire messages that carry them; :mod:`p2psync.gossip.sim`
drives many nodes in one process for tests and scale figures.
"""

from p2psync.errors import NotCoordinator
from p2psync.gossip.coordinator_state import CoordinatorState
from p2psync.gossip.items import MemberEntry
from p2psync.gossip.membership import DetectorConfig, MemberTable
from p2psync.gossip.config import GossipConfig
from p2psync.gossip.protocol import GossipNode

__all__ = ["CoordinatorState", "DetectorConfig", "GossipConfig", "GossipNode", "MemberEntry", "MemberTable",
           "NotCoordinator"]
