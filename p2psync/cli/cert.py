"""``p2psync cert``: issue and revoke the certificates nodes and clients present (mutual TLS).

``p2psync keygen -o keys`` makes the cluster CA (``keys/ca.crt``, ``keys/ca.key``) beside the
trainer key; then, per node::

    p2psync cert issue --ca keys --id r1 --region eu --host r1.example.org --host 10.0.0.3 -o run/r1/tls
    p2psync cert issue --ca keys --id operator --client -o op-tls    # the CLI, tools, a browser proxy

A node certificate names the hosts the node is reached at (``--host``, beside localhost,
127.0.0.1 and ::1), so that standard TLS clients verify it by host name (``curl --cacert``).

``p2psync cert revoke --id r1 --list keys/revoked`` adds a node id to the revocation list the
trainer reads (``tls.revoked``) and gossips; every node cuts the id off within a gossip round.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cert", help="issue or revoke node and client certificates of the cluster CA")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    i = verbs.add_parser("issue", help="issue a certificate for a node id and region (or a client)")
    i.add_argument("--ca", required=True, metavar="DIR", help="folder with ca.crt and ca.key (p2psync keygen -o DIR)")
    i.add_argument("--id", required=True, help="the node id the certificate names (must match the node's id)")
    i.add_argument("--region", default="default", help="the node's region (must match its region; default default)")
    i.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder for ca.crt, node.crt, node.key (a node's default: <data_dir>/tls)")
    i.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="a DNS name or IP address the node is reached at (repeatable; always named besides: "
                        "localhost, 127.0.0.1, ::1), for standard TLS clients' host-name check (curl --cacert)")
    i.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    i.add_argument("--client", action="store_true",
                   help="client-only certificate (CLI, tools, operator): may call nodes, never serve or act as one")
    i.set_defaults(run=run_issue)
    r = verbs.add_parser("revoke", help="add a node id to the trainer's revocation list (tls.revoked)")
    r.add_argument("--id", required=True, help="node id to revoke")
    r.add_argument("--list", required=True, metavar="FILE", help="the revocation list the trainer reads (tls.revoked)")
    r.set_defaults(run=run_revoke)


def run_issue(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2psync import certs
    from p2psync.errors import ConfigError

    if not 1 <= args.days <= 36500:
        raise ConfigError("days", f"must be 1..36500, got {args.days}")
    path = certs.issue(Path(args.ca), args.id, args.region, Path(args.output), days=args.days,
                       client_only=args.client, hosts=args.host)
    ident = certs.identity_of(path)
    what = "client" if ident.client_only else f"node {ident.id!r} in region {ident.region!r}"
    hosts = "" if ident.client_only else f", hosts {', '.join(certs.hosts_of(path))}"
    print(f"certificate for {what}: {path} (key {Path(args.output) / certs.NODE_KEY}, serial {ident.serial:x}"
          f"{hosts})")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2psync import certs
    from p2psync.transport.revocation import read_list

    certs.check_id(args.id)
    path = Path(args.list)
    ids = read_list(path)
    if args.id in ids:
        print(f"{args.id} is already revoked in {path}")
        return 0
    with open(path, "a") as f:
        f.write(args.id + "\n")
    print(f"revoked {args.id}: the trainer gossips {path} within a gossip round (tls.revoked = {str(path)!r})")
    return 0
