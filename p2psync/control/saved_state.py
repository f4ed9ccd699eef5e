"""What a node keeps of its control plane in its data dir, so that a restart rejoins and revocation holds.

``<data_dir>/control.json``, rewritten atomically (a temporary file, fsync, rename):

- ``incarnation``: the last incarnation this node published; a restart starts above it
  (:func:`p2psync.gossip.membership.restart_incarnation`);
- ``peers``: advertised URLs of members last seen alive, the coordinator first; a restarted
  node calls them like seeds while it knows no live peer (the trainer has no seeds, and the
  members that saw it leave never call it again);
- ``revoked``: the coordinator's latest ``revoked`` entry as it was gossiped, with the trainer
  key's signature. On load it is verified again with the trainer's public key, enforced before
  the node serves anything, and gossiped on as a current entry. A node that restarts thus never
  serves a node it knew to be revoked, and re-serves the list to peers that lost theirs.

A file that cannot be read or parsed is reported and ignored (the node starts as a new member,
and gets the list back from its peers); an entry whose signature does not verify is dropped.
Stdlib only (no I/O beyond the one file).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2psync.errors import CodecError
from p2psync.gossip.items import MAX_ADDRESS, CoordEntry

logger = logging.getLogger(__name__)

FILE = "control.json"
FORMAT = 1
MAX_PEERS = 32
"""Addresses kept: enough to reach a cluster in which most of them moved, small enough to call at start."""


@dataclass(frozen=True)
class SavedControl:
    """A node's control-plane state as its data dir holds it."""

    incarnation: int = 0
    peers: tuple[str, ...] = ()
    revoked: CoordEntry | None = None

    def to_json(self) -> str:
        d: dict = {"format": FORMAT, "incarnation": self.incarnation, "peers": list(self.peers[:MAX_PEERS])}
        if self.revoked is not None:
            d["revoked"] = self.revoked.to_dict()
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SavedControl:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise CodecError(f"not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CodecError(f"not a format-{FORMAT} control state")
        inc, peers = d.get("incarnation"), d.get("peers", [])
        if not (type(inc) is int and inc >= 0):
            raise CodecError(f"incarnation must be an integer >= 0, got {inc!r}")
        if not (isinstance(peers, list)
                and all(isinstance(p, str) and 0 < len(p) <= MAX_ADDRESS for p in peers)):
            raise CodecError("peers must be a list of URLs")
        revoked = CoordEntry.from_dict(d["revoked"]) if d.get("revoked") is not None else None
        if revoked is not None and revoked.name != "revoked":
            raise CodecError(f"revoked holds a {revoked.name!r} entry")
        return cls(inc, tuple(peers[:MAX_PEERS]), revoked)


def path_in(data_dir: str | Path) -> Path:
    return Path(data_dir) / FILE


def load(path: Path, verify: Callable[[CoordEntry], bool]) -> SavedControl:
    """What ``path`` holds (blank if it does not exist, cannot be read, or is malformed: logged);
    a ``revoked`` entry that ``verify`` refuses is dropped (logged)."""
    try:
        saved = SavedControl.from_json(path.read_text())
    except FileNotFoundError:
        return SavedControl()
    except (OSError, UnicodeDecodeError, CodecError) as exc:
        logger.warning("ignoring the saved control state %s (%s): this node starts as a new member and "
                       "takes the revocation list from its peers", path, exc)
        return SavedControl()
    if saved.revoked is not None and not verify(saved.revoked):
        logger.warning("ignoring the revocation list saved in %s: its signature does not verify with "
                       "trainer_public_key", path)
        saved = SavedControl(saved.incarnation, saved.peers, None)
    return saved


def save(path: Path, state: SavedControl) -> None:
    """Write ``state`` to ``path`` atomically (readers see the old or the new file, never a mix)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(state.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
