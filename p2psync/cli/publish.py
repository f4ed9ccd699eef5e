"""``p2psync publish CKPT --publish-dir DIR --key trainer.key``: a checkpoint as the trainer's next version.

A signed snapshot (version 0) when the directory holds no version yet, else a signed delta
against the newest version there; written under a name the trainer's watcher ignores and
renamed into place. How the held version and its weights are found: :mod:`p2psync.publish_files`.
"""

from __future__ import annotations

import argparse

from p2psync.cli.delta import parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish", help="a checkpoint as the next version in a trainer's --publish-dir (snapshot first, then deltas)",
        description="Turn a checkpoint (.safetensors file or Hugging Face folder) into the next version in a "
                    "trainer node's publish directory: a signed snapshot (version 0) when it holds none, else a "
                    "signed delta against the newest version there. The file appears by rename.")
    p.add_argument("checkpoint", metavar="CKPT", help=".safetensors file or Hugging Face model folder")
    p.add_argument("--publish-dir", required=True, metavar="DIR", help="the trainer node's --publish-dir")
    p.add_argument("--key", required=True, help="trainer private key (PEM) to sign with")
    p.add_argument("--base", metavar="CKPT",
                   help="checkpoint holding the newest version's weights (default: the one recorded for it, "
                        "else decoded from the directory's files)")
    p.add_argument("--model-id", help="model id in the manifest (default: the directory's, else CKPT's name)")
    p.add_argument("--chunk-size", type=parse_size, default="4MiB", help="chunk size (default 4MiB)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--zstd-level", type=int, default=3)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from p2psync import keys, publish_files
    from p2psync.codec.encode import CodecOptions

    opts = CodecOptions(chunk_size=args.chunk_size, threads=args.threads, zstd_level=args.zstd_level)
    private = keys.load_private(args.key)
    t0 = time.perf_counter()
    m, out, how = publish_files.publish(args.checkpoint, Path(args.publish_dir), private, opts, base=args.base,
                                        model_id=args.model_id)
    print(f"{out}: version {m.target_version}, {how}; {m.payload_bytes:,} bytes, fingerprint "
          f"{m.target_fingerprint}, signed {m.key_id}, in {time.perf_counter() - t0:.2f} s")
    return 0
