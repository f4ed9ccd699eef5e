"""How often and how widely a node gossips (:class:`GossipConfig`): the rounds, the message bounds,
the report budget and the failure detector's settings a :class:`~p2psync.gossip.protocol.GossipNode`
runs with."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2psync.gossip.membership import DetectorConfig


@dataclass(frozen=True)
class GossipConfig:
    """How often and how widely a node gossips."""

    interval: float = 1.0
    """Seconds between rounds."""
    fanout: int = 2
    """Peers a round opens an exchange with."""
    max_entries: int = 256
    """Entries per Delta at most (a full member entry is ~200 bytes of JSON)."""
    max_digest_items: int = 512
    """Keys and versions per Digest at most."""
    max_message_bytes: int = 60_000
    """JSON bytes per Delta or Digest at most (estimated per item): a node's server refuses a
    gossip body over ``limits.max_body_bytes`` (64 KiB by default)."""
    reconnect_interval: float = 5.0
    """With as many members dead as alive, each node calls a dead one about this often (see
    :mod:`p2psync.gossip.protocol`)."""
    metrics_interval: float = 30.0
    """Throughput/bandwidth are reported at most this often unless they move by 25 %."""
    report_interval: float = 10.0
    """A member re-sends its report to the coordinator at least this often (a lost report heals)."""
    report_budget: float = 200.0
    """Reports a second the coordinator takes from all members together, on average (0: unbounded).
    Each report is an HTTP request there (0.4 ms of a core over a kept mutual-TLS connection, 1.9 ms with
    a handshake, ``tools/coord_http.py``: 200 a second take at most 0.4 of a core), so
    with ``live`` members each spaces its reports at least ``live / report_budget`` seconds apart,
    changes included, with a random phase: 50 s at 10,000 members, 500 s at 100,000 (see
    :mod:`p2psync.gossip.protocol`)."""
    rejoin_interval: float = 10.0
    """Seconds between Syns to a seed that is not a live member here (see :mod:`p2psync.gossip.protocol`)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError("interval must be > 0")
        if not self.report_interval > 0 or not self.rejoin_interval > 0:
            raise ValueError("report_interval and rejoin_interval must be > 0")
        if not self.report_budget >= 0:
            raise ValueError("report_budget must be >= 0")
        if self.fanout < 1 or self.max_entries < 1 or self.max_digest_items < 1:
            raise ValueError("fanout, max_entries and max_digest_items must be >= 1")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be >= 1024")
        if not self.reconnect_interval > 0:
            raise ValueError("reconnect_interval must be > 0")
