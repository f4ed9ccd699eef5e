"""TRL's real GRPOTrainer with the p2psync callback: a follower holds the trained model's bf16 bits."""

from __future__ import annotations

import asyncio

import numpy as np
import needs
import pytest
import torch

needs.module("trl", "the test extra installs it")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("0123456789+=")}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_trl_grpo_trainer_publishes_every_step(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from p2psync import config, dtypes, keys
    from p2psync.node import Node
    from p2psync.state import ModelState
    from trainer.trl_callback import P2PSyncCallback
    from p2psync.presets import build_model

    keys.write_pair(keys.generate(), tmp_path / "keys")
    common = {"cluster_token": "trl-test-token", "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "store": {"snapshot_interval": 0}, "limits": {"poll_interval": 0.5, "retry_after": 0.2}}
    cfg = config.load(overrides={**common, "id": "trainer", "role": "trainer", "data_dir": str(tmp_path / "t"),
                                 "trainer_private_key": str(tmp_path / "keys" / "trainer.key")})
    tok = _tokenizer()
    model = build_model("tiny", seed=0)
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 2, 1
    prompts = [f"{a}+{b}=" for a in range(5) for b in range(5)]
    data = Dataset.from_dict({"prompt": prompts})

    def reward(prompts, completions, **kwargs):
        out = []
        for p, c in zip(prompts, completions):
            a, b = p[:-1].split("+")
            out.append(1.0 if c.strip().startswith(str(int(a) + int(b))) else 0.0)
        return out

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=3, max_steps=3, learning_rate=1e-3, use_cpu=True, report_to="none",
                      logging_steps=1, save_strategy="no", bf16=False, dataloader_num_workers=0, seed=0)
    cb = P2PSyncCallback(cfg, chunk_size=64 << 10)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[cb])
    original = cb.on_train_end
    cb.on_train_end = lambda *a, **k: cb.publisher.close_sync()  # keep the node serving for the follower
    trainer.train()
    try:
        pub = cb.publisher
        assert pub.version == 3 and [r.version for r in pub.records] == [0, 1, 2, 3]
        expected = {n: t.detach().to(torch.bfloat16) for n, t in trainer.model.state_dict().items()
                    if n != "lm_head.weight"}
        assert pub.fingerprints[3] == ModelState(expected).fingerprint
        fcfg = config.load(overrides={**common, "id": "rollout", "role": "rollout", "data_dir": str(tmp_path / "r"),
                                      "parents": [cb.node.address]})
        bg = cb.background
        fol = bg.call(Node.create(fcfg))
        try:
            bg.call(asyncio.wait_for(fol.wait_version(3), 60))
            for name, t in expected.items():
                assert np.array_equal(fol.state.words(name), dtypes.words_of(t.contiguous())), name
            assert fol.fingerprint == pub.fingerprints[3]
        finally:
            bg.call(fol.close())
    finally:
        original(args, None, None)
    assert cb.background is None
