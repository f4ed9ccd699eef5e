"""``p2psync publish`` without a node: which version the directory holds, and what the next one is made against."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from p2psync import checkpoint, keys, publish_files
from p2psync.codec.encode import CodecOptions
from p2psync.publish_files import held, publish

OPTS = CodecOptions(chunk_size=64 << 10)


def steps(tmp_path: Path, n: int) -> list[Path]:
    g = torch.Generator().manual_seed(3)
    w = {"b.weight": torch.randn(40_000, generator=g).bfloat16(), "a.weight": torch.randn(300, 7, generator=g).bfloat16()}
    out = []
    for i in range(n):
        for t in w.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 40,), generator=g)
            flat[idx] = (flat[idx].float() * 1.01 + 1e-3).bfloat16()
        path = tmp_path / f"step{i}.safetensors"
        save_file(w, path)
        out.append(path)
    return out


def test_snapshot_first_then_deltas_and_a_stray_file_is_not_the_held_version(tmp_path):
    key = keys.generate()
    d = tmp_path / "publish"
    d.mkdir()
    ck = steps(tmp_path, 4)
    m0, f0, how0 = publish(str(ck[0]), d, key, OPTS)
    assert (m0.kind, m0.target_version, f0.name) == ("snapshot", 0, "00000000-snapshot.p2sa") and "snapshot" in how0
    m1, _, how1 = publish(str(ck[1]), d, key, OPTS)
    assert (m1.kind, m1.base_version, m1.target_version) == ("delta", 0, 1) and str(ck[0].resolve()) in how1
    assert m1.base_fingerprint == m0.target_fingerprint == checkpoint.load(ck[0]).state.fingerprint
    # A delta against another base (as a trainer would refuse it) lies in the directory too.
    stray_src = d / ".stray-src"
    stray_src.mkdir()
    publish(str(ck[3]), stray_src, key, OPTS)
    stray, _, _ = publish(str(ck[2]), stray_src, key, OPTS)
    (stray_src / "00000001-delta.p2sa").rename(d / "zz-stray.p2sa")
    top, _ = held(d, key.public_key())
    assert top is not None and top.version == 1 and top.fingerprint == m1.target_fingerprint
    ck[1].unlink()  # version 1's checkpoint is gone: decoded from the directory
    m2, _, how2 = publish(str(ck[2]), d, key, OPTS)
    assert (m2.base_version, m2.target_version) == (1, 2) and "decoded from the publish directory" in how2
    assert m2.base_fingerprint == m1.target_fingerprint
    assert m2.target_fingerprint == checkpoint.load(ck[2]).state.fingerprint
    assert publish_files.read_record(d).version == 2
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]
