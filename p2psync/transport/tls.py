"""Mutually authenticated TLS for every link: the contexts, the peer's identity, revocation.

One :class:`Tls` per process holds this side's certificate (``tls.dir``, see
:mod:`p2psync.certs`) and builds both ends:

- the server context requires a client certificate that chains to the cluster CA
  (TLS 1.3 only), so a client without one, with a self-signed one or with one from
  another authority is refused in the handshake, before any HTTP is read;
- the client context presents this side's certificate and accepts a server only if
  its certificate chains to the cluster CA. Host names are not checked: nodes are
  named by their certificate's node id, not by DNS (spot machines change
  addresses); what a peer claims to be on the wire is held against that id
  (:func:`p2psync.transport.server` guard, the gossip and coordinator handlers).

Revocation: :meth:`Tls.revoke` takes the coordinator's list of revoked node ids
(it rides gossip, signed by the trainer key). From then on every request from a
revoked id is refused with 403, the connections it holds open (event and push
streams included) are cut, the connections this process holds open to its server
are cut too, and new connections to a server with a revoked id are dropped after
the handshake: a revoked node neither receives from nor serves this one.

Plain HTTP (``tls.enabled = false``) exists for debugging on a trusted host only;
the node logs a warning saying what crosses the network in clear.
"""

from __future__ import annotations

import errno
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2psync import certs
from p2psync.certs import Identity
from p2psync.errors import ConfigError

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from p2psync.config import NodeConfig

logger = logging.getLogger(__name__)

PLAIN_WARNING = ("TLS IS OFF (tls.enabled = false): the cluster token, every artifact's bytes and every "
                 "rollout result cross the network in clear, and anyone who sees the token can join the "
                 "cluster, pull every version and submit results. Use this only on a trusted host.")


