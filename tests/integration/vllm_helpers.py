"""Pieces of the vLLM tests: tiny random-init models trained for real, their published artifacts and
checkpoints, a trainer node serving them, and vLLM engines built from a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from p2psync.artifact import build_manifest, write_file
from p2psync.codec.encode import CodecOptions, encode_delta, encode_snapshot
from p2psync.state import ModelState

CHUNK = 64 << 10
# head_dim 64: vLLM's CPU attention supports it (not every size).
SHAPES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12], [300, 2, 2, 80, 411, 9]]
SPECIAL_BITS = [0x7FC1, 0xFFA5, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7F81]
"""bf16 words: quiet NaN with payload, negative NaN with payload, -0.0, subnormals, +inf, -inf, signalling NaN."""


def hf_config(model_type: str, tied: bool) -> Any:
    from transformers import AutoConfig

    kw = dict(SHAPES)
    if model_type == "llama":
        kw.pop("head_dim")  # llama derives it: 128 / 2 = 64
    return AutoConfig.for_model(model_type, tie_word_embeddings=tied, **kw)


class Lineage:
    """Published versions 0..n of one model trained with AdamW (fp32 master, bf16 published)."""

    def __init__(self, model_type: str, tied: bool, seed: int = 0, lr: float = 1e-3) -> None:
        from transformers import AutoModelForCausalLM

        from trainer.workload import Workload

        torch.manual_seed(seed)
        self.config = hf_config(model_type, tied)
        model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(3.0)  # peaked next-token distributions
        self.work = Workload(model, lr=lr, seed=seed)
        self.states = [ModelState(self.work.published())]
        self.opts = CodecOptions(chunk_size=CHUNK)

    def step(self, special: bool = False) -> ModelState:
        """One AdamW step; ``special``: also write :data:`SPECIAL_BITS` into the first norm weight."""
        self.work.step()
        state = ModelState(self.work.published())
        if special:
            name = next(n for n in state if n.endswith("input_layernorm.weight"))
            w = state.words(name)
            w[: len(SPECIAL_BITS)] = SPECIAL_BITS
            state.invalidate()
        self.states.append(state)
        return state

    def publish(self, directory: Path, priv: Any, versions: range) -> None:
        """Write the snapshot of ``versions[0]`` and the deltas up to ``versions[-1]`` into ``directory``."""
        v0 = versions[0]
        enc = encode_snapshot(self.states[v0], self.opts)
        m = build_manifest(enc, model_id="t", target_version=v0, chunk_size=CHUNK, private_key=priv)
        write_file(directory / f"{v0:06d}-snapshot.p2sa", m, enc.chunks)
        for v in versions[1:]:
            self.publish_delta(directory, priv, v)

    def publish_delta(self, directory: Path, priv: Any, v: int) -> None:
        enc = encode_delta(self.states[v - 1], self.states[v], self.opts)
        m = build_manifest(enc, model_id="t", base_version=v - 1, target_version=v, chunk_size=CHUNK,
                           private_key=priv)
        write_file(directory / f"{v:06d}-delta.p2sa", m, enc.chunks)

    def checkpoint(self, directory: Path, version: int) -> str:
        """A Hugging Face folder holding version ``version`` (bf16), for a fresh vLLM to load."""
        from transformers import AutoModelForCausalLM

        from p2psync.checkpoint_names import checkpoint_tensors

        model = AutoModelForCausalLM.from_config(self.config, dtype=torch.bfloat16)
        sd = checkpoint_tensors(model)  # the published table's names, views of the model's memory
        with torch.no_grad():
            for name in self.states[version]:
                sd[name].copy_(self.states[version].tensor(name))
        if self.config.tie_word_embeddings:
            model.tie_weights()
        model.save_pretrained(directory)
        return str(directory)


def words(state: ModelState, name: str) -> bytes:
    return state.words(name).tobytes()


def build(model_dir: str, version: int | None = None, max_model_len: int = 256, **vllm: Any) -> Any:
    """A p2psync vLLM engine on the checkpoint ``model_dir`` (its processes end with this one);
    ``vllm``: extra ``vllm.LLM`` keyword arguments."""
    from rollout.engines.base import EngineConfig
    from rollout.engines.vllm.engine import VLLMEngine
    from rollout.engines.vllm.launch import llm_kwargs, start_llm

    kw = llm_kwargs(EngineConfig(engine="vllm", model_path=model_dir, vllm=vllm), model_dir)
    kw["max_model_len"] = max_model_len
    engine = VLLMEngine(start_llm(kw), version)
    # vLLM's own teardown (full garbage collections in each of its processes) took the whole 5 s bound
    # at every close measured on the 2-core VM; the test is over by then.
    engine.close_timeout = 1.0
    return engine


def greedy(engine: Any, tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and log-probabilities of :data:`PROMPTS`."""
    from rollout.engines.base import SeqRequest

    out = engine.generate([SeqRequest(p, tokens, temperature=0.0) for p in PROMPTS])
    return [(s.tokens, s.logprobs) for s in out]


@contextmanager
def serving(root: Path, lin: Any, last: int, wait: bool = True) -> Iterator[tuple[Any, Any]]:
    """``(cluster, trainer)``: a real trainer node serving versions ``0..last`` of ``lin``.

    ``wait=False``: back as soon as the node listens, still loading its versions; the caller calls
    :func:`published` before anything fetches. A vLLM engine built meanwhile starts its processes
    one after the other on one core while the node loads on the other."""
    from nodeproc import Cluster

    cluster = Cluster(root)
    try:
        lin.publish(cluster.publish_dir, cluster.priv, range(0, last + 1))
        trainer = cluster.start("trainer", "trainer", publish=True)
        if wait:
            published(trainer, last)
        yield cluster, trainer
    finally:
        cluster.stop_all()


def published(trainer: Any, last: int) -> None:
    """Wait until the trainer node of :func:`serving` holds version ``last``."""
    from nodeproc import at_version, wait_for

    wait_for(lambda: at_version(trainer, last), 120, "trainer published")
