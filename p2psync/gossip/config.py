"""How often and how widely a node gossips (:class:`GossipConfig`): the rounds, the message bounds,
the report budget and the failure detector's settings a :class:`~p2psync.gossip.protocol.GossipNode`
runs with."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2psync.gossip.items import MAX_ENTRY_BYTES, MAX_ITEMS
from p2psync.gossip.membership import DetectorConfig
from p2psync.gossip.messages import LEGACY_ACCEPT


@dataclass(frozen=True)
class GossipConfig:
    """How often and how widely a node gossips."""

    interval: float = 1.0
    """Seconds between rounds."""
    fanout: int = 2
    """Peers a round opens an exchange with."""
    max_entries: int = 4096
    """Entries per Delta at most (a member entry is ~180-250 bytes of JSON)."""
    max_digest_items: int = 512
    """Keys and versions per Digest at most (~25 bytes each) while two tables differ in at most half
    their buckets: under churn a few recent changes, each costing its bucket's keys (n / 64), so a
    larger digest would mostly list keys that match."""
    max_digest_items_far: int = 16384
    """Keys and versions per Digest at most when two tables differ in more than half their buckets:
    after a partition heals (nearly every entry differs) or a node's long absence."""
    coordinator_max_entries: int = 256
    """The coordinator's Deltas carry at most this many entries, and 64 KiB whatever the peer takes:
    it is every joiner's seed (a joiner's first Digest names only itself, so the answer is as much of
    the table as fits) and the root of the weight tree; a joiner gets the rest from other peers."""
    max_body_bytes: int = 1 << 20
    """The largest gossip message this node takes (its server's limit on ``/v1/gossip``), named as
    ``accept`` in the messages it expects an answer to. What it sends a peer is bounded by the
    smaller of this and the peer's ``accept`` (64 KiB for a peer that names none), less a sixteenth
    of headroom for the per-item size estimate. After a partition heals, every member refutes the
    ``dead`` entries the other side held about it, so each node relearns nearly the whole table:
    at 10,000 members ~2 MB, which takes a few exchanges of 1 MiB and dozens of 64 KiB."""
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
        if self.fanout < 1 or self.max_entries < 1 or self.max_digest_items < 1 or self.max_digest_items_far < 1:
            raise ValueError("fanout, max_entries, max_digest_items and max_digest_items_far must be >= 1")
        if self.coordinator_max_entries < 1:
            raise ValueError("coordinator_max_entries must be >= 1")
        if self.max_body_bytes < LEGACY_ACCEPT:
            raise ValueError(f"max_body_bytes must be >= {LEGACY_ACCEPT} (a coordinator entry may be "
                             f"{MAX_ENTRY_BYTES} bytes)")
        if max(self.max_digest_items, self.max_digest_items_far, self.max_entries) > MAX_ITEMS:
            raise ValueError(f"max_entries and the digest item caps must be <= {MAX_ITEMS} (what a message may carry)")

    def message_budget(self, accept: int) -> int:
        """JSON bytes a message to a peer that takes ``accept`` bytes (0: not said) may use."""
        peer = accept if accept > 0 else LEGACY_ACCEPT
        return min(self.max_body_bytes, peer) * 15 // 16
        if not self.reconnect_interval > 0:
            raise ValueError("reconnect_interval must be > 0")
