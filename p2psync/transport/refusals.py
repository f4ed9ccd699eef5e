"""Refusals an operator must act on, told apart from a peer that is just down.

A wrong cluster token (401), a peer certificate of another CA (the TLS check of the server
fails) and this node's revocation (403 naming it) used to surface as an endless
``peer ... unreachable: HTTP 401`` / ``ServerDisconnectedError`` / ``ClientConnectorCertificateError``
retry line. :func:`from_response` and :func:`from_exception` turn them into the typed
:class:`~p2psync.errors.PeerRefused` errors (a :class:`~p2psync.errors.PeerUnreachable`, so every
caller still retries or moves to another parent), whose message names the cause and the setting.
:class:`RefusalLog` says when to log one: the first time per peer and cause, then once per
``every`` seconds (sans-IO: it takes ``now``), so that a node retrying a refusing peer does not
fill its log.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from p2psync.errors import ForeignCertificate, NodeRevoked, PeerRefused, PeerUnreachable, WrongClusterToken

if TYPE_CHECKING:
    import aiohttp


async def from_response(url: str, what: str, resp: aiohttp.ClientResponse) -> PeerRefused | None:
    """The refusal ``resp`` (a non-2xx answer to ``what``) stands for, or None if it is none."""
    if resp.status == 401:
        return WrongClusterToken(url, what)
    if resp.status == 403:
        try:
            error = json.loads(await resp.content.read(4096)).get("error", "")
        except (ValueError, AttributeError, OSError):
            return None
        if isinstance(error, str) and error.endswith(" is revoked"):
            return NodeRevoked(url, error.removesuffix(" is revoked").removeprefix("node "))
    return None


def from_exception(url: str, what: str, exc: BaseException) -> PeerUnreachable:
    """The error to raise for a failed request: :class:`ForeignCertificate` when the peer's
    certificate did not verify, else :class:`PeerUnreachable` naming the exception."""
    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        err = exc.certificate_error
        return ForeignCertificate(url, getattr(err, "verify_message", None) or str(err))
    return PeerUnreachable(url, f"{what}: {type(exc).__name__}: {exc}")


class RefusalLog:
    """When to log a refusal: the first of each (peer, cause), then once per ``every`` seconds."""

    def __init__(self, every: float = 300.0) -> None:
        self.every = every
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def due(self, exc: PeerRefused, now: float) -> int | None:
        """None: do not log now; else how many of these were left unlogged since the last line."""
        key = (exc.peer, type(exc).__name__)
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every:
            self._last[key] = (last[0], last[1] + 1)
            return None
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]
