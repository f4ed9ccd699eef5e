"""The transformers rollout engine: bit-exact weights under real deltas, sampling, log-probs, resume, safe switches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import bits_equal, trained_versions

from p2psync.errors import CodecError, FingerprintMismatch, P2PSyncError, TensorTableMismatch, WrongBase
from p2psync.state import ModelState
from rollout.engines import build_engine
from rollout.engines.base import EngineConfig, SeqRequest, sample_rows
from rollout.engines.hf import HFEngine


@pytest.fixture(scope="module")
def versions():
    return trained_versions(steps=3)


@pytest.fixture
def engine(versions):
    eng = build_engine(EngineConfig(preset="tiny", threads=1))
    eng.load(versions.states[0], 0)
    return eng


def _words(eng: HFEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in eng.model.state_dict().items()}


def test_weights_bit_exact_after_real_deltas(versions, engine):
    for m, chunks in versions.deltas:
        fp = engine.apply(m, chunks)
        assert fp == m.target_fingerprint
        assert engine.version == m.target_version
        published = versions.states[m.target_version]
        assert bits_equal(published, engine.model.state_dict()) == []
        assert engine.audit() == published.fingerprint
    # The tied head is the embedding, bit for bit, and the state is the parameters' own memory.
    sd = engine.model.state_dict()
    assert torch.equal(sd["lm_head.weight"].view(torch.int16), sd["model.embed_tokens.weight"].view(torch.int16))
    p = dict(engine.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert engine.state.tensor("model.layers.0.mlp.up_proj.weight").data_ptr() == p.data_ptr()


def test_wrong_base_is_refused_and_weights_untouched(versions, engine):
    before = _words(engine)
    m, chunks = versions.deltas[1]  # 1 -> 2, offered to version 0
    with pytest.raises(WrongBase):
        engine.apply(m, chunks)
    assert engine.version == 0
    assert all(torch.equal(before[n].view(torch.int16), t.view(torch.int16))
               for n, t in engine.model.state_dict().items())


def test_corrupt_chunk_is_refused_and_weights_untouched(versions, engine):
    before = _words(engine)
    m, chunks = versions.deltas[0]
    bad = bytearray(chunks[-1])
    bad[-3] ^= 0x40  # a residual byte: decodes, but to other words
    with pytest.raises((FingerprintMismatch, CodecError)):
        engine.apply(m, [*chunks[:-1], bytes(bad)])
    assert engine.version == 0
    assert all(torch.equal(before[n].view(torch.int16), t.view(torch.int16))
               for n, t in engine.model.state_dict().items())
    assert engine.audit() == versions.states[0].fingerprint


def test_other_model_table_is_refused(versions):
    eng = build_engine(EngineConfig(model_config=dict(model_type="qwen3", vocab_size=512, hidden_size=64,
                                                      intermediate_size=192, num_hidden_layers=1,
                                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                      tie_word_embeddings=True)))
    with pytest.raises(TensorTableMismatch) as info:
        eng.load(versions.states[0], 0)
    assert any("layers.1" in n for n in info.value.unknown)


def _reqs(**kw):
    base = [SeqRequest([5, 9, 17, 33], 12, temperature=1.0, seed=11),
            SeqRequest([7, 3], 10, temperature=0.7, top_p=0.9, seed=12),
            SeqRequest([100, 101, 102, 103, 104, 105], 9, temperature=1.3, seed=13)]
    return [dataclasses.replace(r, **kw) for r in base]


def test_generation_is_deterministic_for_a_seed(engine):
    a = engine.generate(_reqs())
    b = engine.generate(_reqs())
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    c = engine.generate([dataclasses.replace(r, seed=r.seed + 1000) for r in _reqs()])
    assert [s.tokens for s in a] != [s.tokens for s in c]
    assert all(len(s.tokens) == s.request.max_new_tokens and s.finish_reason == "length" for s in a)
    assert all(s.versions == [0] * len(s.tokens) for s in a)


def test_logprobs_match_a_separate_forward_pass(engine):
    seqs = engine.generate(_reqs())
    for s in seqs:
        ref = engine.logprobs_of(s.request.prompt_ids, s.tokens, s.request.temperature)
        assert max(abs(a - b) for a, b in zip(ref, s.logprobs)) < 0.05, (ref, s.logprobs)
    # The model is not near-uniform, so this comparison can fail (log 512 = 6.24).
    assert max(max(s.logprobs) for s in seqs) > -4.0


def test_resume_from_prefix_continues_like_uninterrupted(engine):
    full = engine.generate(_reqs())
    resumed = engine.generate([dataclasses.replace(s.request, prefix=s.tokens[:4]) for s in full])
    for f, r in zip(full, resumed):
        assert r.tokens == f.tokens[4:]
        assert len(r.request.prefix) + len(r.tokens) == f.request.max_new_tokens


def test_greedy_top_p_and_stop_tokens(engine):
    (g,) = engine.generate([SeqRequest([5, 9, 17], 8, temperature=0.0)])
    ids = torch.tensor([[5, 9, 17] + g.tokens])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, 2:-1].float()
    assert g.tokens == logits.argmax(-1).tolist()
    # top_p: every drawn token lies inside the nucleus of the distribution it was drawn from.
    row = torch.randn(1, 50) * 3
    req = SeqRequest([1], 5, temperature=1.0, top_p=0.5)
    probs = torch.softmax(row[0], -1)
    order = probs.argsort(descending=True)
    k = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    nucleus = set(order[:k].tolist())
    drawn = {sample_rows(row, [dataclasses.replace(req, seed=s)], [0])[0][0] for s in range(200)}
    assert drawn <= nucleus and len(drawn) > 1
    # A stop token ends the response and is its last token.
    first = engine.generate([SeqRequest([5, 9, 17], 8, temperature=0.0)])[0].tokens
    (s,) = engine.generate([SeqRequest([5, 9, 17], 8, temperature=0.0, stop_token_ids=[first[2]])])
    assert s.finish_reason == "stop" and s.tokens[-1] == first[2] and len(s.tokens) <= 3


def test_switch_between_steps_uses_new_weights_for_later_tokens(versions, engine):
    m, chunks = versions.deltas[0]
    gen = engine.start(_reqs())
    for _ in range(3):
        gen.step()
    engine.apply(m, chunks)  # a safe point: between two steps
    while not gen.done:
        gen.step()
    for s in gen.seqs:
        assert s.versions == [0] * 3 + [1] * (len(s.tokens) - 3)
        # Tokens after the switch have the log-probs of version 1 over the whole context.
        ref = engine.logprobs_of(s.request.prompt_ids, s.tokens, s.request.temperature)
        assert max(abs(a - b) for a, b in zip(ref[3:], s.logprobs[3:])) < 0.05


def test_load_checks_the_copy(versions):
    eng = build_engine(EngineConfig(preset="tiny", threads=1))
    with pytest.raises(FingerprintMismatch):
        eng.load(versions.states[0], 0, expected_fingerprint=versions.states[1].fingerprint)
    assert eng.version is None
    with pytest.raises(RuntimeError):
        eng.start(_reqs())
    copy: ModelState = versions.states[2].clone()
    assert eng.load(copy, 2) == versions.states[2].fingerprint


def test_prepare_writes_nothing_and_a_stale_prepare_is_refused(versions, engine):
    before = _words(engine)
    p1 = engine.prepare(*versions.deltas[0])
    assert engine.version == 0 and all(torch.equal(before[n].view(torch.int16), t.view(torch.int16))
                                       for n, t in engine.model.state_dict().items())
    engine.generate(_reqs())  # generating while a prepared artifact waits is fine: both only read
    p1_again = engine.prepare(*versions.deltas[0])
    assert engine.commit(p1) == versions.deltas[0][0].target_fingerprint
    with pytest.raises(P2PSyncError):
        engine.commit(p1_again)  # decoded against version 0; the engine is at 1 now
    assert engine.version == 1 and engine.audit() == versions.states[1].fingerprint


def _node_decoded(state: ModelState, m, chunks):
    """What a node in the same process hands over: it applies the delta to its own copy, keeping the changes."""
    from p2psync.codec.decode import Applier

    ap = Applier.for_manifest(state, m)
    ap.add_chunks(enumerate(chunks), 1)
    ap.keep_changes = True
    ap.commit()
    return ap.changes, state.tensor_sums()


def test_deltas_decoded_by_the_node_apply_bit_exact_without_a_second_decode(versions, engine, monkeypatch):
    node_state = versions.states[0].clone()
    import p2psync.codec.decode as decode_mod

    def no_decode(*a, **kw):
        raise AssertionError("the engine decoded the artifact again")
    for m, chunks in versions.deltas:
        changes, sums = _node_decoded(node_state, m, chunks)
        with monkeypatch.context() as mp:
            mp.setattr(decode_mod, "_decode_delta", no_decode)
            prepared = engine.prepare_decoded(m, changes, sums)
            assert engine.commit(prepared) == m.target_fingerprint
        assert bits_equal(versions.states[m.target_version], engine.model.state_dict()) == []
        assert engine.audit() == m.target_fingerprint


def test_decoded_changes_for_another_base_or_target_write_nothing(versions, engine):
    node_state = versions.states[0].clone()
    m0, c0 = versions.deltas[0]
    m1, c1 = versions.deltas[1]
    changes0, sums0 = _node_decoded(node_state, m0, c0)
    changes1, sums1 = _node_decoded(node_state, m1, c1)
    before = _words(engine)
    with pytest.raises(WrongBase):  # 1 -> 2 offered to an engine at version 0
        engine.prepare_decoded(m1, changes1, sums1)
    prepared = engine.prepare_decoded(m0, changes0, sums1)  # sums of another version: wrong target
    with pytest.raises(FingerprintMismatch):
        engine.commit(prepared)
    with pytest.raises(CodecError):  # a snapshot is never adopted as decoded changes
        engine.prepare_decoded(versions.snapshot[0], changes0, sums0)
    assert engine.version == 0
    assert all(torch.equal(before[n].view(torch.int16), t.view(torch.int16))
               for n, t in engine.model.state_dict().items())
    assert engine.audit() == versions.states[0].fingerprint
