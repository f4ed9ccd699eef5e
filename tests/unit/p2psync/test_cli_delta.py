"""``p2psync keygen`` and ``p2psync delta encode|apply|inspect`` on real checkpoint files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2psync.cli import main


def weights(seed: int, change: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {
        "model.embed.weight": (torch.randn(500, 64, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.weight": (torch.randn(128, 64, generator=g) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(64, dtype=torch.float32),
        "model.step": torch.tensor(7, dtype=torch.int64),
    }
    if change:
        g2 = torch.Generator().manual_seed(seed)
        for k in ("model.embed.weight", "model.layers.0.mlp.weight"):
            upd = w[k].float() + 1e-3 * torch.randn(w[k].shape, generator=g2)
            w[k] = upd.to(torch.bfloat16)
        w["model.norm.weight"][3] = float("nan")
        w["model.step"] += 1
    return w


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].view(-1).view(torch.uint8).equal(b[k].view(-1).view(torch.uint8)), k


@pytest.fixture
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    assert main(["keygen", "-o", str(tmp_path / "keys")]) == 0
    return tmp_path / "keys" / "trainer.key", tmp_path / "keys" / "trainer.pub"


def test_single_file_roundtrip_and_inspect(tmp_path, keypair, capsys):
    key, pub = keypair
    save_file(weights(0, False), tmp_path / "base.safetensors")
    save_file(weights(1, True), tmp_path / "new.safetensors")
    d = tmp_path / "step.p2s"
    assert main(["delta", "encode", str(tmp_path / "base.safetensors"), str(tmp_path / "new.safetensors"), "-o",
                 str(d), "--key", str(key), "--base-version", "5"]) == 0
    assert main(["delta", "apply", str(tmp_path / "base.safetensors"), str(d), "-o", str(tmp_path / "out.safetensors"),
                 "--pubkey", str(pub)]) == 0
    assert_bit_identical(load_file(tmp_path / "out.safetensors"), load_file(tmp_path / "new.safetensors"))
    capsys.readouterr()
    assert main(["delta", "inspect", str(d), "--json", "--pubkey", str(pub)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["base_version"] == 5 and rep["target_version"] == 6
    assert rep["signature"].startswith("valid")
    # ~96 % of the bf16 words moved by a few ULPs: coded as their integer difference (dense), smaller
    # than positions plus residuals
    assert rep["ratio"] > 1 and rep["stream_bytes"]["raw"] > 0
    assert "dense-diff-zstd" in rep["codings"]
    changed = {t["name"]: t["changed"] for t in rep["tensors"]}
    assert changed["model.norm.weight"] == 1 and changed["model.step"] == 1
    assert main(["delta", "inspect", str(d)]) == 0
    assert "signed by" in capsys.readouterr().out


def test_sharded_folder_keeps_layout_and_config(tmp_path, keypair):
    key, pub = keypair
    for name, change in (("base", False), ("new", True)):
        folder = tmp_path / name
        folder.mkdir()
        w = weights(2, change)
        shard1 = {k: v for k, v in w.items() if "embed" in k}
        shard2 = {k: v for k, v in w.items() if "embed" not in k}
        save_file(shard1, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
        save_file(shard2, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in shard1},
                                                **{k: "model-00002-of-00002.safetensors" for k in shard2}}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        (folder / "config.json").write_text('{"model_type": "qwen3"}')
    d = tmp_path / "d.p2s"
    assert main(["delta", "encode", str(tmp_path / "base"), str(tmp_path / "new"), "-o", str(d), "--key", str(key)]) == 0
    out = tmp_path / "out"
    assert main(["delta", "apply", str(tmp_path / "base"), str(d), "-o", str(out), "--pubkey", str(pub)]) == 0
    assert (out / "config.json").read_text() == '{"model_type": "qwen3"}'
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert_bit_identical(load_file(out / shard), load_file(tmp_path / "new" / shard))
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() == \
        json.loads((tmp_path / "new" / "model.safetensors.index.json").read_text())["weight_map"].keys()


def test_unsigned_forged_and_wrong_base_are_refused_without_output(tmp_path, keypair, capsys):
    key, pub = keypair
    save_file(weights(0, False), tmp_path / "base.safetensors")
    save_file(weights(1, True), tmp_path / "new.safetensors")
    base, new = str(tmp_path / "base.safetensors"), str(tmp_path / "new.safetensors")
    unsigned, signed = tmp_path / "u.p2s", tmp_path / "s.p2s"
    assert main(["delta", "encode", base, new, "-o", str(unsigned)]) == 0
    assert main(["delta", "encode", base, new, "-o", str(signed), "--key", str(key)]) == 0
    out = tmp_path / "out.safetensors"

    assert main(["delta", "apply", base, str(unsigned), "-o", str(out), "--pubkey", str(pub)]) == 1
    assert "unsigned" in capsys.readouterr().err and not out.exists()
    assert main(["delta", "apply", base, str(signed), "-o", str(out)]) == 1
    assert "no public key" in capsys.readouterr().err and not out.exists()

    raw = bytearray(signed.read_bytes())
    i = raw.index(b'"target_version":1')
    raw[i + len(b'"target_version":')] = ord("2")  # forge the version, keep the old signature
    forged = tmp_path / "f.p2s"
    forged.write_bytes(bytes(raw))
    assert main(["delta", "apply", base, str(forged), "-o", str(out), "--pubkey", str(pub)]) == 1
    assert "signature" in capsys.readouterr().err and not out.exists()

    assert main(["delta", "apply", new, str(signed), "-o", str(out), "--pubkey", str(pub)]) == 1
    assert "wrong base" in capsys.readouterr().err and not out.exists()

    assert main(["delta", "apply", base, str(unsigned), "-o", str(out), "--insecure-allow-unsigned"]) == 0
    assert_bit_identical(load_file(out), load_file(new))


def test_help_answers_without_importing_torch():
    code = "import sys; from p2psync.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"format": "pt", "step": "7", "zz": "last"}])
def test_apply_writes_a_file_byte_identical_to_new(tmp_path, keypair, metadata):
    """Files written by safetensors, with and without header metadata: the output is NEW byte for byte.

    safetensors writes a ``__metadata__`` of two or more entries in an order that changes from one
    write to the next (a Rust HashMap), so there the header can differ from NEW's in that order only."""
    key, pub = keypair
    base, new, out, d = (tmp_path / n for n in ("base.safetensors", "new.safetensors", "out.safetensors", "d.p2s"))
    save_file(weights(0, False), base, metadata=metadata)
    save_file(weights(1, True), new, metadata=metadata)
    assert main(["delta", "encode", str(base), str(new), "-o", str(d), "--key", str(key)]) == 0
    assert main(["delta", "apply", str(base), str(d), "-o", str(out), "--pubkey", str(pub)]) == 0
    if metadata is None or len(metadata) < 2:
        assert out.read_bytes() == new.read_bytes()
    else:
        assert split_safetensors(out.read_bytes()) == split_safetensors(new.read_bytes())
        head = 8 + int.from_bytes(base.read_bytes()[:8], "little")
        assert out.read_bytes()[:head] == base.read_bytes()[:head]  # BASE's header, byte for byte


