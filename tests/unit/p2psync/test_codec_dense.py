"""Dense delta segments: a step that changes nearly every element (a LoRA adapter's) costs no more
than the raw words, lands bit-exact, and every encode path chooses the same coding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2psync.codec import dense, segment
from p2psync.codec.decode import Applier, split_chunk
from p2psync.codec.encode import CodecOptions, encode_delta, encode_delta_sparse
from p2psync.errors import CodecError, FingerprintMismatch
from p2psync.state import ModelState

SMALL = CodecOptions(chunk_size=64 << 10, segment_elements=4096, threads=2)


def _adapter_step(seed: int, n: int = 20_000, lr: float = 1e-3) -> tuple[ModelState, ModelState]:
    """An Adam-like step on bf16 weights of LoRA magnitudes: almost every word changes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    step = torch.randn(n, generator=g).sign() * lr
    base = ModelState({"lora_A": w.to(torch.bfloat16).reshape(100, -1)})
    new = ModelState({"lora_A": (w + step).to(torch.bfloat16).reshape(100, -1)})
    return base, new


def _apply(base: ModelState, enc) -> ModelState:
    out = base.clone()
    ap = Applier(out, kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                 target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)
    ap.add_chunks(enumerate(enc.chunks), 2)
    ap.commit()
    return out


def _kinds(enc) -> list[tuple[int, int]]:
    out = []
    for c in enc.chunks:
        for seg in split_chunk(c):
            p = segment.parse_segment(seg)
            out.append((p.kind, p.res_codec if p.kind == segment.KIND_DENSE else -1))
    return out


def _zero_init_step(seed: int) -> tuple[ModelState, ModelState]:
    """A PEFT ``lora_B`` (zeros at init) after its first step: no word keeps its base."""
    g = torch.Generator().manual_seed(seed)
    base = ModelState({"lora_B": torch.zeros(2048, 8, dtype=torch.bfloat16)})
    new = ModelState({"lora_B": (torch.randn(2048, 8, generator=g) * 1e-3).to(torch.bfloat16)})
    return base, new


def test_first_step_from_zero_init_is_dense_smaller_than_raw_and_bit_exact():
    base, new = _zero_init_step(0)
    enc = encode_delta(base, new, CodecOptions(threads=1))
    raw = base.words("lora_B").nbytes
    assert sum(len(c) for c in enc.chunks) < raw
    assert {k for k, _ in _kinds(enc)} == {segment.KIND_DENSE}
    got = _apply(base, enc)
    assert np.array_equal(got.words("lora_B"), new.words("lora_B"))
    assert got.fingerprint == new.fingerprint == got.audit()


@pytest.mark.parametrize("maker", [_adapter_step, _zero_init_step])
def test_each_segment_takes_the_smaller_coding(maker, monkeypatch):
    base, new = maker(7)
    both = encode_delta(base, new, SMALL)
    monkeypatch.setattr(dense, "smaller", lambda encoded, *a: encoded)
    sparse_only = encode_delta(base, new, SMALL)
    a = [len(s) for c in both.chunks for s in split_chunk(c)]
    b = [len(s) for c in sparse_only.chunks for s in split_chunk(c)]
    assert len(a) == len(b) and all(x <= y for x, y in zip(a, b))
    assert sum(a) < base.words(base.specs[0].name).nbytes
    assert both.target_fingerprint == sparse_only.target_fingerprint
    assert np.array_equal(_apply(base, both).words(base.specs[0].name), new.words(base.specs[0].name))


def test_incompressible_words_cost_at_most_raw_plus_headers():
    rng = np.random.default_rng(3)
    b = rng.integers(0, 2**16, size=30_000, dtype=np.uint16)
    n = rng.integers(0, 2**16, size=30_000, dtype=np.uint16)
    base = ModelState({"w": torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)})
    new = ModelState({"w": torch.from_numpy(n.view(np.int16)).view(torch.bfloat16)})
    enc = encode_delta(base, new, SMALL)
    segs = [s for c in enc.chunks for s in split_chunk(c)]
    assert all(segment.parse_segment(s).kind == segment.KIND_DENSE for s in segs)
    words = sum(segment.span_of(s) for s in segs)
    assert words == 30_000
    assert sum(len(s) for s in segs) <= 2 * words + len(segs) * dense.HEADER_BYTES
    assert np.array_equal(_apply(base, enc).words("w"), n)


def test_sparse_steps_stay_sparse():
    g = torch.Generator().manual_seed(1)
    base = ModelState({"lora_A": (torch.randn(20_000, generator=g) * 0.02).to(torch.bfloat16)})  # 1-D: no row cuts
    new = base.clone()
    w = new.words("lora_A")
    w[::97] += np.uint16(1)
    new.invalidate()
    enc = encode_delta(base, new, SMALL)
    assert {k for k, _ in _kinds(enc)} == {segment.KIND_DELTA}


