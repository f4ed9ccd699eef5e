"""The ``p2psync`` command.

Parsing happens before anything heavy is imported: each subcommand module
exposes ``add_parser(subparsers)`` (cheap: argparse only) and ``run(args)``
(which imports torch and friends inside), so ``p2psync --help`` answers fast.

The core's commands are the modules of this package named in :data:`COMMANDS`;
applications built on the core add theirs through the ``p2psync.commands`` entry
point group (``demo = "demo.cli"``: a module with ``add_parser``), so the core
never imports what is built on it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules under p2psync.cli, in help order.
COMMANDS = ["cert", "delta", "keygen", "node", "plan", "publish", "snapshot", "testbed", "ui", "viz", "warm"]
COMMAND_GROUP = "p2psync.commands"
"""Entry point group of the commands other packages add (value: a module with ``add_parser``)."""


def command_modules() -> list[str]:
    """The modules whose ``add_parser`` builds a subcommand: the core's, then the installed
    packages' (entry point group :data:`COMMAND_GROUP`), by name."""
    from importlib.metadata import entry_points

    added = sorted((ep.name, ep.value) for ep in entry_points(group=COMMAND_GROUP))
    return [f"p2psync.cli.{name}" for name in COMMANDS] + [value for _, value in added]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2psync",
        description="Bit-exact sparse weight sync for RL post-training over peer-to-peer relay trees.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of human text")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in command_modules():
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as exc:  # an installed package's command whose code is gone: say so, keep the rest
            print(f"p2psync: command module {module} not loaded ({exc})", file=sys.stderr)
    return parser


def _install_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        from p2psync.logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        fmt = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
        handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _install_logging(args.log_level, args.log_json)
    from p2psync.errors import P2PSyncError
    from topology.errors import TopologyError

    try:
        rc = args.run(args)
    except (P2PSyncError, TopologyError) as exc:
        print(f"p2psync: error: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # A path given on the command line (or in a file it names) that cannot be opened: one
        # line naming it; --log-level DEBUG shows where it was opened.
        logging.getLogger("p2psync.cli").debug("%s failed", args.command, exc_info=True)
        what = f"cannot open {exc.filename}: {exc.strerror}" if exc.filename else str(exc)
        print(f"p2psync: error: {what}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
