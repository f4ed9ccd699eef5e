"""Wire messages of the HTTP API, as frozen dataclasses with a format version.

The binary payloads (manifests, chunks) have their own formats in
:mod:`p2psync.artifact`; these are the small JSON documents around them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from p2psync.errors import CodecError
from p2psync.store import ArtifactInfo

WIRE_VERSION = 1
API = "/v1"
NODE_HEADER = "X-P2PSync-Node"


@dataclass(frozen=True)
class Catalogue:
    """What a node can serve right now: ``GET /v1/head`` and every event of ``GET /v1/events``.

    ``artifacts`` lists complete artifacts and those still being fetched (``complete`` false):
    a child may fetch those at once, chunks arrive as the node verifies them (cut-through).
    ``snapshot_manifests`` are versions with a trainer-signed snapshot manifest, held with or
    without its chunks (a node that holds the weights can rebuild them).
    ``snapshots_pending`` are versions whose signed snapshot manifest is being made (the
    trainer signs it, a relay rebuilds it) and not listed yet: a node listing one does so from
    before it announces any newer version, so a relay that would move past such a version first
    waits for the manifest and rebuilds the snapshot from the weights it still holds.
    """

    node: str
    region: str
    version: int | None
    """Version of the weights this node has applied."""
    fingerprint: str | None
    head: int | None
    """Newest version any listed artifact reaches."""
    artifacts: tuple[ArtifactInfo, ...]
    snapshot_manifests: tuple[int, ...] = ()
    snapshots_pending: tuple[int, ...] = ()
    format_version: int = WIRE_VERSION

    def to_json(self) -> dict:
        return {
            "format": self.format_version,
            "node": self.node,
            "region": self.region,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "head": self.head,
            "artifacts": [a.to_json() for a in self.artifacts],
            "snapshot_manifests": list(self.snapshot_manifests),
            "snapshots_pending": list(self.snapshots_pending),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str | bytes) -> Catalogue:
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CodecError(f"catalogue: not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != WIRE_VERSION:
            raise CodecError(f"catalogue: unsupported format {d.get('format') if isinstance(d, dict) else '?'}")
        try:
            arts = tuple(ArtifactInfo.from_json(a) for a in d["artifacts"])
            snaps = tuple(int(v) for v in d.get("snapshot_manifests", []))
            pending = tuple(int(v) for v in d.get("snapshots_pending", []))
            head, version = d["head"], d["version"]
            if not (head is None or isinstance(head, int)) or not (version is None or isinstance(version, int)):
                raise CodecError("catalogue: head and version must be integers or null")
            return cls(str(d["node"]), str(d["region"]), version, d["fingerprint"], head, arts, snaps, pending)
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"catalogue: malformed ({exc!r})") from None


def artifact_path(aid: str) -> str:
    return f"{API}/artifacts/{aid}"


def valid_artifact_id(aid: str) -> bool:
    """Artifact ids are ``kind-base-target-hex16``: letters, digits and dashes only."""
    return 0 < len(aid) <= 96 and all(c.isalnum() or c == "-" for c in aid)
