"""``p2psync demo --codec``: train a small model for a few steps and ship every step as a signed delta file.

The receiver side starts from a snapshot artifact and applies each delta file
after verifying its signature and chunk hashes; every step it must hold the
trainer's exact bits, or the command exits non-zero.
"""

from __future__ import annotations

import argparse


def run_codec(args: argparse.Namespace) -> int:
    """Train, encode each step as a signed delta file, apply it on a receiver, verify bit for bit."""
    import shutil
    import time
    from pathlib import Path

    import torch
    from rich.console import Console
    from rich.table import Table

    from p2psync import artifact, keys
    from p2psync.cli.delta import parse_size
    from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
    from p2psync.state import ModelState
    from p2psync.presets import build_model
    from trainer.workload import Workload

    con = Console()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    ship = out / "ship"
    ship.mkdir(parents=True)
    priv = keys.generate()
    keys.write_pair(priv, out / "keys")
    pub = keys.load_public(out / "keys" / "trainer.pub")
    opts = CodecOptions(chunk_size=parse_size(args.chunk_size), threads=args.threads)

    torch.set_num_threads(args.threads)
    model = build_model(args.preset, args.model_path)
    work = Workload(model, lr=args.lr)
    trainer_state = ModelState(work.published())
    full = trainer_state.nbytes
    con.print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(trainer_state)} tensors, {full / 1e6:.1f} MB in bf16; lr {args.lr:g}")

    # Version 0 travels as a snapshot; the receiver is built only from what it reads off disk.
    snap = encode_snapshot(trainer_state, opts)
    m = artifact.build_manifest(snap, model_id="demo", target_version=0, chunk_size=opts.chunk_size,
                                private_key=priv)
    artifact.write_file(ship / "v0000.p2s", m, snap.chunks)
    with artifact.ArtifactFile(ship / "v0000.p2s", pub) as art:
        receiver = ModelState.empty_like(list(art.manifest.tensors))
        artifact.apply_file(receiver, art, args.threads)
    con.print(f"v0 snapshot: {m.payload_bytes / 1e6:.2f} MB ({full / m.payload_bytes:.2f}x), receiver fingerprint "
              f"{receiver.fingerprint[:16]} == trainer {trainer_state.fingerprint[:16]}")

    tab = Table("step", "loss", "changed %", "delta bytes", "ratio vs bf16", "encode ms", "apply ms", "bit-exact",
                title="each optimizer step shipped as a signed delta file")
    ok = receiver.fingerprint == trainer_state.fingerprint
    total_payload = 0
    for _ in range(args.steps):
        info = work.step()
        new_state = ModelState(work.published())
        t0 = time.perf_counter()
        enc = encode_delta(trainer_state, new_state, opts)
        m = artifact.build_manifest(enc, model_id="demo", base_version=info.step - 1, target_version=info.step,
                                    chunk_size=opts.chunk_size, private_key=priv)
        t1 = time.perf_counter()
        path = ship / f"v{info.step:04d}.p2s"
        artifact.write_file(path, m, enc.chunks)
        t2 = time.perf_counter()
        with artifact.ArtifactFile(path, pub) as art:
            artifact.apply_file(receiver, art, args.threads)
        t3 = time.perf_counter()
        trainer_state = new_state
        exact = receiver.fingerprint == trainer_state.fingerprint and all(
            torch.equal(torch.from_numpy(receiver.words(n)),
                        torch.from_numpy(trainer_state.words(n))) for n in trainer_state)
        ok &= exact
        total_payload += m.payload_bytes
        changed = sum(enc.changed)
        numel = sum(s.numel for s in enc.specs)
        tab.add_row(str(info.step), f"{info.loss:.3f}", f"{100 * changed / numel:.3f}", f"{m.payload_bytes:,}",
                    f"{full / m.payload_bytes:.0f}x", f"{1000 * (t1 - t0):.0f}", f"{1000 * (t3 - t2):.0f}",
                    "yes" if exact else "[red]NO[/]")
    con.print(tab)
    audit = receiver.audit() == trainer_state.audit()
    ok &= audit
    con.print(f"{args.steps} steps: {total_payload:,} delta bytes vs {args.steps * full:,} for full-weight "
              f"broadcast ({args.steps * full / max(1, total_payload):.0f}x less); full audit "
              f"{'matches' if audit else '[red]DIFFERS[/]'}; artifacts in {ship}/")
    if not ok:
        con.print("[red]FAILED: the receiver does not hold the trainer's bits[/]")
        return 1
    return 0
