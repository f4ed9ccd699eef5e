"""Binding the listening socket: stdlib only, so the CLI can listen and print its address
before it imports aiohttp, numba and torch."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (cheap: the CLI binds and prints its address before heavy imports)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
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
