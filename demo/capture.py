"""A recording TCP relay in front of each demo node: what crosses the wire, for inspection.

``p2psync demo --capture DIR`` starts every node behind a relay of its own: the
node listens on a private port and advertises the relay's, so every connection
to it (children, gossip, leases, results, the demo's own requests) passes the
relay, which forwards the bytes unchanged and appends them, both directions, to
``DIR/<node>.bin``. A capture on the loopback interface sees the same bytes;
this needs no root and no capture tool. With TLS on, the files hold handshakes
and encrypted records only (``tests/integration/test_demo.py`` checks that the
cluster token and the chunks' plaintext are absent).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import BinaryIO


def free_port(host: str) -> int:
    """A port no one listens on now (the node binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Recorder:
    """Relays on their own event loop thread; :meth:`close` stops them and closes the files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._files: list[BinaryIO] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="capture", daemon=True)
        self._thread.start()

    def front(self, name: str, host: str, port: int) -> int:
        """Start a relay for the node ``name`` that will listen on ``host:port``; returns the relay's port."""
        sink = open(self.directory / f"{name}.bin", "ab")  # noqa: SIM115 - closed in close()
        self._files.append(sink)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(1 << 16):
                    sink.write(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass  # one side went away; the other is closed below
            finally:
                writer.close()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def start() -> int:
            server = await asyncio.start_server(accept, host, 0)
            self._servers.append(server)
            return int(server.sockets[0].getsockname()[1])

        return asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)

    def close(self) -> None:
        async def stop() -> None:
            for s in self._servers:
                s.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        for f in self._files:
            f.close()
