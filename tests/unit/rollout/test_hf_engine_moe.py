"""The transformers engine follows a mixture-of-experts trainer bit-exactly: the deltas name each
expert as the checkpoint does, and the engine writes them into its fused expert parameters."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from p2psync import config, keys
from rollout.engines import build_engine
from rollout.engines.base import EngineConfig
from trainer.background import BackgroundNode
from p2psync.presets import build_moe
from trainer.workload import Workload

pytestmark = pytest.mark.timeout(300)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_hf_engine_applies_checkpoint_named_deltas_into_fused_experts(tmp_path, family):
    priv = keys.generate()
    keys.write_pair(priv, tmp_path / "keys")
    cfg = config.load(overrides={
        "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"), "cluster_token": "moe-engine",
        "trainer_private_key": str(tmp_path / "keys" / "trainer.key"),
        "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"), "store": {"snapshot_interval": 0}})
    model = build_moe(family, seed=6)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)  # peaked next-token distributions
    w = Workload(model, lr=1e-3, batch=2, seq=16, seed=6)
    model.config.save_pretrained(tmp_path / "model")  # the engine builds the same architecture
    engine = build_engine(EngineConfig(engine="hf", model_path=str(tmp_path / "model"), threads=1))
    fused = [n for n, _ in engine.model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
             and ".experts." in n]
    assert fused
    with BackgroundNode(cfg) as bg:
        pub = bg.publisher(model, optimizer=w.opt, chunk_size=64 << 10)
        assert engine.load(bg.node.state, 0, pub.fingerprints[0]) == pub.fingerprints[0]
        for v in range(1, 4):
            w.step()
            pub.publish_sync()
            pub.flush_sync()
            art = bg.node.store.find("delta", v)
            assert art is not None
            assert any(".experts.1." in s.name for s in art.manifest.tensors)
            chunks = bg.node.store.chunks(art.manifest.artifact_id)
            assert engine.apply(art.manifest, chunks) == pub.fingerprints[v]
            assert engine.audit() == pub.fingerprints[v]
        pub.close_sync()
    # The engine's own (fused) parameters are, bit for bit, those of a fresh model loaded from the
    # trainer's checkpoint of the last version (transformers fuses the experts again on load) ...
    from transformers import AutoModelForCausalLM

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "last")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "last", dtype=torch.bfloat16).eval()
    mine = dict(engine.model.named_parameters())
    for n, p in want.named_parameters():
        assert np.array_equal(_bits(mine[n]), _bits(p)), n
    # ... and compute what that model computes.
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 12]])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, want(input_ids=ids).logits)
    names = {s.name for s in engine.state.specs}
    assert not any(n in names for n in fused)
