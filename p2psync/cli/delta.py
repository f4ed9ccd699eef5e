"""``p2psync delta encode|apply|inspect`` on standard checkpoints."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from p2psync.artifact import ArtifactFile


class _TensorRow(TypedDict):
    name: str
    dtype: str
    shape: list[int]
    numel: int
    changed: int
    codings: dict[str, int]


def parse_size(text: str) -> int:
    """``4MiB``, ``512KiB``, ``1048576`` -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def _add_verify_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pubkey", help="trainer public key (PEM) to verify the manifest signature")
    p.add_argument(
        "--insecure-allow-unsigned",
        action="store_true",
        help="accept artifacts that are unsigned or whose signature is not checked (no --pubkey)",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("delta", help="encode, apply or inspect bit-exact sparse deltas between checkpoints")
    dsub = p.add_subparsers(dest="delta_command", metavar="ACTION", required=True)

    e = dsub.add_parser("encode", help="BASE NEW -> DELTA (BASE/NEW: .safetensors files or HF model folders)")
    e.add_argument("base")
    e.add_argument("new")
    e.add_argument("-o", "--output", required=True, help="artifact file to write")
    e.add_argument("--key", help="trainer private key (PEM) to sign with; without it the artifact is unsigned")
    e.add_argument("--model-id", help="model id recorded in the manifest (default: NEW's file or folder name)")
    e.add_argument("--base-version", type=int, default=0)
    e.add_argument("--target-version", type=int, help="default: base version + 1")
    e.add_argument("--chunk-size", type=parse_size, default="4MiB", help="chunk size (default 4MiB)")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--zstd-level", type=int, default=3)
    e.set_defaults(run=run_encode)

    a = dsub.add_parser("apply", help="BASE DELTA -> OUT, bit-identical to the NEW the delta was made from "
                                      "(also a trainer's published delta on its saved checkpoint)")
    a.add_argument("base")
    a.add_argument("delta")
    a.add_argument("-o", "--output", required=True, help=".safetensors file or folder (keeps BASE's shard layout)")
    a.add_argument("--threads", type=int, default=2)
    _add_verify_opts(a)
    a.set_defaults(run=run_apply)

    i = dsub.add_parser("inspect", help="tensors, changed elements, bytes per stream and per segment coding, "
                                        "ratio, signature status")
    i.add_argument("delta")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--pubkey", help="trainer public key (PEM) to check the signature against")
    i.add_argument("--all", action="store_true", help="list every tensor, not only the 20 with most changes")
    i.set_defaults(run=run_inspect)


def run_encode(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from p2psync import artifact, checkpoint, keys
    from p2psync.codec.encode import CodecOptions, encode_delta

    opts = CodecOptions(chunk_size=args.chunk_size, threads=args.threads, zstd_level=args.zstd_level)
    private = keys.load_private(args.key) if args.key else None
    base = checkpoint.load(args.base).state
    new = checkpoint.load(args.new).state
    t0 = time.perf_counter()
    enc = encode_delta(base, new, opts)
    t1 = time.perf_counter()
    target = args.target_version if args.target_version is not None else args.base_version + 1
    m = artifact.build_manifest(
        enc,
        model_id=args.model_id or Path(args.new).name,
        base_version=args.base_version,
        target_version=target,
        chunk_size=opts.chunk_size,
        private_key=private,
    )
    artifact.write_file(args.output, m, enc.chunks)
    changed = sum(enc.changed)
    numel = sum(s.numel for s in enc.specs)
    print(
        f"{args.output}: {m.payload_bytes:,} bytes in {len(m.chunks)} chunks, {changed:,} of {numel:,} elements "
        f"changed ({100 * changed / max(1, numel):.3f} %), {m.model_bytes / max(1, m.payload_bytes):.1f}x smaller "
        f"than the full weights, encoded in {t1 - t0:.2f} s, {'signed ' + m.key_id if private else 'UNSIGNED'}"
    )
    return 0


def _open(args: argparse.Namespace, path: str) -> ArtifactFile:
    from p2psync import artifact, keys

    public = keys.load_public(args.pubkey) if args.pubkey else None
    return artifact.ArtifactFile(path, public, allow_unsigned=args.insecure_allow_unsigned)


def run_apply(args: argparse.Namespace) -> int:
    import time

    from p2psync import artifact, checkpoint
    from p2psync.errors import CodecError

    with _open(args, args.delta) as art:
        if art.manifest.kind != "delta":
            raise CodecError(f"{args.delta} is a {art.manifest.kind}, not a delta")
        ck = checkpoint.load(args.base)
        state = ck.state  # ordered by name; a trainer's table is in its own order (same memory)
        table = art.manifest.tensors
        if [s.name for s in table] != list(state) and sorted(s.name for s in table) == list(state):
            state = checkpoint.in_table(state, table)
        t0 = time.perf_counter()
        fp = artifact.apply_file(state, art, args.threads)
        t1 = time.perf_counter()
    checkpoint.save(ck.state, args.output, like=ck)
    print(f"{args.output}: version {art.manifest.target_version}, fingerprint {fp} verified, applied in {t1 - t0:.2f} s")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    import json

    from p2psync import artifact, keys
    from p2psync.codec.decode import chunk_stats, split_chunk
    from p2psync.codec.dense import coding_of
    from p2psync.codec.segment import SegmentStats
    from p2psync.errors import SignatureError

    with artifact.ArtifactFile(args.delta, None, allow_unsigned=True) as art:
        m = art.manifest
        if not m.signed:
            sig = "unsigned"
        elif not args.pubkey:
            sig = f"signed by {m.key_id} (not checked: no --pubkey)"
        else:
            try:
                m.verify(keys.load_public(args.pubkey))
                sig = f"valid (key {m.key_id})"
            except SignatureError as exc:
                sig = f"INVALID: {exc}"
        streams = SegmentStats()
        # per tensor and in all: segment bytes by the coding each segment chose
        by_tensor: dict[int, dict[str, int]] = {}
        codings: dict[str, dict[str, int]] = {}
        for _, c in art.chunks():  # also verifies every chunk hash
            streams.add(chunk_stats(c))
            for seg in split_chunk(c):
                ti, name = coding_of(seg)
                per = by_tensor.setdefault(ti, {})
                per[name] = per.get(name, 0) + len(seg)
                total = codings.setdefault(name, {"segments": 0, "bytes": 0})
                total["segments"] += 1
                total["bytes"] += len(seg)
    full = m.model_bytes
    rows: list[_TensorRow] = []
    for i, t in enumerate(m.tensors):
        n = m.changed[i] if m.changed else t.numel
        rows.append({"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "numel": t.numel, "changed": n,
                     "codings": by_tensor.get(i, {})})
    ratio = full / max(1, m.payload_bytes)
    changed = sum(r["changed"] for r in rows)
    numel = sum(r["numel"] for r in rows)
    stream_bytes = {"positions": streams.positions, "residuals": streams.residuals, "raw": streams.raw,
                    "headers": streams.header}
    report = {
        "kind": m.kind,
        "model_id": m.model_id,
        "base_version": m.base_version,
        "target_version": m.target_version,
        "base_fingerprint": m.base_fingerprint,
        "target_fingerprint": m.target_fingerprint,
        "signature": sig,
        "created": m.created,
        "chunks": len(m.chunks),
        "chunk_size": m.chunk_size,
        "payload_bytes": m.payload_bytes,
        "full_bytes": full,
        "ratio": ratio,
        "changed": changed,
        "numel": numel,
        "stream_bytes": stream_bytes,
        "codings": codings,
        "tensors": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{m.kind}[/] {m.model_id}: version {m.base_version} -> {m.target_version}")
    con.print(f"signature: {sig}")
    con.print(f"payload {m.payload_bytes:,} B in {len(m.chunks)} chunks vs full {full:,} B: "
              f"[bold]{ratio:.1f}x[/] smaller; changed {changed:,} of {numel:,} "
              f"elements ({100 * changed / max(1, numel):.3f} %)")
    con.print("streams: " + ", ".join(f"{k} {v:,} B" for k, v in stream_bytes.items()))
    con.print("segment codings: " + ", ".join(f"{k} {v['segments']} segments {v['bytes']:,} B"
                                             for k, v in sorted(codings.items())))
    tab = Table("tensor", "dtype", "shape", "changed", "%", "coding")
    shown = rows if args.all else sorted(rows, key=lambda r: -r["changed"])[:20]
    for r in shown:
        tab.add_row(r["name"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar", f"{r['changed']:,}",
                    f"{100 * r['changed'] / max(1, r['numel']):.3f}", "+".join(sorted(r["codings"])) or "-")
    con.print(tab)
    if len(shown) < len(rows):
        con.print(f"({len(rows) - len(shown)} more tensors; --all lists them)")
    return 0
