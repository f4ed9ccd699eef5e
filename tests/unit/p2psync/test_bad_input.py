"""Every bad input gives its typed error, and the state it was offered to is left untouched."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2psync import artifact, keys
from p2psync.codec.decode import Applier, split_chunk
from p2psync.codec.encode import CHUNK_MAGIC, CodecOptions, encode_delta
from p2psync.codec.segment import parse_segment
from p2psync.errors import (
    ChunkHashMismatch,
    CodecError,
    FingerprintMismatch,
    FormatVersionError,
    P2PSyncError,
    SignatureError,
    TensorTableMismatch,
    TruncatedError,
    WrongBase,
)
from p2psync.state import ModelState

OPTS = CodecOptions(chunk_size=64 << 10, segment_elements=4096)
KEY = keys.generate()


def make_states(seed: int = 0):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    base = {f"w{i}": (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16) for i in range(3)}
    base["norm"] = torch.ones(200, dtype=torch.float32)
    new = {k: v.clone() for k, v in base.items()}
    for k in new:
        flat = new[k].view(-1)
        idx = torch.from_numpy(rng.choice(flat.numel(), size=flat.numel() // 3, replace=False))
        flat[idx] = torch.randn(idx.numel(), generator=g).to(flat.dtype)
    return ModelState(base), ModelState(new)


@pytest.fixture
def setup():
    base, new = make_states()
    enc = encode_delta(base, new, OPTS)
    m = artifact.build_manifest(enc, model_id="m", base_version=3, target_version=4, chunk_size=OPTS.chunk_size,
                                private_key=KEY)
    assert len(enc.chunks) >= 2
    return base, new, enc, m


def snapshot_of(state: ModelState) -> dict[str, np.ndarray]:
    return {n: state.words(n).copy() for n in state}


def assert_untouched(state: ModelState, before: dict[str, np.ndarray], fp: str) -> None:
    for n, w in before.items():
        assert np.array_equal(state.words(n), w), f"{n} was modified"
    assert state.fingerprint == fp == state.audit()


def applier(state, m):
    return artifact.applier_for(state, m)


def test_corrupt_chunk_is_caught_by_its_hash(setup):
    _, _, enc, m = setup
    bad = bytearray(enc.chunks[1])
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(ChunkHashMismatch) as ei:
        artifact.verify_chunk(m, 1, bytes(bad))
    assert ei.value.index == 1


def test_truncated_and_reordered_chunks_are_caught(setup):
    _, _, enc, m = setup
    with pytest.raises(ChunkHashMismatch):
        artifact.verify_chunk(m, 0, enc.chunks[0][:-1])
    with pytest.raises(ChunkHashMismatch):
        artifact.verify_chunk(m, 0, enc.chunks[1])
    with pytest.raises(CodecError):
        artifact.verify_chunk(m, len(enc.chunks), enc.chunks[0])


def test_missing_chunk_applies_nothing(setup):
    base, _, enc, m = setup
    before, fp = snapshot_of(base), base.fingerprint
    ap = applier(base, m)
    for i, c in list(enumerate(enc.chunks))[:-1]:
        ap.add_chunk(i, c)
    with pytest.raises(CodecError, match="missing"):
        ap.commit()
    assert_untouched(base, before, fp)


def test_duplicated_chunk_is_refused(setup):
    base, _, enc, m = setup
    ap = applier(base, m)
    ap.add_chunk(0, enc.chunks[0])
    with pytest.raises(CodecError, match="twice"):
        ap.add_chunk(0, enc.chunks[0])


def test_duplicated_segments_inside_a_signed_artifact_are_refused(setup):
    base, new, enc, _ = setup
    before, fp = snapshot_of(base), base.fingerprint
    segs = split_chunk(enc.chunks[0])
    forged = CHUNK_MAGIC + struct.pack("<I", 2) + b"".join(struct.pack("<I", len(s)) + bytes(s) for s in (segs[0],) * 2)
    ap = Applier(base, kind="delta", specs=enc.specs, n_chunks=1, target_fingerprint=new.fingerprint,
                 base_fingerprint=enc.base_fingerprint)
    ap.add_chunk(0, forged)
    with pytest.raises(CodecError, match="overlap"):
        ap.commit()
    assert_untouched(base, before, fp)


def test_wrong_base_is_refused_before_anything_is_decoded(setup):
    _, new, enc, m = setup
    other = new.clone()
    before, fp = snapshot_of(other), other.fingerprint
    with pytest.raises(WrongBase) as ei:
        applier(other, m)
    assert ei.value.expected == m.base_fingerprint and ei.value.base_version == 3
    assert_untouched(other, before, fp)


def test_result_that_misses_the_signed_target_is_not_written(setup):
    base, new, enc, m = setup
    before, fp = snapshot_of(base), base.fingerprint
    # Chunks of a different change, offered under this manifest's fingerprints.
    _, other_new = make_states(seed=9)
    other = encode_delta(base, ModelState({n: other_new.tensor(n) for n in base}), OPTS)
    ap = Applier(base, kind="delta", specs=enc.specs, n_chunks=len(other.chunks),
                 target_fingerprint=m.target_fingerprint, base_fingerprint=m.base_fingerprint)
    ap.add_chunks(enumerate(other.chunks))
    with pytest.raises(FingerprintMismatch):
        ap.commit()
    assert_untouched(base, before, fp)


@pytest.mark.parametrize("kind", ["unknown", "missing", "reshaped", "retyped"])
def test_tensor_table_mismatch_names_the_tensor(setup, kind):
    base, _, _, m = setup
    tensors = base.tensors()
    if kind == "unknown":
        tensors.pop("w1")
    elif kind == "missing":
        tensors["extra"] = torch.zeros(3)
    elif kind == "reshaped":
        tensors["w1"] = tensors["w1"].reshape(200, 300)
    else:
        tensors["w1"] = tensors["w1"].to(torch.float16)
    state = ModelState((k, tensors[k]) for k in sorted(tensors))
    before, fp = snapshot_of(state), state.fingerprint
    with pytest.raises(TensorTableMismatch) as ei:
        applier(state, m)
    assert getattr(ei.value, kind) == (["extra"] if kind == "missing" else ["w1"])
    assert_untouched(state, before, fp)


def test_signatures(setup):
    _, _, _, m = setup
    pub = KEY.public_key()
    m.verify(pub)
    with pytest.raises(SignatureError, match="another key"):
        m.verify(keys.generate().public_key())
    forged = dataclasses.replace(m, target_version=99)
    with pytest.raises(SignatureError, match="forged"):
        artifact.Manifest.from_bytes(forged.to_bytes()).verify(pub)
    unsigned = dataclasses.replace(m, signature=b"", key_id="")
    with pytest.raises(SignatureError, match="unsigned"):
        unsigned.verify(pub)
    unsigned.verify(pub, allow_unsigned=True)
    with pytest.raises(SignatureError):
        m.verify(None)


def test_unsupported_format_version(setup):
    _, _, _, m = setup
    raw = bytearray(m.to_bytes())
    raw[4:6] = struct.pack("<H", artifact.FORMAT_VERSION + 1)
    with pytest.raises(FormatVersionError) as ei:
        artifact.Manifest.from_bytes(bytes(raw))
    assert ei.value.found == artifact.FORMAT_VERSION + 1


def test_chunk_of_the_previous_codec_version_is_refused(setup):
    base, _, enc, m = setup
    before, fp = snapshot_of(base), base.fingerprint
    ap = applier(base, m)
    with pytest.raises(FormatVersionError) as ei:
        ap.add_chunk(0, b"P2C1" + enc.chunks[0][4:])
    assert (ei.value.found, ei.value.supported) == (1, 2)
    with pytest.raises(CodecError, match="missing"):
        ap.commit()
    assert_untouched(base, before, fp)


@pytest.fixture
def bucketed():
    """An optimizer-like delta: small weights change more often, so positions use buckets."""
    g = torch.Generator().manual_seed(1)
    master = torch.randn(200_000, generator=g) * 0.02
    base = ModelState({"w": master.to(torch.bfloat16)})
    new = ModelState({"w": (master + 2e-5 * torch.randn(200_000, generator=g)).to(torch.bfloat16)})
    enc = encode_delta(base, new, CodecOptions(chunk_size=64 << 10))
    m = artifact.build_manifest(enc, model_id="m", base_version=3, target_version=4, chunk_size=64 << 10,
                                private_key=KEY)
    return base, new, enc, m


def _rebuilt_chunk(enc, edit) -> bytes:
    """The first chunk with its first segment passed through ``edit(bytearray) -> bytes``."""
    segs = [bytes(s) for s in split_chunk(enc.chunks[0])]
    segs[0] = edit(bytearray(segs[0]))
    return CHUNK_MAGIC + struct.pack("<I", len(segs)) + b"".join(struct.pack("<I", len(s)) + s for s in segs)


_BODY = 21  # u8 kind, u32 tensor, u64 start, u64 stop; then u32 n, u8 n_buckets, u16 thresholds


def _set_threshold(value: int, last: bool = False):
    def edit(seg: bytearray) -> bytes:
        n_b = seg[_BODY + 4]
        assert n_b >= 2, "the fixture's first segment uses bucketed positions"
        at = _BODY + 5 + 2 * (n_b - 2 if last else 0)
        seg[at:at + 2] = struct.pack("<H", value)
        return bytes(seg)
    return edit


def _set_buckets(value: int):
    def edit(seg: bytearray) -> bytes:
        seg[_BODY + 4] = value
        return bytes(seg)
    return edit


@pytest.mark.parametrize("edit, match", [
    (_set_threshold(0), "bucket"),  # bucket 0 would be empty by construction
    (_set_threshold(0x100, last=True), "bucket threshold out of range"),  # bf16 exponents end at 255
    (_set_buckets(0), "buckets"),
    (_set_buckets(9), "buckets"),
])
def test_bad_bucket_table_is_a_codec_error(bucketed, edit, match):
    base, _, enc, m = bucketed
    before, fp = snapshot_of(base), base.fingerprint
    assert parse_segment(memoryview(bytes(split_chunk(enc.chunks[0])[0]))).thresholds.shape[0] >= 1
    ap = applier(base, m)
    with pytest.raises(CodecError, match=match):
        ap.add_chunk(0, _rebuilt_chunk(enc, edit))
    assert_untouched(base, before, fp)


def test_ranks_past_the_bucket_are_a_codec_error(bucketed):
    """A bucket threshold moved so that a bucket holds fewer elements than its ranks need."""
    base, _, enc, m = bucketed
    before, fp = snapshot_of(base), base.fingerprint
    p = parse_segment(memoryview(bytes(split_chunk(enc.chunks[0])[0])))
    last = int(p.thresholds[-1])
    ap = applier(base, m)
    with pytest.raises(CodecError):
        ap.add_chunk(0, _rebuilt_chunk(enc, _set_threshold_at(len(p.thresholds) - 1, 0xFF if last < 0xFF else 1)))
    assert_untouched(base, before, fp)


def _set_threshold_at(i: int, value: int):
    def edit(seg: bytearray) -> bytes:
        seg[_BODY + 5 + 2 * i:_BODY + 7 + 2 * i] = struct.pack("<H", value)
        return bytes(seg)
    return edit


def test_artifact_file_truncated_or_padded(setup, tmp_path):
    _, _, enc, m = setup
    path = tmp_path / "d.p2s"
    artifact.write_file(path, m, enc.chunks)
    data = path.read_bytes()
    for cut in (3, 10, 20, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises((TruncatedError, CodecError)):
            artifact.ArtifactFile(path, KEY.public_key())
    path.write_bytes(data + b"x")
    with pytest.raises(CodecError, match="after the last chunk"):
        artifact.ArtifactFile(path, KEY.public_key())
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CodecError, match="not a p2psync artifact"):
        artifact.ArtifactFile(path, KEY.public_key())


# --- fuzzing: random and mutated bytes raise only typed errors --------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_manifest_parser_random_bytes(data):
    for blob in (data, b"P2SM" + data, b"P2SM\x01\x00" + data):
        try:
            artifact.Manifest.from_bytes(blob)
        except P2PSyncError:
            pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_manifest_parser_mutated_bytes(setup, data):
    _, _, _, m = setup
    raw = bytearray(m.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del raw[i:]
            if not raw:
                raw = bytearray(b"P")
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        parsed = artifact.Manifest.from_bytes(bytes(raw))
        parsed.verify(KEY.public_key())
        assert parsed == m  # anything that still verifies must be the original
    except P2PSyncError:
        pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_decoder_mutated_and_random_chunks(setup, data):
    _mutated_chunk_applies_exactly_or_nothing(setup, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_decoder_mutated_bucketed_chunks(bucketed, data):
    """The same with bucketed positions (bucket tables, thresholds, ranks located in the base)."""
    _mutated_chunk_applies_exactly_or_nothing(bucketed, data)


def _mutated_chunk_applies_exactly_or_nothing(case, data) -> None:
    base0, new, enc, _ = case
    base = base0.clone()
    fp = base.fingerprint
    if data.draw(st.booleans()):
        raw = bytearray(data.draw(st.binary(max_size=300)))
        if data.draw(st.booleans()):
            raw[0:0] = CHUNK_MAGIC
    else:
        raw = bytearray(enc.chunks[0])
        for _ in range(data.draw(st.integers(1, 6))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        if data.draw(st.booleans()):
            del raw[data.draw(st.integers(1, len(raw))):]
    ap = Applier(base, kind="delta", specs=enc.specs, n_chunks=len(enc.chunks),
                 target_fingerprint=enc.target_fingerprint, base_fingerprint=enc.base_fingerprint)
    try:
        ap.add_chunk(0, bytes(raw))
        for i, c in list(enumerate(enc.chunks))[1:]:
            ap.add_chunk(i, c)
        ap.commit()
    except P2PSyncError:
        assert base.fingerprint == fp == base.audit()
    else:  # a mutation that changes nothing decoded (e.g. padding bits) must still give the exact target
        assert all(np.array_equal(base.words(n), new.words(n)) for n in new)
