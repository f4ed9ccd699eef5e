"""``p2psync keygen``: an Ed25519 key pair for the trainer and the cluster CA (mutual TLS)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="make the trainer's Ed25519 signing key pair and the cluster CA")
    p.add_argument("-o", "--output", default=".", help="directory for NAME.key and NAME.pub (default .)")
    p.add_argument("--name", default="trainer", help="file stem (default trainer)")
    p.add_argument("--no-ca", action="store_true", help="skip the cluster CA (ca.crt, ca.key)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2psync import keys

    priv = keys.generate()
    priv_path, pub_path = keys.write_pair(priv, Path(args.output), args.name)
    print(f"private key: {priv_path} (keep it on the trainer only)")
    print(f"public key:  {pub_path} (give it to every node)")
    print(f"key id:      {keys.key_id(priv.public_key())}")
    if not args.no_ca:
        from p2psync import certs

        ca = certs.create_ca(Path(args.output))
        print(f"cluster CA:  {ca} (ca.key beside it: keep it with the operator; issue node certificates "
              f"with `p2psync cert issue --ca {args.output} --id ID --region REGION -o DIR`)")
    return 0
