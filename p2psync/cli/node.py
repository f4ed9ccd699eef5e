"""``p2psync node``: run one peer (trainer, relay or rollout) until SIGTERM/SIGINT.

Prints the bound address (``http://host:port``) as one line on stdout once
listening, so that a process started with ``--listen.port=0`` can be found.
Any ``--section.field=value`` argument overrides the config file.
"""

from __future__ import annotations

import argparse
import re
import sys

_OVERRIDE = re.compile(r"^--([a-z_][a-z0-9_-]*)((\.[a-z_][a-z0-9_-]*)*)(=.*)?$")
_DECLARED = {"role", "config", "id", "publish_dir", "help"}


def _is_override(arg: str) -> bool:
    from dataclasses import fields

    from p2psync.config import NodeConfig

    m = _OVERRIDE.match(arg)
    if not m:
        return False
    head = m.group(1).replace("-", "_")
    return bool(m.group(2)) or (head not in _DECLARED and head in {f.name for f in fields(NodeConfig)})


class _NodeParser(argparse.ArgumentParser):
    """Collects ``--a.b=value`` / ``--a.b value`` overrides that argparse cannot declare up front."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        rest, overrides = [], []
        i = 0
        while i < len(args):
            a = args[i]
            if _is_override(a):
                overrides.append(a)
                if "=" not in a and i + 1 < len(args):
                    overrides.append(args[i + 1])
                    i += 1
            else:
                rest.append(a)
            i += 1
        ns, extra = super().parse_known_args(rest, namespace)
        ns.overrides = overrides
        return ns, extra


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "node", help="run a peer: trainer (publishes), relay (forwards) or rollout (applies)",
        description="Run one p2psync peer. Settings come from --config FILE; any --section.field=value "
                    "(e.g. --listen.port=0 --limits.stall_timeout=5) overrides it.")
    # The shared subparser factory builds plain ArgumentParsers; ours must also accept dotted overrides.
    p.__class__ = _NodeParser
    p.add_argument("--role", choices=["trainer", "relay", "rollout"], help="overrides the config's role")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--id", help="node id (overrides the config)")
    p.add_argument("--publish-dir", help="trainer: publish every artifact file appearing here, in version order")
    p.set_defaults(run=run, overrides=[])


def run(args: argparse.Namespace) -> int:
    import asyncio

    from p2psync import config

    cfg = config.load(args.config, args.overrides, role=args.role, id=args.id)
    return asyncio.run(_main(cfg, args.publish_dir))


async def _main(cfg, publish_dir: str | None) -> int:
    import asyncio
    import signal

    from p2psync.transport.listen import advertised, bind

    # Listen and say where before the heavy imports (aiohttp, numba, torch): connections made
    # meanwhile wait in the accept backlog, so the address is usable from this line on.
    sock = bind(cfg.listen.host, cfg.listen.port)
    print(advertised(sock, cfg.listen.host, cfg.listen.advertise), flush=True)

    from p2psync.node import Node

    node = await Node.create(cfg, publish_dir=publish_dir, sock=sock)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(node.wait_stopped(), name="node-stopped")
    signalled = asyncio.create_task(stop.wait(), name="signal")
    await asyncio.wait({stopped, signalled}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    signalled.cancel()
    await node.close()
    return 1 if node.failure is not None else 0
