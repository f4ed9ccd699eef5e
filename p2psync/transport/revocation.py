"""The revocation list: node ids the operator cut off (``p2psync cert revoke``).

The trainer reads the file named by ``tls.revoked`` (one node id a line, ``#``
comments) whenever it changes, enforces it at once and gossips it as the signed
coordinator entry ``revoked``, which every node enforces as it arrives
(:meth:`p2psync.transport.tls.Tls.revoke`) and keeps in its data dir
(:mod:`p2psync.control.saved_state`) for its next start. Stdlib only.
"""

from __future__ import annotations

from pathlib import Path

from p2psync.errors import ConfigError

MAX_REVOKED = 4096


def parse(text: str) -> set[str]:
    ids = {line.split("#", 1)[0].strip() for line in text.splitlines()}
    ids.discard("")
    if len(ids) > MAX_REVOKED:
        raise ConfigError("tls.revoked", f"at most {MAX_REVOKED} revoked ids, got {len(ids)}")
    return ids


def read_list(path: Path) -> set[str]:
    """The ids in a revocation file (empty if it does not exist yet)."""
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise ConfigError("tls.revoked", f"cannot read {path}: {exc.strerror}") from None


class RevocationFile:
    """A revocation file, re-read only when its modification time or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self.ids: frozenset[str] = frozenset()

    def poll(self) -> frozenset[str] | None:
        """The ids if the file changed since the last call (first call: always), else None."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = (0, 0)
        except OSError as exc:
            raise ConfigError("tls.revoked", f"cannot read {self.path}: {exc.strerror}") from None
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        self.ids = frozenset(read_list(self.path))
        return self.ids
