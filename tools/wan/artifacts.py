"""The benchmark's payloads: a real delta and a full snapshot from the codec workload, cached on disk.

A Qwen3-shaped model of ``preset`` (random init), fp32 master weights, AdamW at
``lr``; after ``warmup`` steps the bf16 cast is version 0 (a signed snapshot
artifact, plus the same weights as safetensors for the gloo baseline), one more
step gives version 1 (a signed delta artifact, the real encoded bytes) and
version 2, the same weights again as a full snapshot (so p2psync's snapshot
figure is taken on nodes that are already running, as the other methods' are).
"""

from __future__ import annotations

import json
from pathlib import Path


def make(work: Path, preset: str = "bench", lr: float = 1e-6, warmup: int = 3, delta_chunk: int = 256 << 10,
         snapshot_chunk: int = 4 << 20) -> dict:
    key = f"v3-{preset}-lr{lr:g}-w{warmup}-d{delta_chunk >> 10}k-s{snapshot_chunk >> 10}k"
    d = work / f"artifacts-{key}"
    meta_path = d / "meta.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    d.mkdir(parents=True, exist_ok=True)
    import torch
    from safetensors.torch import save_file

    from p2psync import keys
    from p2psync.artifact import build_manifest, write_file
    from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
    from p2psync.state import ModelState
    from p2psync.presets import build_model
    from trainer.workload import Workload

    priv = keys.generate()
    keys.write_pair(priv, d / "keys")
    torch.manual_seed(0)
    wl = Workload(build_model(preset), lr=lr)
    for _ in range(warmup):
        wl.step()
    base = ModelState(wl.published())
    save_file(base.tensors(), str(d / "weights.safetensors"))
    enc = encode_snapshot(base, CodecOptions(chunk_size=snapshot_chunk))
    m = build_manifest(enc, model_id=f"wan-{preset}", target_version=0, chunk_size=snapshot_chunk, private_key=priv)
    snap = d / "000000-snapshot.p2sa"
    write_file(snap, m, enc.chunks)
    wl.step()
    new = ModelState(wl.published())
    enc = encode_delta(base, new, CodecOptions(chunk_size=delta_chunk))
    m = build_manifest(enc, model_id=f"wan-{preset}", base_version=0, target_version=1, chunk_size=delta_chunk,
                       private_key=priv)
    delta = d / "000001-delta.p2sa"
    write_file(delta, m, enc.chunks)
    # Version 2: the same new weights as a full snapshot, so that a snapshot is also measured on warm nodes.
    enc = encode_snapshot(new, CodecOptions(chunk_size=snapshot_chunk))
    m = build_manifest(enc, model_id=f"wan-{preset}", target_version=2, chunk_size=snapshot_chunk, private_key=priv)
    snap2 = d / "000002-snapshot.p2sa"
    write_file(snap2, m, enc.chunks)
    numel = sum(t.numel() for t in wl.published().values())
    meta = {
        "preset": preset, "lr": lr, "warmup": warmup, "params": numel, "bf16_bytes": 2 * numel,
        "snapshot": str(snap), "snapshot_bytes": snap.stat().st_size,
        "delta": str(delta), "delta_bytes": delta.stat().st_size,
        "weights": str(d / "weights.safetensors"), "weights_bytes": (d / "weights.safetensors").stat().st_size,
        "snapshot2": str(snap2), "keys": str(d / "keys"),
        "fingerprints": {"0": base.fingerprint, "1": new.fingerprint, "2": new.fingerprint},
        "delta_chunk": delta_chunk, "snapshot_chunk": snapshot_chunk,
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def seed_state(art: dict) -> Path:
    """Version 0 as a node's state checkpoint (``VersionStore.save_state``), made once beside the artifacts:
    linked into a node's data directory, the node starts holding version 0 (it audits the fingerprint)."""
    from p2psync import keys
    from p2psync.artifact import ArtifactFile
    from p2psync.codec.decode import decode_state
    from p2psync.store import STATE_FILE, VersionStore

    d = Path(art["snapshot"]).parent / "seed"
    path = d / STATE_FILE
    if path.exists():
        return path
    public = keys.load_public(str(Path(art["keys"]) / "trainer.pub"))
    with ArtifactFile(art["snapshot"], public) as f:
        m = f.manifest
        state = decode_state(list(m.tensors), f.chunks(), len(m.chunks), m.target_fingerprint)
    assert state.fingerprint == art["fingerprints"]["0"]
    VersionStore.open(d, public).save_state(state, 0)
    return path
