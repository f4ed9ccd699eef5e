"""Measure a testbed path with real TCP: bulk throughput and round-trip time.

    python -m p2psync.testbed.probe serve --host IP --port N          # prints "ready", serves until killed
    python -m p2psync.testbed.probe bulk  --host IP --port N --mbytes 20
    python -m p2psync.testbed.probe rtt   --host IP --port N --count 5

``bulk`` sends that many MB and waits for the server's byte count, so the time
covers delivery, not only the local send buffer; it prints one JSON line
(``bytes``, ``seconds``, ``mbit_s``). ``rtt`` prints the round-trip times of
one-byte pings on one connection (``rtt_ms``: a list).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time


def _handle(c: socket.socket) -> None:
    with c:
        mode = c.recv(1)
        if mode == b"p":
            while d := c.recv(1):
                c.sendall(d)
        elif mode == b"b":
            n = 0
            while d := c.recv(1 << 20):
                n += len(d)
            c.sendall(str(n).encode())


def serve(host: str, port: int) -> None:
    s = socket.create_server((host, port), reuse_port=False)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        threading.Thread(target=_handle, args=(c,), daemon=True).start()


def bulk(host: str, port: int, mbytes: float) -> dict:
    total = int(mbytes * 1e6)
    buf = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=120) as c:
        t0 = time.monotonic()
        c.sendall(b"b")
        left = total
        while left > 0:
            n = min(left, len(buf))
            c.sendall(buf[:n])
            left -= n
        c.shutdown(socket.SHUT_WR)
        got = int(c.recv(64) or b"0")
        dt = time.monotonic() - t0
    return {"bytes": got, "seconds": round(dt, 4), "mbit_s": round(got * 8 / dt / 1e6, 1)}


def rtt(host: str, port: int, count: int) -> dict:
    with socket.create_connection((host, port), timeout=30) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"p")
        out = []
        for _ in range(count):
            t0 = time.monotonic()
            c.sendall(b"x")
            c.recv(1)
            out.append(round((time.monotonic() - t0) * 1000, 3))
    return {"rtt_ms": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["serve", "bulk", "rtt"])
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, default=5201)
    ap.add_argument("--mbytes", type=float, default=20.0)
    ap.add_argument("--count", type=int, default=5)
    a = ap.parse_args(argv)
    if a.mode == "serve":
        serve(a.host, a.port)
        return 0
    print(json.dumps(bulk(a.host, a.port, a.mbytes) if a.mode == "bulk" else rtt(a.host, a.port, a.count)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
