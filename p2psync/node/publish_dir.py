"""The trainer's publish directory: artifact files dropped into ``--publish-dir`` are published in version order.

Contract:

- A name that starts with ``.`` or ends in ``.tmp`` is never looked at: a writer writes
  under such a name and renames the finished file into place (``os.replace``), so the
  watcher sees only whole files (``p2psync publish`` and ``p2psync snapshot`` do so).
- A file that cannot be read (incomplete, not an artifact, a bad signature) or that the
  trainer refused (a wrong base, a bad chunk) is looked at again when it changes (inode,
  size or mtime), however often that happens; a new file under the same name is a change.
- A delta goes only onto the trainer's own copy: its base version and base fingerprint
  must be the trainer's, checked before anything is announced
  (:meth:`p2psync.node.origin.Origin.publish`). A delta whose base version is newer than the
  trainer's waits for the files that fill the gap; one with an older or a different base is
  refused.
- Every skip, refusal and wait is one log line naming the file and why, logged again only
  when the reason changes.
"""

from __future__ import annotations

import asyncio
import logging
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from p2psync.artifact import ArtifactFile, Manifest
from p2psync.errors import P2PSyncError, TruncatedError
from p2psync.publish_files import ignored

if TYPE_CHECKING:
    from p2psync.node.replica import Replica
    from p2psync.store import VersionStore


class Origin(Protocol):
    """What the directory needs of the trainer node's origin (:class:`p2psync.node.origin.Origin`,
    which owns the directory: it is passed down, never imported up)."""

    @property
    def log(self) -> logging.LoggerAdapter[Any] | logging.Logger: ...
    @property
    def public_key(self) -> Any: ...
    @property
    def replica(self) -> Replica: ...
    @property
    def store(self) -> VersionStore: ...

    async def publish(self, manifest: Manifest, chunks: list[bytes]) -> None: ...


@dataclass(frozen=True)
class _Seen:
    key: tuple[int, int, int]
    """inode, size, mtime: a change of any means the file is looked at again."""
    target: int
    kind: str
    base_version: int | None
    base_fingerprint: str | None
    artifact_id: str


class PublishDir:
    """One pass over the directory per :meth:`step` (the caller polls); see the module doc."""

    def __init__(self, directory: Path, origin: Origin) -> None:
        self.directory = directory
        self.origin = origin
        self._seen: dict[Path, _Seen] = {}
        self._refused: dict[Path, tuple[int, int, int]] = {}
        self._said: dict[Path, str] = {}

    def _note(self, path: Path, reason: str, level: int = logging.INFO, same: str | None = None) -> None:
        """Log ``reason`` unless the last line about ``path`` said the same (``same``: what counts as
        the same reason when the text carries a figure that moves, like the trainer's version)."""
        tag = same or reason
        if self._said.get(path) != tag:
            self._said[path] = tag
            self.origin.log.log(level, "publish-dir: %s %s", path.name, reason)

    def _refuse(self, path: Path, key: tuple[int, int, int], reason: str, level: int = logging.WARNING) -> None:
        self._refused[path] = key
        self._note(path, f"{reason}; looked at again when the file changes", level)

    def _scan(self) -> list[tuple[int, bool, Path]]:
        ready: list[tuple[int, bool, Path]] = []
        present: set[Path] = set()
        try:
            names = sorted(p for p in self.directory.iterdir() if not ignored(p.name))
        except FileNotFoundError:
            names = []
        for path in names:
            try:
                st = path.stat()
            except OSError:  # removed meanwhile
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            present.add(path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._refused.get(path) == key:
                continue
            self._refused.pop(path, None)
            seen = self._seen.get(path)
            if seen is None or seen.key != key:
                try:
                    with ArtifactFile(path, self.origin.public_key) as art:
                        m = art.manifest
                except TruncatedError:
                    # Being written in place (or cut short): said once, however often it grows.
                    self._refuse(path, key, "skipped: incomplete (the file ends before the artifact does)")
                    continue
                except P2PSyncError as exc:
                    self._refuse(path, key, f"skipped: {exc}")
                    continue
                except OSError as exc:
                    self._refuse(path, key, f"skipped: cannot read it: {exc.strerror or exc}")
                    continue
                seen = self._seen[path] = _Seen(key, m.target_version, m.kind, m.base_version, m.base_fingerprint,
                                                m.artifact_id)
            ready.append((seen.target, seen.kind != "snapshot", path))
        for table in (self._seen, self._refused, self._said):
            for gone in table.keys() - present:
                del table[gone]
        return ready

    async def step(self) -> None:
        """Look at the directory once and publish what is next, in version order."""
        origin = self.origin
        replica = origin.replica
        blocker: Path | None = None
        for target, is_delta, path in sorted(self._scan()):
            seen = self._seen[path]
            held, fingerprint = replica.version, replica.fingerprint
            if held is not None and target <= held:
                if seen.artifact_id not in origin.store.artifacts and self._said.get(path) != "published":
                    # Once per file: not again with every version the trainer moves on (a restarted
                    # trainer's folder holds every file it published, each skipped here).
                    self._note(path, f"skipped: version {target} is not newer than the trainer's version {held}",
                               logging.WARNING, same="not newer")
                continue
            if blocker is not None:
                self._note(path, f"waits: version {target} comes after {blocker.name}, which waits")
                continue
            if is_delta:
                if held is None:
                    self._note(path, f"waits: a delta from version {seen.base_version}, and the trainer holds no "
                                     "version yet (version 0 comes from a snapshot: `p2psync publish` or "
                                     "`p2psync snapshot`)")
                    blocker = path
                    continue
                if seen.base_version is not None and seen.base_version > held:
                    self._note(path, f"waits for version {seen.base_version} (its base); the trainer holds "
                                     f"version {held}")
                    blocker = path
                    continue
                if seen.base_version != held or seen.base_fingerprint != fingerprint:
                    self._refuse(path, seen.key, f"refused: its base is version {seen.base_version} fingerprint "
                                                 f"{seen.base_fingerprint}, the trainer holds version {held} "
                                                 f"fingerprint {fingerprint}", logging.ERROR)
                    continue
            try:
                m, chunks = await asyncio.to_thread(self._read, path)
                await origin.publish(m, chunks)
            except FileNotFoundError:
                return  # taken away meanwhile: look again
            except P2PSyncError as exc:
                self._refuse(path, seen.key, f"not published: {exc}", logging.ERROR)
                return
            self._said[path] = "published"

    def _read(self, path: Path) -> tuple[Manifest, list[bytes]]:
        with ArtifactFile(path, self.origin.public_key) as art:
            return art.manifest, [c for _, c in art.chunks()]
