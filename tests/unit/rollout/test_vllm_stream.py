"""A delta decoded chunk by chunk while later chunks are still being fetched (the vLLM backend, one rank),
on a transformers model's parameters (no vLLM needed)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync import keys
from p2psync.artifact import build_manifest, verify_chunk
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.errors import ChunkHashMismatch, CodecError, FingerprintMismatch, WrongBase
from p2psync.state import ModelState
from rollout.engines.vllm.apply.stream import Streamed, streams
from rollout.engines.vllm.worker.fetch import decoding
from rollout.engines.vllm.apply.weights import LiveWeights
from rollout_helpers import live_snapshot


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _delta(old: ModelState, cut: bool = False):
    new = old.clone()
    g = np.random.default_rng(1)
    for n in new:
        w = new.words(n)
        idx = g.choice(w.shape[0], size=max(1, w.shape[0] // 3), replace=False)
        w[idx] ^= g.integers(1, 1 << 15, size=idx.shape[0]).astype(w.dtype)
    new.invalidate()
    size = 64 << 10
    enc = encode_delta(old, new, CodecOptions(chunk_size=size, segment_elements=1024))
    if cut:  # the last chunk's payload damaged before signing: its hash matches, only its decode can tell
        bad = bytearray(enc.chunks[-1])
        bad[len(bad) - 5] ^= 0xFF
        enc.chunks[-1] = bytes(bad)
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=size,
                       private_key=keys.generate())
    return new, m, enc.chunks


def _changed(model: torch.nn.Module, state: ModelState) -> list[str]:
    params = dict(model.named_parameters())
    return [n for n in state if not np.array_equal(params[n].detach().reshape(-1).view(torch.int16).numpy(),
                                                   state.words(n).view(np.int16))]


def _source(m, chunks, stream: Streamed, log: list[tuple[str, int]], last: bytes | None = None):
    """A fetch that hands the verified chunks one by one (as ``fetch_artifact(on_chunk=...)`` does) and,
    before the last, waits until a decode has begun (it never would if decoding waited for the fetch)."""
    async def fetch(on_chunk):
        n = len(chunks)
        for i in range(n - 1):
            verify_chunk(m, i, chunks[i])
            log.append(("fetched", i))
            await on_chunk(i, memoryview(chunks[i]))
        while not any(e == "end" for e, _ in stream.order):
            await asyncio.sleep(0.005)
        data = chunks[-1] if last is None else last
        verify_chunk(m, n - 1, data)
        log.append(("fetched", n - 1))
        await on_chunk(n - 1, memoryview(data))
        return m, list(chunks)
    return fetch


def _run(stream: Streamed, fetch, threads: int = 2):
    return asyncio.run(asyncio.wait_for(decoding(stream, fetch, threads), 120))


def test_chunks_decode_while_the_last_is_still_being_fetched_and_land_bit_exact():
    model = _model()
    old = live_snapshot(model)
    live = LiveWeights(model, old.specs)
    new, m, chunks = _delta(old)
    assert len(chunks) >= 4 and streams(live, m)
    stream = Streamed(live, m)
    log: list[tuple[str, int]] = []
    _run(stream, _source(m, chunks, stream, log))
    # A first chunk's decode ended before the last chunk was handed over, and the last decoded after.
    last = len(chunks) - 1
    assert log[-1] == ("fetched", last)
    ended = [k for k, (e, _) in enumerate(stream.order) if e == "end"]
    assert stream.order[ended[0]][1] < last
    assert stream.order.index(("begin", last)) > ended[0]
    assert sorted(i for e, i in stream.order if e == "end") == list(range(len(chunks)))
    assert _changed(model, old) == []  # decoding wrote nothing
    assert live.apply_delta(m, list(chunks), stream) == new.fingerprint
    assert _changed(model, new) == [] and live.audit() == new.fingerprint
    assert live.timing["overlapped"] and live.timing["changes"] > 0


def test_a_corrupt_last_chunk_after_earlier_chunks_decoded_leaves_every_live_word():
    model = _model()
    old = live_snapshot(model)
    live = LiveWeights(model, old.specs)
    new, m, chunks = _delta(old)
    bad = bytearray(chunks[-1])
    bad[len(bad) // 2] ^= 0x40
    stream = Streamed(live, m)
    with pytest.raises(ChunkHashMismatch):
        _run(stream, _source(m, chunks, stream, [], last=bytes(bad)))
    assert sum(1 for e, _ in stream.order if e == "end") >= 1  # earlier chunks were decoded
    with pytest.raises(CodecError):  # the chunk never arrived: nothing to commit
        live.apply_delta(m, list(chunks), stream)
    assert _changed(model, old) == [] and live.audit() == old.fingerprint
    # the same delta, whole, applies afterwards; and again it is refused (its base is gone)
    again = Streamed(live, m)
    _run(again, _source(m, chunks, again, []))
    assert live.apply_delta(m, list(chunks), again) == new.fingerprint
    assert _changed(model, new) == []
    with pytest.raises(WrongBase):
        Streamed(live, m)


def test_a_signed_last_chunk_that_decodes_wrong_is_refused_with_nothing_written():
    """The last chunk's hash matches (it was damaged before signing): its decode or the fingerprint
    check refuses it, after the earlier chunks were decoded."""
    model = _model()
    old = live_snapshot(model)
    live = LiveWeights(model, old.specs)
    _, m, chunks = _delta(old, cut=True)
    stream = Streamed(live, m)
    with pytest.raises((CodecError, FingerprintMismatch)):
        _run(stream, _source(m, chunks, stream, []))
        live.apply_delta(m, list(chunks), stream)
    assert sum(1 for e, _ in stream.order if e == "end") >= 1
    assert _changed(model, old) == [] and live.audit() == old.fingerprint