def test_changes_found_elsewhere_choose_the_same_bytes():
    base, new = _adapter_step(2)
    old_w, new_w = base.words("lora_A"), new.words("lora_A")
    pos = np.flatnonzero(old_w != new_w)
    a = encode_delta(base, new, SMALL)
    b = encode_delta_sparse(base, {"lora_A": (pos, new_w[pos])}, SMALL)
    assert a.chunks == b.chunks and a.target_fingerprint == b.target_fingerprint


def test_reference_scan_chooses_the_same_bytes(monkeypatch):
    from p2psync.codec import encode

    base, new = _adapter_step(4)
    a = encode_delta(base, new, SMALL)
    monkeypatch.setattr(encode, "_scan_job", encode._scan_job_reference)
    b = encode_delta(base, new, SMALL)
    assert a.chunks == b.chunks


def test_unchanged_words_inside_a_dense_range_are_not_reported_as_changes():
    base, new = _adapter_step(5)
    ap = Applier(base.clone(), kind="delta", specs=base.specs, n_chunks=1, target_fingerprint=new.fingerprint,
                 base_fingerprint=base.fingerprint)
    enc = encode_delta(base, new, SMALL)
    ap.n_chunks = len(enc.chunks)
    ap.keep_changes = True
    ap.add_chunks(enumerate(enc.chunks), 1)
    ap.commit()
    assert ap.changes is not None
    pos, _ = ap.changes[0]
    assert np.array_equal(np.sort(pos), np.flatnonzero(base.words("lora_A") != new.words("lora_A")))


def test_corrupt_dense_segment_is_a_typed_error_and_leaves_state_untouched():
    base, new = _zero_init_step(6)
    enc = encode_delta(base, new, SMALL)
    seg = bytearray(split_chunk(enc.chunks[0])[0])
    assert seg[0] == segment.KIND_DENSE
    bad_coding = bytearray(seg)
    bad_coding[21] = 9
    truncated = seg[:-3]
    flipped = bytearray(seg)
    flipped[-1] ^= 0xFF
    for broken in (bad_coding, truncated, flipped):
        chunk = b"P2C2" + (1).to_bytes(4, "little") + len(broken).to_bytes(4, "little") + bytes(broken)
        state = base.clone()
        before = state.words("lora_B").copy()
        ap = Applier(state, kind="delta", specs=base.specs, n_chunks=1,
                     target_fingerprint=new.fingerprint, base_fingerprint=base.fingerprint)
        with pytest.raises((CodecError, FingerprintMismatch)):
            ap.add_chunk(0, chunk)
            ap.commit()
        assert np.array_equal(state.words("lora_B"), before)


def test_a_copy_of_the_range_with_its_origin_decodes_like_the_whole_tensor():
    """What the vLLM engine's per-rank decode does (``segdecode.decode`` with ``origin``, the range
    copied out of strided live memory): same positions, words and fingerprint change for dense segments."""
    from p2psync import dtypes
    from p2psync.codec import segdecode
    from p2psync.state import tensor_seed

    base, new = _zero_init_step(8)
    enc = encode_delta(base, new, SMALL)
    d, seed, old = dtypes.from_code("BF16"), tensor_seed("lora_B"), base.words("lora_B")
    segs = [s for c in enc.chunks for s in split_chunk(c)]
    assert segs and all(segment.parse_head(s).kind == segment.KIND_DENSE for s in segs)
    for seg in segs:
        p = segment.parse_head(seg)
        whole = segdecode.decode(seg, p.body_at, p.start, p.stop, d, old, seed)
        part = segdecode.decode(seg, p.body_at, p.start, p.stop, d, old[p.start:p.stop].copy(), seed, origin=p.start)
        assert np.array_equal(whole[0], part[0]) and np.array_equal(whole[1], part[1]) and whole[2] == part[2]
        assert np.array_equal(new.words("lora_B")[whole[0]], whole[1])


def test_all_changed_ranges_skip_the_sparse_encode_on_every_path(monkeypatch):
    """A range where every word changed (an adapter step) is coded densely outright: neither the scan
    nor the changes-found-elsewhere path runs the sparse encoder on it, and both write the same bytes."""
    from p2psync.codec import encode as enc_mod

    base, new = _adapter_step(9)
    old_w, new_w = base.words("lora_A"), new.words("lora_A")
    pos = np.flatnonzero(old_w != new_w)
    assert pos.shape[0] == old_w.shape[0]  # every word moved

    def no_sparse(*a, **k):
        raise AssertionError("the sparse encoder ran on an all-changed range")

    monkeypatch.setattr(enc_mod.segencode, "scan", no_sparse)
    monkeypatch.setattr(enc_mod, "_encode_segment", no_sparse)
    a = encode_delta(base, new, SMALL)
    b = encode_delta_sparse(base, {"lora_A": (pos, new_w[pos])}, SMALL)
    assert a.chunks == b.chunks and {k for k, _ in _kinds(a)} == {segment.KIND_DENSE}
    assert a.target_fingerprint == new.fingerprint
    assert np.array_equal(_apply(base, a).words("lora_A"), new_w)


