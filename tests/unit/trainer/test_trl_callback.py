"""TRL's real GRPOTrainer with the p2psync callback: a follower holds the trained model's bf16 bits."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import needs
import pytest
import torch

needs.module("trl", "the test extra installs it")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


INTEGRATIONS_MD = Path(__file__).resolve().parents[3] / "docs" / "INTEGRATIONS.md"


def _trl_block() -> str:
    section = INTEGRATIONS_MD.read_text().split("\n## TRL\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return block


def test_trl_grpo_trainer_publishes_every_step(tmp_path, monkeypatch):
    """docs/INTEGRATIONS.md's TRL block runs as written (3 GRPO steps with the callback), then a rollout
    node holds the trained model's bf16 bits."""
    from p2psync import config, dtypes, keys
    from p2psync.node import Node
    from p2psync.state import ModelState
    from trainer.trl_callback import P2PSyncCallback

    keys.write_pair(keys.generate(), tmp_path / "keys")
    monkeypatch.chdir(tmp_path)
    original = P2PSyncCallback.on_train_end
    # keep the node serving after training, for the follower below (the block's own end stops it)
    monkeypatch.setattr(P2PSyncCallback, "on_train_end", lambda self, *a, **k: self.publisher.close_sync())
    scope: dict = {"__name__": "trl_block"}
    exec(compile(_trl_block(), str(INTEGRATIONS_MD), "exec"), scope)
    trainer = scope["trainer"]
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, P2PSyncCallback)]
    args = trainer.args
    common = {"cluster_token": "change-me", "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
              "limits": {"poll_interval": 0.5, "retry_after": 0.2}}
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
        original(cb, args, None, None)
    assert cb.background is None
