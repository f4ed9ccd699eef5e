"""Who is on the other end of a request: the identity the server's TLS guard admitted, and the
check that what a peer claims to be (a gossip sender, the node in a lease or result body, the
child header) is what its certificate names (:mod:`p2psync.transport.tls`)."""

from __future__ import annotations

from aiohttp import web

from p2psync.certs import Identity

PEER_KEY = web.RequestKey("p2psync_peer", Identity)
"""Where the server's guard leaves the authenticated peer's :class:`Identity` on each request."""


def peer_of(request: web.BaseRequest) -> Identity | None:
    """The authenticated peer of a request the guard admitted (None on plain HTTP)."""
    return request.get(PEER_KEY)


def claim_refused(request: web.BaseRequest, claimed: str, what: str, parts: bool = False) -> str | None:
    """Why the peer may not act as node ``claimed`` (its certificate names another node, or it holds a
    client-only certificate); None when it may (or on plain HTTP, where nothing names the peer).
    ``parts``: ``<id>/<part>`` (a node's own engine, presenting the node's certificate) counts as ``<id>``
    (node ids hold no slash)."""
    peer = peer_of(request)
    if peer is None:
        return None
    if peer.client_only:
        return f"{what}: a client certificate ({peer.id!r}) cannot act as a node"
    if parts:
        claimed = claimed.split("/", 1)[0]
    if peer.id != claimed:
        return f"{what} claims node {claimed!r} but the client's certificate names {peer.id!r}"
    return None
