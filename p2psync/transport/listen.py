"""Binding the listening socket: stdlib only, so the CLI can listen and print its address
before it imports aiohttp, numba and torch."""

from __future__ import annotations

import errno
import socket

from p2psync.errors import ConfigError


def bind(host: str, port: int, setting: str = "listen.port") -> socket.socket:
    """A listening TCP socket (cheap: the CLI binds and prints its address before heavy imports).

    Raises :class:`ConfigError` naming ``setting`` (the option that chose the port) when the
    address is taken or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(setting, f"port {port} on {host} is in use by another process; choose another "
                                       f"port, or 0 for any free one") from None
        raise ConfigError(setting, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(512)
    sock.setblocking(False)
    return sock


def advertised(sock: socket.socket, host: str, advertise: str, tls: bool = True) -> str:
    """The URL peers use: ``advertise`` if set, else ``https://host:port`` (``http://`` without TLS)."""
    if advertise:
        return advertise.rstrip("/")
    port = sock.getsockname()[1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
