"""Turning checkpoints into the next version of a trainer's publish directory (``p2psync publish``).

Contract:

- The version the trainer holds is learnt from the directory itself: the trainer node
  publishes every artifact file there in version order, so the newest version among the
  files signed by the trainer's key that continue one another (from a snapshot, each delta's base
  the version before) is the version the trainer holds once it has read them.
  ``.p2psync-published.json`` beside them (the watcher never looks at names starting with
  ``.``) records which checkpoint made that version and its fingerprint.
- Nothing held (no artifact file in the directory): the checkpoint becomes version 0, a
  signed snapshot. Otherwise it becomes version N + 1, a signed delta against version N.
  The weights of version N are, first found first: ``base`` if given, the checkpoint the
  record names if its fingerprint is still N's, else the snapshot and deltas in the
  directory decoded up to N. Each is checked against N's signed fingerprint.
- A file appears in the directory only whole: written under a name the watcher ignores,
  then renamed into place; a second ``publish`` on the same directory waits for the first.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from p2psync.artifact import ArtifactFile, Manifest
from p2psync.errors import ConfigError, P2PSyncError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from p2psync.codec.encode import CodecOptions
    from p2psync.state import ModelState

logger = logging.getLogger(__name__)

RECORD = ".p2psync-published.json"
LOCK = ".p2psync-publish.lock"


@dataclass(frozen=True)
class Published:
    """One version in the directory: what the record keeps of the newest."""

    version: int
    fingerprint: str
    model_id: str
    file: str
    """The artifact file's name in the directory."""
    checkpoint: str | None = None
    """The checkpoint it was made from (absolute path), when ``p2psync publish`` made it."""


def ignored(name: str) -> bool:
    """Names the trainer's watcher never looks at: where a writer prepares a file before renaming it into place."""
    return name.startswith(".") or name.endswith(".tmp")


def file_name(version: int, kind: str) -> str:
    return f"{version:08d}-{kind}.p2sa"


def read_record(directory: Path) -> Published | None:
    try:
        raw = json.loads((directory / RECORD).read_text())
        return Published(**raw)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        logger.warning("ignoring %s: %s", directory / RECORD, exc)
        return None


def write_record(directory: Path, rec: Published) -> None:
    tmp = directory / (RECORD + ".tmp")
    tmp.write_text(json.dumps(asdict(rec), indent=1) + "\n")
    os.replace(tmp, directory / RECORD)


def artifacts_in(directory: Path, public_key: Ed25519PublicKey) -> list[tuple[Manifest, Path]]:
    """The artifact files in ``directory`` signed by ``public_key``, oldest version first (others are skipped)."""
    out = []
    for path in sorted(directory.iterdir()):
        if ignored(path.name) or not path.is_file():
            continue
        try:
            with ArtifactFile(path, public_key) as art:
                out.append((art.manifest, path))
        except P2PSyncError as exc:
            logger.info("not an artifact of this trainer, left out: %s: %s", path.name, exc)
    out.sort(key=lambda mp: (mp[0].target_version, mp[0].kind != "snapshot", mp[1].name))
    return out


def chain(arts: list[tuple[Manifest, Path]]) -> list[tuple[Manifest, Path]]:
    """The files the trainer goes through, as its watcher takes them: from the newest snapshot that
    restarts the chain, each delta whose base (version and fingerprint) is the version before.
    Files off the chain (refused, stale) are left out."""
    out: list[tuple[Manifest, Path]] = []
    for m, path in arts:
        if m.kind == "snapshot":
            if not out or m.target_version > out[-1][0].target_version:
                out = [(m, path)]
        elif out and m.base_version == out[-1][0].target_version \
                and m.base_fingerprint == out[-1][0].target_fingerprint:
            out.append((m, path))
    return out


