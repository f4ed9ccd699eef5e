"""What a node's services see of the node they run beside.

The node builds its services (:func:`p2psync.services.build_services`) and hands each
this narrow view of itself plus the other services it needs; a service never reaches
back to attach itself to the node. Any object with these members can host a service
(a test can build one alone).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from p2psync.config import NodeConfig
    from p2psync.transport.metrics import Metrics
    from p2psync.transport.tls import Tls


class Host(Protocol):
    """The node a service runs in (read-only members)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def log(self) -> logging.LoggerAdapter[Any]: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def tls(self) -> Tls:
        """The node's certificates and contexts: every client a service opens uses :meth:`Tls.connector`."""
        ...

    @property
    def address(self) -> str:
        """The node's advertised URL."""
        ...

    @property
    def public_key(self) -> Ed25519PublicKey: ...

    @property
    def private_key(self) -> Ed25519PrivateKey | None:
        """The trainer's key, on the trainer node only."""
        ...

    @property
    def version(self) -> int | None:
        """The version the node holds (applied and fingerprint-checked)."""
        ...

    def status(self) -> dict:
        """``GET /v1/status``."""
        ...

    def cluster(self) -> list[dict]:
        """Every node this one knows (see :meth:`p2psync.node.Node.cluster`)."""
        ...

    def set_planned_parent(self, url: str | None, parent_id: str | None = None) -> None:
        """Follow the live plan: ``url`` becomes the first candidate parent."""
        ...