def test_apply_keeps_a_sharded_folder_byte_identical(tmp_path, keypair):
    key, pub = keypair
    for name, change in (("base", False), ("new", True)):
        folder = tmp_path / name
        folder.mkdir()
        w = weights(3, change)
        shards = {"model-00001-of-00002.safetensors": {k: v for k, v in w.items() if "embed" in k},
                  "model-00002-of-00002.safetensors": {k: v for k, v in w.items() if "embed" not in k}}
        for shard, part in shards.items():
            save_file(part, folder / shard, metadata={"format": "pt"})
        index = {"metadata": {"total_size": 1}, "weight_map": {k: s for s, p in shards.items() for k in p}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    d, out = tmp_path / "d.p2s", tmp_path / "out"
    assert main(["delta", "encode", str(tmp_path / "base"), str(tmp_path / "new"), "-o", str(d), "--key", str(key)]) == 0
    assert main(["delta", "apply", str(tmp_path / "base"), str(d), "-o", str(out), "--pubkey", str(pub)]) == 0
    for f in (tmp_path / "new").iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_inspect_names_the_coding_each_segment_chose(tmp_path, capsys):
    """An adapter's first step (``lora_B`` leaves its zero init: every word changes) is coded
    densely and costs less than its raw words; a tensor with a few changes stays sparse."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(8, 512, generator=g) * 0.02).to(torch.bfloat16)
    base = {"base_model.model.l.lora_A.weight": a, "base_model.model.l.lora_B.weight": torch.zeros(512, 8,
                                                                                                 dtype=torch.bfloat16)}
    a2 = a.clone()
    a2.view(-1)[::50] = 0.5
    new = {"base_model.model.l.lora_A.weight": a2,
           "base_model.model.l.lora_B.weight": (torch.randn(512, 8, generator=g) * 1e-3).to(torch.bfloat16)}
    save_file(base, tmp_path / "base.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    d = tmp_path / "step.p2s"
    assert main(["delta", "encode", str(tmp_path / "base.safetensors"), str(tmp_path / "new.safetensors"),
                 "-o", str(d)]) == 0
    capsys.readouterr()
    assert main(["delta", "inspect", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    codings = {t["name"]: t["codings"] for t in rep["tensors"]}
    assert set(codings["base_model.model.l.lora_A.weight"]) == {"sparse"}
    dense_b = codings["base_model.model.l.lora_B.weight"]
    assert set(dense_b) <= {"dense-raw", "dense-zstd", "dense-xor-zstd"} and dense_b
    assert sum(dense_b.values()) < 512 * 8 * 2
    assert rep["payload_bytes"] < 2 * 2 * 512 * 8
    assert sum(v["bytes"] for v in rep["codings"].values()) < rep["payload_bytes"]
    assert main(["delta", "inspect", str(d)]) == 0
    assert "dense-" in capsys.readouterr().out
