"""The trainer node's side of a node: publishing, signed snapshots, the publish directory.

:class:`Origin` is the only publisher (the trainer's key signs every manifest):
it verifies, stores and announces an artifact, then has the node's
:class:`~p2psync.node.replica.Replica` apply it. Every ``store.snapshot_interval``
versions it signs a raw snapshot of the weights as that version's housekeeping,
which relays rebuild from their own weights (:mod:`p2psync.node.follower`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2psync.artifact import Manifest
from p2psync.errors import CodecError, P2PSyncError, WrongBase
from p2psync.node.publish_dir import PublishDir

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from p2psync.config import NodeConfig
    from p2psync.logs import NodeAdapter
    from p2psync.node.replica import Replica
    from p2psync.store import VersionStore
    from p2psync.transport.board import Board
    from p2psync.transport.view import HeadSignal


class Origin:
    """Publishing on the trainer node (see the module doc)."""

    def __init__(self, config: NodeConfig, log: NodeAdapter, store: VersionStore, board: Board, heads: HeadSignal,
                 public_key: Ed25519PublicKey, private_key: Ed25519PrivateKey | None, replica: Replica) -> None:
        self.config = config
        self.log = log
        self.store = store
        self.board = board
        self.heads = heads
        self.public_key = public_key
        self.private_key = private_key
        self.replica = replica
        self._publish_lock = asyncio.Lock()

    async def publish(self, manifest: Manifest, chunks: list[bytes],
                      changes: dict[int, tuple[Any, Any]] | None = None) -> None:
        """Trainer only: verify, store and announce ``manifest``, then apply it to the trainer's copy.

        ``changes`` (a delta only): ``tensor index -> (positions, new words)``, the changes the
        chunks encode, as the publisher extracted them. The trainer's copy then takes them
        directly, after checking that they turn its weights into the manifest's signed target
        fingerprint (work proportional to the changed elements), instead of decoding every
        chunk again: on a large model that decode is seconds of the trainer's CPU per step.
        What this skips is a self-test of the encoder; every receiver still decodes and checks
        the target fingerprint before it applies anything, so a wrong encoding is refused
        everywhere and lost nowhere.

        Children are told about the artifact as soon as its manifest is stored, and may fetch
        each chunk the moment it is verified and stored here (cut-through, as on a relay): the
        trainer's own apply (decode, fingerprint check, write) runs after the announcement, not
        in front of it. That is safe because no node ever commits an artifact whose result does
        not hash to the signed target fingerprint; if the trainer's own commit fails, the
        artifact is withdrawn (removed and the head announced again) and the error raised, so a
        publisher learns about it at once.

        A delta must have the current version and fingerprint as its base (checked before the
        announcement); a snapshot may start or restart the chain. Raises (and stores nothing new) if the signature, a chunk or the result is wrong.
        Returns once the trainer's copy is at the new version.
        """
        if self.config.role != "trainer":
            raise P2PSyncError(f"only the trainer publishes (this node is a {self.config.role})")
        await self.replica.loaded.wait()
        async with self._publish_lock:
            manifest.verify(self.public_key)
            # Checked against the trainer's own copy before anything is announced: a wrong base
            # is refused here, never listed to a child and withdrawn afterwards.
            if manifest.kind == "delta" and (manifest.base_version != self.replica.version
                                             or manifest.base_fingerprint != self.replica.fingerprint):
                raise WrongBase(str(manifest.base_fingerprint), str(self.replica.fingerprint), manifest.base_version)
            if self.replica.version is not None and manifest.target_version <= self.replica.version:
                raise CodecError(f"version {manifest.target_version} is not newer than {self.replica.version}")
            if len(chunks) != len(manifest.chunks):
                raise CodecError(f"{len(chunks)} chunks given, manifest has {len(manifest.chunks)}")
            aid = manifest.artifact_id
            fresh = aid not in self.store.artifacts
            self.store.add_manifest(manifest)
            announced = self.config.cut_through
            if announced:
                self.board.begin(aid, len(manifest.chunks))
                self.heads.bump()
            loop = asyncio.get_running_loop()

            def store_all() -> None:
                for i, c in enumerate(chunks):
                    self.store.put_chunk(aid, i, c)
                    if announced:
                        loop.call_soon_threadsafe(self.board.arrived, aid, i)

            try:
                await asyncio.to_thread(store_all)
                if announced:
                    self.board.end(aid)
                self.heads.bump()  # complete: listed as held from now on
                self.log.info("published %s", aid)
                await self.replica.commit(manifest, chunks, changes=changes if manifest.kind == "delta" else None)
                self.heads.bump()  # the trainer's own version moved
            except BaseException:
                self.board.end(aid)
                if fresh:
                    self.store.remove(aid)
                    self.log.error("withdrew %s: it did not apply to the trainer's own copy", aid)
                self.heads.bump()
                raise
            every = self.config.store.snapshot_interval
            first = None
            if self.private_key is not None and every and manifest.kind == "delta" \
                    and manifest.target_version % every == 0:
                first = self.sign_snapshot_task(manifest.model_id)
            # Listed as pending before the lock is released, so before any newer version is
            # announced: a relay then waits for this snapshot instead of moving past it.
            self.replica.after_apply(first, manifest.target_version if first is not None else None)

    async def sign_snapshot_task(self, model_id: str) -> None:
        snap = await asyncio.to_thread(self.sign_snapshot, model_id)
        self.heads.bump()
        self.log.info("signed raw snapshot %s", snap.artifact_id)

    def sign_snapshot(self, model_id: str) -> Manifest:
        """Sign and store a raw snapshot of the weights in two passes (the manifest from every
        chunk's hash, then the chunks encoded again and stored), in a few chunks of memory. The
        manifest is listed from the first pass on, before the chunks: relays rebuild the chunks
        from their own weights, and joiners only use complete snapshots."""
        from p2psync.artifact import snapshot_chunks_to, snapshot_manifest
        from p2psync.codec.encode import CodecOptions

        assert self.replica.state is not None and self.replica.version is not None
        opts = CodecOptions(chunk_size=self.config.store.snapshot_chunk_size, zstd_level=0)
        m = snapshot_manifest(self.replica.state, opts, model_id=model_id, target_version=self.replica.version,
                              private_key=self.private_key)
        self.store.add_manifest(m)
        try:
            snapshot_chunks_to(self.replica.state, m, opts, lambda i, c: self.store.put_chunk(m.artifact_id, i, c),
                               verify=False)  # put_chunk verifies
        except BaseException:
            self.store.remove(m.artifact_id)
            raise
        return m

    async def publish_dir(self, directory: Path) -> None:
        """Publish every artifact file appearing in ``directory``, in version order (:class:`PublishDir`)."""
        await self.replica.loaded.wait()
        watcher = PublishDir(directory, self)
        while True:
            await watcher.step()
            await asyncio.sleep(0.2)
