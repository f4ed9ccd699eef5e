"""``p2psync snapshot CKPT -o FILE --key trainer.key [--version N]``: a signed snapshot of a checkpoint."""

from __future__ import annotations

import argparse

from p2psync.cli.delta import parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshot", help="a signed snapshot (full weights) of a checkpoint, e.g. version 0",
                       description="Write a signed snapshot of a checkpoint (.safetensors file or Hugging Face "
                                   "folder). The file appears by rename, so FILE may be in a --publish-dir.")
    p.add_argument("checkpoint", metavar="CKPT", help=".safetensors file or Hugging Face model folder")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="artifact file to write")
    p.add_argument("--key", required=True, help="trainer private key (PEM) to sign with")
    p.add_argument("--version", type=int, default=0, help="the version it is (default 0)")
    p.add_argument("--model-id", help="model id in the manifest (default: CKPT's file or folder name)")
    p.add_argument("--chunk-size", type=parse_size, default="4MiB", help="chunk size (default 4MiB)")
    p.add_argument("--zstd-level", type=int, default=3)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2psync import checkpoint, keys
    from p2psync.codec.encode import CodecOptions
    from p2psync.errors import ConfigError
    from p2psync.publish_files import write_snapshot

    if args.version < 0:
        raise ConfigError("--version", f"must be 0 or more, got {args.version}")
    opts = CodecOptions(chunk_size=args.chunk_size, zstd_level=args.zstd_level)
    private = keys.load_private(args.key)
    state = checkpoint.load(args.checkpoint).state
    out = Path(args.output)
    m = write_snapshot(state, out, opts, model_id=args.model_id or Path(args.checkpoint).name, version=args.version,
                       private_key=private)
    print(f"{out}: snapshot version {m.target_version}, {m.payload_bytes:,} bytes in {len(m.chunks)} chunks, "
          f"fingerprint {m.target_fingerprint}, signed {m.key_id}")
    return 0