def held(directory: Path, public_key: Ed25519PublicKey) -> tuple[Published | None, list[tuple[Manifest, Path]]]:
    """The newest version in the directory's chain (None: nothing held yet) and that chain."""
    files = chain(artifacts_in(directory, public_key))
    if not files:
        return None, files
    m, path = files[-1]
    rec = read_record(directory)
    ckpt = rec.checkpoint if rec is not None and rec.version == m.target_version \
        and rec.fingerprint == m.target_fingerprint else None
    return Published(m.target_version, m.target_fingerprint, m.model_id, path.name, ckpt), files


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """One ``publish`` at a time on ``directory`` (an advisory lock; the watcher ignores the file)."""
    with open(directory / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _in_table(state: ModelState, table: list) -> ModelState:
    from p2psync.checkpoint import in_table

    if [s.name for s in table] == list(state):
        return state
    return in_table(state, table)


def chain_state(files: list[tuple[Manifest, Path]], threads: int) -> ModelState:
    """The weights at the end of ``files`` (a :func:`chain`), decoded."""
    from p2psync.codec.decode import Applier

    state: ModelState | None = None
    for _, path in files:
        with ArtifactFile(path, None, allow_unsigned=True) as art:  # signatures checked when listed
            ap = Applier.onto(state, art.manifest)
            ap.add_chunks(art.chunks(), threads)
            ap.commit()
            state = ap.state
    if state is None:
        raise ConfigError("base", "the publish directory holds no snapshot to rebuild the weights from")
    return state


def base_state(top: Published, arts: list[tuple[Manifest, Path]], base: str | None,
               threads: int) -> tuple[ModelState, str]:
    """The weights of ``top``, the end of the chain ``arts`` (see the module doc), in its tensor table's
    order, and where they came from."""
    from p2psync import checkpoint

    table = list(next(m for m, p in arts if p.name == top.file).tensors)
    tried: list[str] = []
    for source in (base, top.checkpoint):
        if source is None:
            continue
        if not Path(source).exists():
            tried.append(f"{source} is gone")
            continue
        state = _in_table(checkpoint.load(source).state, table)
        if state.fingerprint == top.fingerprint:
            return state, source
        tried.append(f"{source} has fingerprint {state.fingerprint}")
        if source == base:
            raise ConfigError("base", f"{base} is not version {top.version} (fingerprint {top.fingerprint}): "
                                      f"{tried[-1]}")
    state = chain_state(arts, threads)
    if state.fingerprint != top.fingerprint:
        raise ConfigError("base", f"the publish directory's files decode to fingerprint {state.fingerprint}, "
                                  f"not version {top.version}'s {top.fingerprint}")
    how = "decoded from the publish directory" + (f" ({'; '.join(tried)})" if tried else "")
    return state, how


def write_snapshot(state: ModelState, out: Path, opts: CodecOptions, *, model_id: str, version: int,
                   private_key: Ed25519PrivateKey | None) -> Manifest:
    """A signed snapshot of ``state`` at ``out``, written under a name the watcher ignores and renamed into place
    (two passes over the weights, a few chunks of memory)."""
    from p2psync.artifact import FileWriter, snapshot_chunks_to, snapshot_manifest

    m = snapshot_manifest(state, opts, model_id=model_id, target_version=version, private_key=private_key)
    with FileWriter(out, m) as w:
        snapshot_chunks_to(state, m, opts, w.put)
    return m


def write_delta(base: ModelState, new: ModelState, out: Path, opts: CodecOptions, *, model_id: str,
                base_version: int, private_key: Ed25519PrivateKey | None) -> tuple[Manifest, int]:
    """A signed delta ``base -> new`` at ``out`` (renamed into place). Returns it and its changed elements."""
    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import encode_delta

    enc = encode_delta(base, new, opts)
    m = build_manifest(enc, model_id=model_id, base_version=base_version, target_version=base_version + 1,
                       chunk_size=opts.chunk_size, private_key=private_key)
    write_file(out, m, enc.chunks)
    return m, sum(enc.changed)


def publish(ckpt: str, directory: Path, private_key: Ed25519PrivateKey, opts: CodecOptions, *,
            base: str | None = None, model_id: str | None = None) -> tuple[Manifest, Path, str]:
    """``ckpt`` as the next version in ``directory`` (see the module doc). Returns the manifest, the file
    and a line saying what it was made against."""
    from p2psync import checkpoint

    if not directory.is_dir():
        raise ConfigError("publish-dir", f"{directory} is not a directory")
    public_key = private_key.public_key()
    with locked(directory):
        top, arts = held(directory, public_key)
        new = checkpoint.load(ckpt).state
        source = str(Path(ckpt).resolve())
        if top is None:
            mid = model_id or Path(ckpt).name
            out = directory / file_name(0, "snapshot")
            if out.exists():
                raise ConfigError("publish-dir", f"{out} exists already and is not an artifact of this trainer's key")
            m = write_snapshot(new, out, opts, model_id=mid, version=0, private_key=private_key)
            how = "a snapshot: the publish directory held no version"
        else:
            old, origin = base_state(top, arts, base, opts.threads)
            new = _in_table(new, list(old.specs))
            out = directory / file_name(top.version + 1, "delta")
            if out.exists():
                raise ConfigError("publish-dir", f"{out} exists already")
            m, changed = write_delta(old, new, out, opts, model_id=model_id or top.model_id, base_version=top.version,
                                     private_key=private_key)
            numel = sum(spec.numel for spec in new.specs)
            how = (f"a delta from version {top.version} ({origin}): {changed:,} of {numel:,} elements "
                   f"changed, {m.model_bytes / max(1, m.payload_bytes):.1f}x smaller than the full weights")
        write_record(directory, Published(m.target_version, m.target_fingerprint, m.model_id, out.name, source))
    return m, out, how
