"""The trainer's publish directory, fed by ``p2psync publish`` and by hand: every file is published, waits or is
skipped with a log line naming it, and a changed file is looked at again."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from nodeproc import CLI, Cluster, Workload, at_version, wait_for
from safetensors.torch import save_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def p2psync(*args: str) -> str:
    out = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return out.stdout


def checkpoint(path: Path, seed: int, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A small bf16 checkpoint; with ``base``, about 2 % of its elements changed."""
    g = torch.Generator().manual_seed(seed)
    if base is None:
        w = {"model.embed.weight": torch.randn(300, 256, generator=g).bfloat16(),
             "model.layers.0.mlp.weight": torch.randn(256, 256, generator=g).bfloat16(),
             "model.norm.weight": torch.ones(256, dtype=torch.bfloat16)}
    else:
        w = {k: v.clone() for k, v in base.items()}
        for t in w.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[idx] = (flat[idx].float() * 1.01 + 1e-3).bfloat16()
    save_file(w, path)
    return w


def fingerprint(path: Path) -> str:
    from p2psync import checkpoint as ck

    return ck.load(path).state.fingerprint


def test_publish_makes_version_0_then_deltas_that_reach_the_rollout_nodes(tmp_path, cluster: Cluster):
    tr = cluster.start("trainer", "trainer", publish=True)
    ro = cluster.start("rollout", "rollout", [tr.url])
    key, pub_dir = str(cluster.keydir / "trainer.key"), str(cluster.publish_dir)
    ck = [tmp_path / f"step{i}.safetensors" for i in range(3)]
    w = checkpoint(ck[0], 0)
    out = p2psync("publish", str(ck[0]), "--publish-dir", pub_dir, "--key", key)
    assert "version 0, a snapshot" in out
    for i in (1, 2):
        w = checkpoint(ck[i], i, w)
    out = p2psync("publish", str(ck[1]), "--publish-dir", pub_dir, "--key", key)
    assert "version 1, a delta from version 0" in out and str(ck[0]) in out
    for p in (tr, ro):
        s = wait_for(lambda p=p: at_version(p, 1), 90, f"{p.name} at version 1")
        assert s["fingerprint"] == fingerprint(ck[1])
    ck[1].unlink()  # version 1's checkpoint is gone: its weights come from the directory's files
    out = p2psync("publish", str(ck[2]), "--publish-dir", pub_dir, "--key", key)
    assert "version 2, a delta from version 1 (decoded from the publish directory" in out
    for p in (tr, ro):
        s = wait_for(lambda p=p: at_version(p, 2), 90, f"{p.name} at version 2")
        assert s["fingerprint"] == fingerprint(ck[2])
    names = sorted(p.name for p in cluster.publish_dir.iterdir())
    assert [n for n in names if not n.startswith(".")] == \
        ["00000000-snapshot.p2sa", "00000001-delta.p2sa", "00000002-delta.p2sa"]
    assert not any(n.endswith(".tmp") for n in names)
    # A snapshot file of its own, at the version asked for.
    out = p2psync("snapshot", str(ck[2]), "-o", str(tmp_path / "v2.p2sa"), "--key", key, "--version", "2")
    assert "snapshot version 2" in out and fingerprint(ck[2]) in out


def said(log: Path, text: str) -> int:
    return log.read_text().count(text)


def test_every_wait_and_skip_is_logged_and_a_changed_file_is_looked_at_again(tmp_path, cluster: Cluster):
    d = cluster.publish_dir
    staging = tmp_path / "staging"
    staging.mkdir()
    w = Workload(cluster.priv, numel=200_000)
    snap = w.snapshot(staging).read_bytes()
    w.step(d)  # version 1, before any version 0
    tr = cluster.start("trainer", "trainer", publish=True)
    wait_for(lambda: said(tr.log, "000001-delta.p2sa waits: a delta from version 0, and the trainer holds no "
                                  "version yet"), 60, "the wait for a snapshot logged")

    # Version 0 written in place, seen half written: skipped with one line, taken once complete.
    target = d / "000000-snapshot.p2sa"
    target.write_bytes(snap[: len(snap) // 2])
    wait_for(lambda: said(tr.log, "000000-snapshot.p2sa skipped: incomplete"), 60, "the incomplete file logged")
    target.write_bytes(snap)
    wait_for(lambda: at_version(tr, 1), 90, "trainer at version 1")
    assert said(tr.log, "000000-snapshot.p2sa skipped") == 1

    # A refused name is looked at again once a file is renamed onto it.
    (d / "next.p2sa").write_bytes(b"not an artifact")
    wait_for(lambda: said(tr.log, "next.p2sa skipped: "), 60, "the refused file logged")
    os.replace(w.step(staging), d / "next.p2sa")
    s = wait_for(lambda: at_version(tr, 2), 90, "trainer at version 2")
    assert s["fingerprint"] == w.fingerprints[2]

    # A delta made with --base-version left out (0 -> 1) is skipped, with the reason.
    base, new = tmp_path / "b.safetensors", tmp_path / "n.safetensors"
    save_file(w.state.tensors(), base)
    w2 = w.state.clone()
    w2.words("layer.0.b")[:10] ^= 1
    w2.invalidate()
    save_file(w2.tensors(), new)
    p2psync("delta", "encode", str(base), str(new), "-o", str(d / "stale.p2sa"), "--key",
            str(cluster.keydir / "trainer.key"))
    wait_for(lambda: said(tr.log, "stale.p2sa skipped: version 1 is not newer than the trainer's version 2"), 60,
             "the stale delta logged")

    # A delta from the right version but another base is refused before any announcement.
    p2psync("delta", "encode", str(new), str(base), "-o", str(d / "wrong.p2sa"), "--key",
            str(cluster.keydir / "trainer.key"), "--base-version", "2")
    wait_for(lambda: said(tr.log, "wrong.p2sa refused: its base is version 2 fingerprint"), 60,
             "the wrong base logged")
    assert said(tr.log, "withdrew") == 0
    w.step(d)
    s = wait_for(lambda: at_version(tr, 3), 90, "trainer at version 3")
    assert s["fingerprint"] == w.fingerprints[3]