class Tls:
    """This process's TLS material and the revoked ids; see the module docstring."""

    def __init__(self, directory: Path | None) -> None:
        """``directory``: a certificate folder (``ca.crt``, ``node.crt``, ``node.key``); None: plain HTTP."""
        self.directory = directory
        self.identity: Identity | None = None
        self.server_context: ssl.SSLContext | None = None
        self.client_context: ssl.SSLContext | None = None
        self.revoked: frozenset[str] = frozenset()
        self._open: dict[str, set[Any]] = {}
        """Connections this process opened, by the server's node id (cut when it is revoked)."""
        if directory is None:
            return
        ca, cert, key = directory / certs.CA_CERT, directory / certs.NODE_CERT, directory / certs.NODE_KEY
        for path in (cert, key, ca):
            if not path.is_file():
                raise ConfigError("tls.dir", f"{path} is missing: issue this node's certificate with "
                                             "`p2psync cert issue --id ID --region REGION --ca CA_DIR -o DIR` "
                                             "(or set tls.enabled = false for plain HTTP on a trusted host)")
        self.identity = certs.identity_of(cert)
        certs.check_issued_by(cert, ca)
        try:
            self.client_context = self._context(ssl.PROTOCOL_TLS_CLIENT, ca, cert, key)
            self.client_context.sslobject_class = _revocation_checked(self)
            if not self.identity.client_only:
                self.server_context = self._context(ssl.PROTOCOL_TLS_SERVER, ca, cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("tls.dir", f"cannot load the certificates in {directory}: {exc}") from None

    @staticmethod
    def _context(protocol: int, ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        if protocol == ssl.PROTOCOL_TLS_CLIENT:
            ctx.check_hostname = False  # peers are named by the node id in their certificate, not by DNS
        ctx.load_verify_locations(cafile=str(ca))
        ctx.load_cert_chain(str(cert), str(key))
        return ctx

    @classmethod
    def for_node(cls, cfg: NodeConfig) -> Tls:
        """The node's TLS (checks that its certificate names this node and its region)."""
        if not cfg.tls.enabled:
            logger.warning(PLAIN_WARNING)
            return cls(None)
        tls = cls(Path(cfg.tls.dir or Path(cfg.data_dir) / "tls"))
        ident = tls.identity
        assert ident is not None
        if ident.client_only:
            raise ConfigError("tls.dir", f"{tls.directory} holds a client-only certificate; a node needs one "
                                         "issued without --client")
        if ident.id != cfg.id:
            raise ConfigError("tls.dir", f"the certificate in {tls.directory} is for node {ident.id!r}, "
                                         f"not for this node ({cfg.id!r})")
        if ident.region != cfg.region:
            raise ConfigError("tls.dir", f"the certificate in {tls.directory} is for region {ident.region!r}, "
                                         f"not this node's region {cfg.region!r}")
        return tls

    @classmethod
    def for_client(cls, directory: str | Path | None) -> Tls:
        """A client's TLS (CLI, tools, tests): any certificate from the cluster CA; None: plain HTTP."""
        return cls(Path(directory) if directory else None)

    @property
    def enabled(self) -> bool:
        return self.client_context is not None

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"

    # --- clients ------------------------------------------------------------------------------
    def connector(self, **kwargs: Any) -> aiohttp.TCPConnector:
        """An aiohttp connector that presents this side's certificate and checks the server's."""
        import aiohttp

        # Without a certificate of our own (plain HTTP), an https URL still gets the default checks.
        return aiohttp.TCPConnector(ssl=self.client_context or True, **kwargs)

    def urlopen(self, request: Any, timeout: float) -> Any:
        """``urllib.request.urlopen`` with this side's certificate (for stdlib-only callers)."""
        import urllib.request

        return urllib.request.urlopen(request, timeout=timeout, context=self.client_context)

    # --- servers ------------------------------------------------------------------------------
    def peer(self, request: web.BaseRequest) -> Identity | None:
        """The identity in the client's certificate (None on plain HTTP)."""
        transport = request.transport
        if transport is None or self.server_context is None:
            return None
        return certs.identity_from_peercert(transport.get_extra_info("peercert"))

    def admit(self, request: web.BaseRequest) -> Identity | None | str:
        """The peer's identity, or a reason to refuse it (a string); tracks its connection so that
        :meth:`revoke` can cut it later."""
        if self.server_context is None:
            return None
        ident = self.peer(request)
        if ident is None:
            return "no client certificate"  # cannot happen with CERT_REQUIRED; refuse if it does
        if ident.id in self.revoked:
            return f"node {ident.id!r} is revoked"  # answered 403, then the connection is closed
        conns = self._open.setdefault(ident.id, set())
        if len(conns) > 64:
            conns.difference_update([t for t in conns if t.is_closing()])
        assert request.transport is not None
        conns.add(request.transport)
        return ident

    def revoke(self, ids: frozenset[str] | set[str]) -> set[str]:
        """Make ``ids`` the revoked set; cut every connection a newly revoked id holds. Returns the new ids."""
        new = set(ids) - self.revoked
        self.revoked = frozenset(ids)
        for node_id in new:
            for transport in self._open.pop(node_id, set()):
                transport.abort()
        if new:
            logger.warning("revoked nodes cut off: %s", ", ".join(sorted(new)))
        return new


def connector(tls: Tls | None, **kwargs: Any) -> aiohttp.TCPConnector:
    """``tls.connector(**kwargs)``, or a plain connector without TLS (None)."""
    if tls is not None:
        return tls.connector(**kwargs)
    import aiohttp

    return aiohttp.TCPConnector(**kwargs)


class RevokedPeerError(ssl.SSLError):
    """The server on the other end of a TLS connection is a revoked node."""

    def __init__(self, node_id: str) -> None:
        super().__init__(errno.EACCES, f"server {node_id!r} is revoked")  # strerror: what aiohttp shows
        self.node_id = node_id


def _revocation_checked(tls: Tls) -> type[ssl.SSLObject]:
    """The TLS object class of ``tls``'s client context (``SSLContext.sslobject_class``, the ssl
    module's public hook): a handshake with a revoked server fails before any HTTP is sent, and a
    connection to a server revoked after its handshake fails at its next record either way (a kept
    connection is cut when it is next used, not reused)."""

    class RevocationChecked(ssl.SSLObject):
        _peer_id: str | None = None

        def _check(self) -> None:
            if self._peer_id is not None and self._peer_id in tls.revoked:
                raise RevokedPeerError(self._peer_id)

        def do_handshake(self) -> None:
            super().do_handshake()
            ident = certs.identity_from_peercert(self.getpeercert())
            self._peer_id = ident.id if ident is not None else None
            self._check()

        def read(self, len: int = 1024, buffer: Any = None) -> Any:  # noqa: A002 - SSLObject's signature
            self._check()
            return super().read(len, buffer) if buffer is not None else super().read(len)

        def write(self, data: Any) -> int:
            self._check()
            return super().write(data)

    return RevocationChecked
