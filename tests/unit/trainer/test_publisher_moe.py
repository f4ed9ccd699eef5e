"""A trainer publishing a mixture-of-experts model through a real trainer node: the table is the
checkpoint's (one tensor per expert, as ``save_pretrained`` writes it), every version's bits are the
model's, a checkpoint the trainer saves is a valid version, and dense models keep the fingerprints
they always had."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from p2psync import checkpoint, config, keys
from p2psync.state import ModelState, TensorSpec
from trainer.background import BackgroundNode
from p2psync.presets import build_model, build_moe
from trainer.workload import Workload

pytestmark = pytest.mark.timeout(300)


def _trainer_config(tmp_path):
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    return config.load(overrides={
        "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"), "cluster_token": "moe-test",
        "trainer_private_key": str(tmp_path / "keys" / "trainer.key"),
        "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"), "store": {"snapshot_interval": 0}})


def _saved(model: torch.nn.Module, path) -> checkpoint.Checkpoint:
    """What the trainer's ``save_pretrained`` writes for its weights in the rollout dtype."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
    return checkpoint.load(path)


def _same_bits(state: ModelState, other: ModelState) -> None:
    assert list(state) == list(other)
    for name in state:
        assert np.array_equal(state.words(name), other.words(name)), name


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_moe_versions_are_published_under_checkpoint_names(tmp_path, family):
    model = build_moe(family, seed=4)
    w = Workload(model, lr=1e-3, batch=2, seq=16, seed=4)
    fused = {n for n, _ in model.named_parameters() if n.endswith("gate_up_proj")}
    with BackgroundNode(_trainer_config(tmp_path)) as bg:
        pub = bg.publisher(model, optimizer=w.opt, bucket_bytes=64 << 10, chunk_size=64 << 10)
        specs: list[TensorSpec] = list(bg.node.state.specs)
        names = [s.name for s in specs]
        assert not fused & set(names) and any(".experts.3." in n for n in names)
        # The trainer's checkpoint of version 0 is version 0: same table, same fingerprint.
        ck = _saved(model, tmp_path / "v0")
        assert sorted(names) == sorted(ck.state)
        assert checkpoint.in_table(ck.state, specs).fingerprint == pub.fingerprints[0] == bg.node.fingerprint
        for v in range(1, 4):
            w.step()
            assert pub.publish_sync() == v
            pub.flush_sync()
            _same_bits(bg.node.state, ModelState(w.published()))
            assert bg.node.version == v and bg.node.state.audit() == pub.fingerprints[v]
        assert all(0 < r.changed < r.elements for r in pub.records[1:])
        pub.close_sync()
        # The last version is, bit for bit, the checkpoint save_pretrained writes of the trained model.
        last = checkpoint.in_table(_saved(model, tmp_path / "v3").state, specs)
        _same_bits(bg.node.state, last)
        assert last.fingerprint == pub.fingerprints[3]


def _old_table(model: torch.nn.Module) -> ModelState:
    """The table as computed before checkpoint names: state_dict order, tied weights once, bf16."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t.detach().to(torch.bfloat16).contiguous()))
    return ModelState(out)


def test_dense_model_keeps_its_table_and_fingerprint(tmp_path):
    model = build_model("tiny", seed=5)  # Qwen3, tied embeddings
    w = Workload(model, lr=1e-3, batch=2, seq=16, seed=5)
    with BackgroundNode(_trainer_config(tmp_path)) as bg:
        pub = bg.publisher(model)
        old = _old_table(model)
        assert bg.node.state.specs == old.specs and pub.fingerprints[0] == old.fingerprint
        w.step()
        pub.publish_sync()
        pub.close_sync()
        assert pub.fingerprints[1] == _old_table(model).fingerprint == bg.node.fingerprint
        ck = _saved(model, tmp_path / "ck")  # the trainer's checkpoint is the published version
        assert checkpoint.in_table(ck.state, bg.node.state.specs).fingerprint == pub.fingerprints[1]


def test_cli_applies_a_published_moe_delta_to_the_trainers_checkpoint(tmp_path):
    """``p2psync delta apply`` on the trainer's saved checkpoint of version 0 and the delta 0 -> 1 the
    trainer published gives, bit for bit, the trainer's checkpoint of version 1."""
    from safetensors.torch import load_file

    from p2psync.artifact import write_file
    from p2psync.cli import main

    model = build_moe("qwen3_moe", seed=7)
    w = Workload(model, lr=1e-3, batch=2, seq=16, seed=7)
    with BackgroundNode(_trainer_config(tmp_path)) as bg:
        pub = bg.publisher(model)
        _saved(model, tmp_path / "v0")
        w.step()
        pub.publish_sync()
        pub.close_sync()
        art = bg.node.store.find("delta", 1)
        write_file(tmp_path / "d.p2sa", art.manifest, bg.node.store.chunks(art.manifest.artifact_id))
    _saved(model, tmp_path / "v1")
    assert main(["delta", "apply", str(tmp_path / "v0"), str(tmp_path / "d.p2sa"), "-o", str(tmp_path / "out"),
                 "--pubkey", str(tmp_path / "keys" / "trainer.pub")]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert sorted(got) == sorted(want) and any(".experts.3." in n for n in got)
    for n, t in want.items():
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), n
