"""FSDP2 on two CPU ranks (gloo): each rank publishes its own shard; a follower holds the full model bit-exactly
(a dense model, and a MoE model whose fused experts are published one checkpoint tensor per expert)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TOKEN = "fsdp-test-token-0123"
STEPS = 3


def _model(seed: int, family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    if family != "qwen3":
        from p2psync.presets import build_moe

        # Three experts: the fused expert parameters split 2 + 1 over the two ranks.
        return build_moe(family, seed=seed, vocab_size=515, num_experts=3)
    torch.manual_seed(seed)
    # Odd sizes: dim 0 of most weights does not split evenly over two ranks.
    cfg = Qwen3Config(vocab_size=515, hidden_size=64, intermediate_size=190, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _rank_main(rank: int, root: str, family: str) -> None:
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from p2psync import config, dtypes
    from p2psync.checkpoint_names import checkpoint_views, unique_tensors
    from p2psync.node import Node
    from p2psync.state import ModelState
    from trainer.background import BackgroundNode
    from trainer.pieces import published_table
    from trainer.publisher import Publisher

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=2)
    try:
        model = _model(seed=11, family=family)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # The planner's flat ranges are the ones DTensor itself computes.
        specs, pieces = published_table(model)
        in_memory = set(model.state_dict())
        assert family == "qwen3" or any(s.name.endswith("experts.2.down_proj.weight") for s in specs)
        for piece in pieces:
            if piece.spec.name not in in_memory:  # an expert of a fused parameter: checked below
                continue
            t = piece.source
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            row = piece.spec.numel // t.shape[0]
            assert piece.offset == offset[0] * row and piece.numel == int(np.prod(shape)), piece.spec.name

        common = {"cluster_token": TOKEN, "trainer_public_key": str(rootp / "keys" / "trainer.pub"),
                  "limits": {"poll_interval": 0.5, "sse_keepalive": 1.0, "retry_after": 0.2},
                  "store": {"snapshot_interval": 0}}
        bg = follower = None
        if rank == 0:
            from p2psync.certs import Authority

            # A spawned rank does not run the tests' conftest: the nodes' certificates are issued here.
            ca = Authority(rootp / "keys")
            ca.node("trainer", "default", rootp / "t" / "tls")
            ca.node("rollout", "default", rootp / "r" / "tls")
            cfg = config.load(overrides={**common, "id": "trainer", "role": "trainer", "data_dir": str(rootp / "t"),
                                         "trainer_private_key": str(rootp / "keys" / "trainer.key")})
            bg = BackgroundNode(cfg).start()
            fcfg = config.load(overrides={**common, "id": "rollout", "role": "rollout",
                                          "data_dir": str(rootp / "r"), "parents": [bg.node.address]})
            follower = bg.call(Node.create(fcfg))
            pub = Publisher(model, bg.node, loop=bg.loop, chunk_size=64 << 10, bucket_bytes=16 << 10)
        else:
            pub = Publisher(model, None, chunk_size=64 << 10, bucket_bytes=16 << 10)
        pub.start_sync()
        # Each rank keeps a CPU copy of its shard only.
        local = sum(p.numel for p in pub._pieces)
        total = sum(s.numel for s in specs)
        assert local < 0.6 * total, (local, total)

        gen = torch.Generator().manual_seed(rank)
        log = []
        for v in range(STEPS + 1):
            if v:
                ids = torch.randint(0, 515, (2, 12), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                assert pub.publish_sync() == v
            # Verification only: the full weights (this all-gather is the test's, not the publisher's).
            whole = {n: t.full_tensor().detach() for n, t in unique_tensors(model).items()}
            full = {v.name: v.of(whole[v.source]).to(torch.bfloat16) for v in checkpoint_views(model)}
            assert list(full) == [s.name for s in specs]
            pub.flush_sync()
            if rank == 0:
                bg.call(follower.wait_version(v), timeout=60)
                held = follower.state
                for name, t in full.items():
                    assert np.array_equal(held.words(name), dtypes.words_of(t.contiguous())), (v, name)
                assert held.audit() == follower.fingerprint == pub.fingerprints[v] == ModelState(full).fingerprint
                log.append({"version": v, "fingerprint": follower.fingerprint,
                            "changed": pub.records[-1].changed, "elements": pub.records[-1].elements})
            dist.barrier()
        pub.close_sync()
        if rank == 0:
            bg.call(follower.close())
            bg.stop()
            (rootp / "result.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_two_fsdp2_ranks_publish_their_shards_and_the_follower_holds_the_full_model(tmp_path, family):
    import torch.multiprocessing as mp

    from p2psync import keys

    keys.write_pair(keys.generate(), tmp_path / "keys")
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[2] / ".." / ".numba_cache"))
    mp.spawn(_rank_main, args=(str(tmp_path), family), nprocs=2, join=True)
    log = json.loads((tmp_path / "result.json").read_text())
    assert [e["version"] for e in log] == list(range(STEPS + 1))
    assert len({e["fingerprint"] for e in log}) == STEPS + 1
    assert all(0 < e["changed"] < e["elements"] for e in log[1:])
