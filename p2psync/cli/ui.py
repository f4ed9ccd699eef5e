"""``p2psync ui``: the live page of a node, in a local browser, over mutual TLS (:mod:`p2psync.ui.tunnel`)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="open a node's live page through a local tunnel (mutual TLS to the node)")
    p.add_argument("--node", required=True, metavar="URL", help="the trainer node's address (https://HOST:PORT)")
    p.add_argument("--tls-dir", required=True, metavar="DIR",
                   help="a client certificate of the cluster CA (`p2psync cert issue --client --id NAME ...`)")
    p.add_argument("--port", type=int, default=0, help="local port on 127.0.0.1 (default: any free one)")
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding the cluster token, which the printed address carries (preferred over --token)")
    p.add_argument("--token", help="cluster token (visible in the process list; prefer --token-file)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    from urllib.parse import quote

    from p2psync.cli.plan import read_token
    from p2psync.errors import ConfigError
    from p2psync.transport.listen import bind
    from p2psync.transport.tls import Tls

    if not args.node.startswith("https://"):
        raise ConfigError("node", f"must be an https:// URL, got {args.node!r}")
    token = read_token(args)
    tls = Tls.for_client(args.tls_dir)
    sock = bind("127.0.0.1", args.port, "--port")
    # Opened once, the page keeps the token in a cookie and drops it from the address bar.
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/ui?token={quote(token, safe='')}", flush=True)

    async def main() -> None:
        from p2psync.ui.tunnel import Tunnel

        tunnel = await Tunnel.start(args.node, tls, sock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await tunnel.close()

    asyncio.run(main())
    return 0
