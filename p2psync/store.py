"""On-disk version store, plus the pure catch-up planner.

Layout under ``data_dir``::

    artifacts/<artifact_id>/manifest        signed manifest bytes
    artifacts/<artifact_id>/chunk-<i>       chunk i, written only after it matched the manifest
    artifacts/<artifact_id>/complete        marker: every chunk is present
    state.p2sa                              checkpoint of the applied weights (raw snapshot, unsigned)

Every file is written to a temporary name and renamed into place, so a crash
leaves either the old file or the new one, never half of one; leftover
temporaries are removed on open. Manifests are re-verified against the
trainer's key when the store is opened, chunks whenever they are read from
disk. The chunks stored or read most recently (``cache_bytes`` of them) are also
kept in memory, as the verified bytes that were checked, so that
a relay serves its children what it just received without reading it back and
hashing it again for every child (cut-through children ask for a chunk moments
after it arrived).

Retention keeps the newest complete snapshot and the delta chain after it,
plus the newest ``keep_deltas`` deltas, and never drops a delta the state
checkpoint still needs to be replayed to the head.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from p2psync.artifact import Manifest, verify_chunk
from p2psync.errors import CodecError, IntegrityError, P2PSyncError

if TYPE_CHECKING:
    from p2psync.state import ModelState

logger = logging.getLogger(__name__)

STATE_FILE = "state.p2sa"
CACHE_BYTES = 128 << 20
"""Default size of the in-memory copy of the most recently stored chunks (``store.cache_bytes``)."""


# --- catch-up planning (pure) -----------------------------------------------------------------
@dataclass(frozen=True)
class ArtifactInfo:
    """What a catalogue says about one artifact a peer can serve."""

    id: str
    kind: str
    base: int | None
    target: int
    bytes: int
    complete: bool = True

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "base": self.base, "target": self.target, "bytes": self.bytes,
                "complete": self.complete}

    @classmethod
    def from_json(cls, d: object) -> ArtifactInfo:
        if not (isinstance(d, dict) and isinstance(d.get("id"), str) and d.get("kind") in ("delta", "snapshot")
                and (d.get("base") is None or _is_int(d.get("base"))) and _is_int(d.get("target"))
                and _is_int(d.get("bytes")) and isinstance(d.get("complete"), bool)):
            raise CodecError(f"catalogue: bad artifact entry {str(d)[:80]}")
        return cls(d["id"], d["kind"], d["base"], d["target"], d["bytes"], d["complete"])

    @classmethod
    def of(cls, m: Manifest, complete: bool) -> ArtifactInfo:
        return cls(m.artifact_id, m.kind, m.base_version, m.target_version, m.payload_bytes, complete)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plan_catchup(current: int | None, head: int, available: Iterable[ArtifactInfo]) -> list[ArtifactInfo]:
    """The artifacts to apply, in order, to go from ``current`` (None: no weights) to ``head``.

    Minimises bytes: a snapshot is an edge from anywhere to its version, a delta an edge from
    its base to its target, and the cheapest path wins (ties: fewer steps). So a node takes
    snapshot ``head`` when that is smaller than the delta chain from ``current``, and a joiner
    takes the newest snapshot whose chain to ``head`` is cheapest. Returns ``[]`` when already
    at ``head``; raises :class:`P2PSyncError` when no path exists.
    """
    if current is not None and current >= head:
        return []
    arts = [a for a in available if a.target <= head and (current is None or a.target > current)]
    # best[v] = (bytes, steps, path) to reach version v; the DAG is ordered by version.
    best: dict[int | None, tuple[int, int, list[ArtifactInfo]]] = {current: (0, 0, [])}
    for a in sorted((a for a in arts if a.kind == "snapshot"), key=lambda a: a.target):
        cand = (a.bytes, 1, [a])
        if a.target not in best or cand[:2] < best[a.target][:2]:
            best[a.target] = cand
    deltas = sorted((a for a in arts if a.kind == "delta"), key=lambda a: (a.target, a.base))
    versions = sorted({a.target for a in arts})
    for v in versions:
        for d in deltas:
            if d.target != v or d.base not in best:
                continue
            b, s, path = best[d.base]
            cand = (b + d.bytes, s + 1, path + [d])
            if v not in best or cand[:2] < best[v][:2]:
                best[v] = cand
    if head not in best:
        where = "no weights" if current is None else f"version {current}"
        raise P2PSyncError(f"no artifacts lead from {where} to version {head}")
    return best[head][2]


# --- the store ----------------------------------------------------------------------------------
@dataclass
class StoredArtifact:
    manifest: Manifest
    path: Path
    held: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.held) == len(self.manifest.chunks)

    @property
    def held_bytes(self) -> int:
        return sum(self.manifest.chunks[i].size for i in self.held)


class VersionStore:
    """Artifacts held on disk, indexed by artifact id. Not thread-safe for structural changes;
    :meth:`put_chunk` and :meth:`read_chunk` may run in worker threads."""

    def __init__(self, root: Path, public_key: Ed25519PublicKey, *, fsync: bool = False,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.root = root
        self.public_key = public_key
        self.fsync = fsync
        self.artifacts: dict[str, StoredArtifact] = {}
        """Held artifacts by id. Worker threads add and remove entries (store, retention, snapshot
        materialisation) while the event loop reads: iterate over ``list(...)`` of it (one
        GIL-atomic copy), never over the live view."""
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, int], bytes | memoryview] = OrderedDict()
        self._cached = 0
        self._cache_lock = threading.Lock()

    @classmethod
    def open(cls, root: str | Path, public_key: Ed25519PublicKey, *, fsync: bool = False,
             cache_bytes: int = CACHE_BYTES) -> VersionStore:
        """Open (or create) the store at ``root``, dropping temporaries and artifacts that fail to verify."""
        store = cls(Path(root), public_key, fsync=fsync, cache_bytes=cache_bytes)
        (store.root / "artifacts").mkdir(parents=True, exist_ok=True)
        for tmp in store.root.rglob("*.tmp"):
            tmp.unlink(missing_ok=True)
        for d in sorted((store.root / "artifacts").iterdir()):
            try:
                m = Manifest.from_bytes((d / "manifest").read_bytes())
                m.verify(public_key)
                if m.artifact_id != d.name:
                    raise CodecError(f"directory {d.name} holds manifest {m.artifact_id}")
            except (OSError, P2PSyncError) as exc:
                logger.warning("store: dropping %s: %s", d.name, exc)
                shutil.rmtree(d, ignore_errors=True)
                continue
            held = {int(p.name[6:]) for p in d.glob("chunk-*") if p.name[6:].isdigit()}
            store.artifacts[d.name] = StoredArtifact(m, d, {i for i in held if i < len(m.chunks)})
        return store

    # --- writing ---------------------------------------------------------------------------
    def _write(self, path: Path, data: bytes | memoryview) -> None:
        """Write by rename; a failed write (a full disk) leaves neither the file nor its temporary."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def add_manifest(self, manifest: Manifest) -> StoredArtifact:
        """Record a verified manifest (idempotent). Raises :class:`SignatureError` if it does not verify."""
        aid = manifest.artifact_id
        if aid in self.artifacts:
            return self.artifacts[aid]
        manifest.verify(self.public_key)
        d = self.root / "artifacts" / aid
        d.mkdir(parents=True, exist_ok=True)
        self._write(d / "manifest", manifest.to_bytes())
        art = StoredArtifact(manifest, d)
        self.artifacts[aid] = art
        return art

    def put_chunk(self, aid: str, index: int, data: bytes | memoryview) -> None:
        """Verify chunk ``index`` against the signed manifest, then store it (idempotent).

        ``data`` is kept (in the memory cache): the caller must not change it afterwards.
        """
        art = self.artifacts[aid]
        verify_chunk(art.manifest, index, data)
        if index in art.held:
            return
        self._write(art.path / f"chunk-{index}", data)
        self._remember(aid, index, data)
        art.held.add(index)

    # --- memory cache of verified chunks -----------------------------------------------------
    def _remember(self, aid: str, index: int, data: bytes | memoryview) -> None:
        if len(data) > self.cache_bytes:
            return
        with self._cache_lock:
            old = self._cache.pop((aid, index), None)
            self._cached += len(data) - (len(old) if old is not None else 0)
            self._cache[(aid, index)] = data
            while self._cached > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._cached -= len(dropped)

    def cached_chunk(self, aid: str, index: int) -> bytes | memoryview | None:
        """Chunk ``index`` if it is in the memory cache (verified when stored), else None. Cheap."""
        with self._cache_lock:
            data = self._cache.get((aid, index))
            if data is not None:
                self._cache.move_to_end((aid, index))
            return data

    @property
    def cached_bytes(self) -> int:
        """Bytes of chunks held in memory now (at most ``cache_bytes``)."""
        return self._cached

    def clear_cache(self) -> None:
        """Drop every chunk held in memory (they stay on disk, read back and re-verified when asked for)."""
        with self._cache_lock:
            self._cache.clear()
            self._cached = 0

    def _forget(self, aid: str) -> None:
        with self._cache_lock:
            for key in [k for k in self._cache if k[0] == aid]:
                self._cached -= len(self._cache.pop(key))

    # --- reading ---------------------------------------------------------------------------
    def has_chunk(self, aid: str, index: int) -> bool:
        art = self.artifacts.get(aid)
        return art is not None and index in art.held

    def read_chunk(self, aid: str, index: int) -> bytes | memoryview:
        """Chunk ``index``: from the memory cache, or from disk and re-verified (bit rot on disk
        is caught here, not by a child)."""
        art = self.artifacts[aid]
        cached = self.cached_chunk(aid, index)
        if cached is not None and index in art.held:
            return cached
        try:
            data = (art.path / f"chunk-{index}").read_bytes()
        except OSError as exc:
            art.held.discard(index)
            raise IntegrityError(f"chunk {index} of {aid} vanished from the store: {exc.strerror}") from None
        try:
            verify_chunk(art.manifest, index, data)
        except IntegrityError:
            art.held.discard(index)
            (art.path / f"chunk-{index}").unlink(missing_ok=True)
            raise
        self._remember(aid, index, data)  # verified: the next child asking for it gets this copy
        return data

    def chunks(self, aid: str) -> list[bytes | memoryview]:
        art = self.artifacts[aid]
        return [self.read_chunk(aid, i) for i in range(len(art.manifest.chunks))]

    def find(self, kind: str, target: int, *, complete: bool | None = None) -> StoredArtifact | None:
        """The artifact of ``kind`` reaching ``target`` (the newest-created one if several)."""
        found = [a for a in list(self.artifacts.values()) if a.manifest.kind == kind and a.manifest.target_version == target
                 and (complete is None or a.complete == complete)]
        return max(found, key=lambda a: a.manifest.created) if found else None

    def catalogue(self, *, complete_only: bool = True) -> list[ArtifactInfo]:
        return sorted((ArtifactInfo.of(a.manifest, a.complete) for a in list(self.artifacts.values())
                       if a.complete or not complete_only), key=lambda i: (i.target, i.kind))

    @property
    def head(self) -> int | None:
        done = [a.manifest.target_version for a in list(self.artifacts.values()) if a.complete]
        return max(done) if done else None

    def newest_snapshot(self) -> StoredArtifact | None:
        snaps = [a for a in list(self.artifacts.values()) if a.manifest.kind == "snapshot" and a.complete]
        return max(snaps, key=lambda a: a.manifest.target_version) if snaps else None

    # --- retention -------------------------------------------------------------------------
    def remove(self, aid: str) -> None:
        art = self.artifacts.pop(aid, None)
        self._forget(aid)
        if art is not None:
            shutil.rmtree(art.path, ignore_errors=True)

    def prune(self, keep_deltas: int, pinned: int | None, busy: Iterable[str] = ()) -> list[str]:
        """Apply retention; ``pinned`` is the state checkpoint's version (deltas after it stay).

        ``busy`` artifacts (being fetched or served) are never removed. Returns removed ids.
        """
        busy = set(busy)
        snap = self.newest_snapshot()
        snap_v = snap.manifest.target_version if snap else None
        removed = []
        for aid, art in list(self.artifacts.items()):
            m = art.manifest
            if aid in busy or snap_v is None or m.kind != "snapshot":
                continue
            if m.target_version < snap_v:
                removed.append(aid)
        deltas = sorted((a for a in list(self.artifacts.values()) if a.manifest.kind == "delta" and a.complete),
                        key=lambda a: a.manifest.target_version)
        newest = {a.manifest.artifact_id for a in deltas[len(deltas) - keep_deltas:]} if keep_deltas else set()
        for art in deltas:
            m = art.manifest
            if m.artifact_id in busy or m.artifact_id in newest or snap_v is None:
                continue
            if m.target_version <= snap_v and (pinned is None or m.target_version <= pinned):
                removed.append(m.artifact_id)
        for aid in removed:
            self.remove(aid)
        return removed

    # --- applied state ---------------------------------------------------------------------
    def save_state(self, state: ModelState, version: int) -> None:
        """Checkpoint the applied weights atomically, as a raw unsigned snapshot artifact.

        Two passes over the weights (hash every chunk for the manifest, then encode again and
        write), so the memory it takes is a few chunks, not a copy of the model. ``state`` must
        not change meanwhile (the node's next commit waits for its housekeeping)."""
        from p2psync.artifact import FileWriter, snapshot_chunks_to, snapshot_manifest
        from p2psync.codec.encode import CodecOptions

        opts = CodecOptions(chunk_size=16 << 20, zstd_level=0)
        m = snapshot_manifest(state, opts, model_id="state-checkpoint", target_version=version)
        with FileWriter(self.root / STATE_FILE, m, fsync=self.fsync) as w:
            snapshot_chunks_to(state, m, opts, w.put)

    def drop_state(self) -> None:
        """Remove the weights' checkpoint (a node that no longer holds weights: it would only pin
        the delta chain after it, see :meth:`prune`)."""
        (self.root / STATE_FILE).unlink(missing_ok=True)

    def load_state(self) -> tuple[ModelState, int] | None:
        """The checkpointed weights and their version, audited against the recorded fingerprint."""
        from p2psync.artifact import ArtifactFile
        from p2psync.codec.decode import decode_state

        path = self.root / STATE_FILE
        if not path.exists():
            return None
        try:
            with ArtifactFile(path, None, allow_unsigned=True) as art:
                m = art.manifest
                state = decode_state(list(m.tensors), art.chunks(), len(m.chunks), m.target_fingerprint)
        except P2PSyncError as exc:
            logger.warning("store: ignoring unreadable state checkpoint %s: %s", path, exc)
            return None
        return state, m.target_version
