"""What publishing produces besides artifacts: :class:`PublishRecord` per version, :class:`PublishError` on failure."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from p2psync.errors import P2PSyncError


class PublishError(P2PSyncError):
    """Publishing a version failed in the background; ``version`` names it. Nothing later was published."""

    def __init__(self, version: int, cause: BaseException) -> None:
        super().__init__(f"publishing version {version} failed: {cause!r}")
        self.version = version
        self.cause = cause


@dataclass
class PublishRecord:
    """What publishing one version cost and produced (rank 0 has the full-model figures)."""

    version: int
    kind: str
    fingerprint: str
    changed: int
    elements: int
    payload_bytes: int
    full_bytes: int
    chunks: int
    extract_s: float
    """Cast + compare: the part the training loop waits for (without ``optimizer=``)."""
    encode_s: float
    """Encoding, packing and signing, after extraction."""
    publish_s: float
    """``node.publish``: verify, store, apply to the node's copy."""
    total_s: float
    """From the call to published."""
    exchanged_bytes: int = 0
    """Sharded: bytes rank 0 received from the other ranks for this version (their parts: compressed
    segments, strided changes and fingerprint sums; the raw snapshot for a snapshot)."""
    published_at: float = field(default_factory=time.time)

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["changed_fraction"] = self.changed_fraction
        return d
