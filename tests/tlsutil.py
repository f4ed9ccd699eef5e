"""The tests' cluster CA: one per test session, in a temporary folder removed at exit.

Every node a test starts serves mutual TLS like a production node; its certificate comes from
here (issued into the node's ``<data_dir>/tls``, the default ``tls.dir``), and the tests' own
HTTP calls present a client certificate of the same CA (:func:`client_context`).
"""

from __future__ import annotations

import atexit
import shutil
import ssl
import tempfile
from pathlib import Path

from p2psync.certs import Authority
from p2psync.transport.tls import Tls

_CA: Authority | None = None


def authority() -> Authority:
    global _CA
    if _CA is None:
        root = Path(tempfile.mkdtemp(prefix="p2psync-test-ca-"))
        atexit.register(shutil.rmtree, root, True)
        _CA = Authority(root)
    return _CA


def certify(data_dir: Path | str, node_id: str, region: str = "default") -> Path:
    """Issue ``node_id``'s certificate into ``<data_dir>/tls`` (where the node looks by default)."""
    return authority().node(node_id, region, Path(data_dir) / "tls")


def client_tls() -> Tls:
    return Tls.for_client(authority().client())


def client_context() -> ssl.SSLContext:
    ctx = client_tls().client_context
    assert ctx is not None
    return ctx


def node_tls(node_id: str, region: str = "default") -> Tls:
    """A node certificate for a test that speaks as node ``node_id`` itself (issued once)."""
    folder = authority().directory / "as-node" / node_id
    if not (folder / "node.crt").exists():
        authority().node(node_id, region, folder)
    return Tls.for_client(folder)
