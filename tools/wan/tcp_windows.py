"""How long a burst takes on an idle long-lived TCP stream, with and without padding first (root).

Why it exists: p2psync pushes small deltas down each child's open stream
(``p2psync.transport.push``), which carries only catalogues between steps. This
measures what that costs on the testbed's WAN links when the stream's TCP
windows never grew, and after ``W`` bytes of padding at open
(``limits.stream_warmup_bytes``):

    .venv/bin/python tools/wan/tcp_windows.py --warm-mb 0,4,0,4 --payload 1780000

For each padding size: a server in the trainer's namespace accepts one
connection per client, sends the padding, then ``--idle`` seconds of a 5-byte
keep-alive per second, then the payload stamped with its send time; a client
in one machine per region reads it all and prints the seconds from that stamp
to its last byte (one host, so the monotonic clocks agree). Prints one JSON
line per padding size.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_STAMP = struct.Struct(">dI")


def _recv(c: socket.socket, n: int) -> None:
    while n:
        got = c.recv(min(n, 1 << 20))
        if not got:
            raise EOFError("stream closed")
        n -= len(got)


def serve(port: int, warm: int, size: int, idle: int, clients: int) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(clients)
    conns = [s.accept()[0] for _ in range(clients)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(bytes(warm))
    for _ in range(idle):
        time.sleep(1)
        for c in conns:
            c.sendall(b"K" * 5)
    payload = bytes(size)
    for c in conns:
        c.sendall(b"P" + _STAMP.pack(time.monotonic(), size) + payload)
    for c in conns:
        c.close()


def fetch(host: str, port: int, warm: int) -> float:
    for _ in range(100):
        try:
            c = socket.create_connection((host, port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    _recv(c, warm)
    while True:
        kind = bytearray(1)
        if not c.recv_into(kind, 1):
            raise EOFError("stream closed")
        if kind == b"K":
            _recv(c, 4)
            continue
        head = bytearray(_STAMP.size)
        view = memoryview(head)
        got = 0
        while got < len(head):
            got += c.recv_into(view[got:], len(head) - got)
        sent, size = _STAMP.unpack(head)
        _recv(c, size)
        return time.monotonic() - sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    sv = sub.add_parser("serve")
    sv.add_argument("port", type=int)
    sv.add_argument("warm", type=int)
    sv.add_argument("size", type=int)
    sv.add_argument("idle", type=int)
    sv.add_argument("clients", type=int)
    fe = sub.add_parser("fetch")
    fe.add_argument("host")
    fe.add_argument("port", type=int)
    fe.add_argument("warm", type=int)
    ap.add_argument("--warm-mb", default="0,4,0,4", help="padding sizes to try, MiB, in order")
    ap.add_argument("--payload", type=int, default=1_780_000, help="burst size, bytes (default: the WAN delta)")
    ap.add_argument("--idle", type=int, default=3, help="seconds of keep-alives between padding and burst")
    ap.add_argument("--name", default="tcpw", help="testbed name (namespace prefix)")
    args = ap.parse_args()
    if args.cmd == "serve":
        serve(args.port, args.warm, args.size, args.idle, args.clients)
        return 0
    if args.cmd == "fetch":
        print(f"{fetch(args.host, args.port, args.warm):.4f}", flush=True)
        return 0

    sys.path.insert(0, str(REPO))
    from p2psync.testbed.config import scaled
    from p2psync.testbed.runner import Testbed

    cfg = scaled(4, 1, None, name=args.name)
    me = [sys.executable, str(Path(__file__).resolve())]
    with Testbed.up(cfg) as tb:
        targets = [m.id for m in tb.rollout_machines()]
        for k, mb in enumerate(float(x) for x in args.warm_mb.split(",")):
            warm, port = int(mb * (1 << 20)), 9100 + k
            srv = tb.spawn(tb.trainer.id, [*me, "serve", str(port), str(warm), str(args.payload), str(args.idle),
                                           str(len(targets))])
            procs = {t: tb.spawn(t, [*me, "fetch", tb.trainer.ip, str(port), str(warm)], stdout=subprocess.PIPE,
                                 text=True) for t in targets}
            out = {t: float(p.communicate(timeout=120)[0].strip() or "nan") for t, p in procs.items()}
            srv.wait(timeout=30)
            print(json.dumps({"warm_mb": mb, "payload": args.payload, "seconds": out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
