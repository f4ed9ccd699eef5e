"""A relay's copy of a trainer-signed raw snapshot, rebuilt from its own weights instead of fetched.

After a relay applies a version whose snapshot the trainer signs, it rebuilds that snapshot from
the weights it holds (:meth:`p2psync.node.follower.Follower` waits for the signed manifest first),
so a late joiner below it fetches the snapshot from the relay, not across the WAN from the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2psync.errors import P2PSyncError

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from p2psync.state import ModelState
    from p2psync.store import VersionStore
    from p2psync.transport.messages import Catalogue


def names_snapshot(cat: Catalogue, version: int) -> bool:
    """``cat`` lists a signed snapshot manifest of ``version``, or one being made."""
    return version in cat.snapshot_manifests or version in cat.snapshots_pending


def rebuild_snapshot(store: VersionStore, state: ModelState, manifest: Manifest) -> bool:
    """Store the snapshot ``manifest`` signs, its chunks cut from ``state``, each verified against
    the manifest as it is stored: a few chunks of memory whatever the model's size. On a difference
    (False) or any failure, what was stored is removed."""
    from p2psync.artifact import snapshot_chunks_to
    from p2psync.codec.encode import CodecOptions

    store.add_manifest(manifest)
    try:
        snapshot_chunks_to(state, manifest, CodecOptions(chunk_size=manifest.chunk_size, zstd_level=0),
                           lambda i, c: store.put_chunk(manifest.artifact_id, i, c), verify=False)
    except BaseException as exc:
        store.remove(manifest.artifact_id)
        if isinstance(exc, P2PSyncError):
            return False
        raise
    return True