def test_a_few_ulp_step_takes_the_difference_coding_and_wraps_bit_exact():
    """An Adam-like step of a few ULPs codes as the words' integer difference (smaller than their XOR
    and than the sparse coding); words whose difference wraps (0x0000 <-> 0xFFFF, NaN payloads, -0.0)
    land bit-exact."""
    base, new = _adapter_step(10)
    w = new.words("lora_A")
    b = base.words("lora_A")
    b[:4] = [0x0000, 0xFFFF, 0x7FC1, 0x8000]  # +0.0, a NaN, a NaN payload, -0.0
    w[:4] = [0xFFFF, 0x0000, 0x7FC0, 0x0000]
    base.invalidate()
    new.invalidate()
    enc = encode_delta(base, new, SMALL)
    assert {c for _, c in _kinds(enc)} == {dense.CODING_DIFF_ZSTD}
    got = _apply(base, enc)
    assert np.array_equal(got.words("lora_A"), w)
    assert got.fingerprint == new.fingerprint == got.audit()


@pytest.mark.parametrize("word", [np.uint8, np.uint16, np.uint32])
def test_zigzag_difference_inverts_at_every_width(word):
    rng = np.random.default_rng(11)
    top = np.iinfo(word).max
    old = rng.integers(0, top, 5000, dtype=word, endpoint=True)
    new = rng.integers(0, top, 5000, dtype=word, endpoint=True)
    new[:2500] = old[:2500] + rng.integers(0, 4, 2500).astype(word)  # small steps up, wrapping at the top
    new[2500:2510] = old[2500:2510] - word(1)  # one down: zigzag 1
    z = dense.zigzag_diff(old, new)
    assert z.dtype == old.dtype and int(z[2500:2510].max()) == 1 and int(z[:2500].max()) <= 6
    assert np.array_equal(dense.add_unzigzag(z, old), new)


def test_an_xor_coded_segment_still_decodes_bit_exact():
    """Coding 2 (XOR with the base) is no longer written but stays readable: a segment built by hand
    in that coding decodes to the new words and the right fingerprint change."""
    from p2psync import dtypes
    from p2psync.codec import segdecode
    from p2psync.state import tensor_seed
    from p2psync.wordops import hash_change

    base, new = _adapter_step(12, n=5000)
    old_w, new_w = base.words("lora_A"), new.words("lora_A")
    payload = segment.compress(segment.planes(np.bitwise_xor(old_w, new_w)), 3)
    seg = (segment.encode_header(segment.KIND_DENSE, 0, 0, old_w.shape[0])
           + dense._BODY.pack(dense.CODING_XOR_ZSTD, len(payload)) + payload)
    assert dense.coding_of(memoryview(seg))[1] == "dense-xor-zstd"
    seed = tensor_seed("lora_A")
    p = segment.parse_head(seg)
    pos, vals, sums = segdecode.decode(seg, p.body_at, 0, old_w.shape[0], dtypes.from_code("BF16"), old_w, seed)
    assert np.array_equal(pos, np.flatnonzero(old_w != new_w)) and np.array_equal(vals, new_w[pos])
    a, b = hash_change(pos, old_w[pos], vals, seed)
    assert sums == (int(a), int(b))


def test_a_caller_that_sums_the_fingerprint_itself_gets_the_same_segments():
    """``hashes=False`` (the publisher, which sums the change from its own extraction): the same bytes,
    and no sum is claimed."""
    from p2psync.codec.encode import encode_sparse_range
    from p2psync.state import tensor_seed
    from p2psync.wordops import hash_change

    base, new = _adapter_step(13)
    old_w, new_w = base.words("lora_A"), new.words("lora_A")
    pos = np.flatnonzero(old_w != new_w)
    spec = base.specs[0]
    full = encode_sparse_range(0, spec, old_w, pos, new_w[pos], 0, old_w.shape[0], SMALL)
    bare = encode_sparse_range(0, spec, old_w, pos, new_w[pos], 0, old_w.shape[0], SMALL, hashes=False)
    assert bare.segments == full.segments and bare.hash_delta == (0, 0)
    a, b = hash_change(pos, old_w[pos], new_w[pos], tensor_seed(spec.name))
    assert full.hash_delta == (int(a), int(b))
