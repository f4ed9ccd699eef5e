"""Raw snapshots made in two passes (hash every chunk for the manifest, then encode again and hand
each chunk over): the same artifact as the one-pass encode, a few chunks of memory whatever the
model's size, and nothing half-written when something fails."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch

from p2psync import keys
from p2psync.artifact import ArtifactFile, FileWriter, build_manifest, snapshot_chunks_to, snapshot_manifest
from p2psync.codec.encode import CodecOptions, encode_snapshot
from p2psync.errors import ChunkHashMismatch, CodecError
from p2psync.state import ModelState
from p2psync.store import STATE_FILE, VersionStore


def _state(scale: int = 1, seed: int = 3) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState({
        "embed": torch.randn(scale * 90_000, generator=g).bfloat16(),
        "norm": torch.randn(777, generator=g),  # fp32
        "scale": torch.tensor(1.5),  # 0-d
        "q": torch.randint(-128, 127, (scale * 3_000, 17), generator=g, dtype=torch.int8),
        "head": torch.randn(scale * 40_000, generator=g).half(),
    })


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [64 << 10, 1 << 20])
def test_two_passes_make_the_artifact_of_one(threads, chunk):
    state = _state()
    priv = keys.generate()
    opts = CodecOptions(chunk_size=chunk, zstd_level=0, threads=threads)
    whole = encode_snapshot(state, opts)
    one = build_manifest(whole, model_id="m", target_version=7, chunk_size=chunk, private_key=priv, created=1.0)
    two = snapshot_manifest(state, opts, model_id="m", target_version=7, private_key=priv)
    assert two.chunks == one.chunks and len(two.chunks) > (2 if chunk == 64 << 10 else 0)
    assert two.target_fingerprint == one.target_fingerprint == state.fingerprint
    assert two.tensors == one.tensors and two.kind == "snapshot"
    two.verify(priv.public_key())
    got: list[tuple[int, bytes]] = []
    snapshot_chunks_to(state, two, opts, lambda i, c: got.append((i, bytes(c))))
    assert [i for i, _ in got] == list(range(len(whole.chunks)))
    assert [c for _, c in got] == [bytes(c) for c in whole.chunks]


def test_weights_that_moved_stop_the_second_pass_at_the_first_differing_chunk():
    state = _state()
    opts = CodecOptions(chunk_size=64 << 10, zstd_level=0)
    m = snapshot_manifest(state, opts, model_id="m", target_version=1)
    moved = state.clone()
    moved.words("head")[-1] ^= 1  # the last tensor: the last chunk differs
    moved.invalidate()
    got: list[int] = []
    with pytest.raises(ChunkHashMismatch) as err:
        snapshot_chunks_to(moved, m, opts, lambda i, c: got.append(i))
    assert err.value.index == len(m.chunks) - 1
    assert got == list(range(len(m.chunks) - 1))  # only chunks that matched were handed over
    # Another chunk size: the count differs, and nothing past the manifest is handed over.
    other = CodecOptions(chunk_size=128 << 10, zstd_level=0)
    with pytest.raises(CodecError):
        snapshot_chunks_to(state, m, other, lambda i, c: None, verify=False)


def _peak(fn) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_checkpoint_takes_a_few_chunks_of_memory_not_a_copy_of_the_model(tmp_path):
    state = _state(scale=1600)  # ~500 MB of weights, 30 checkpoint chunks of 16 MiB
    size = state.nbytes
    store = VersionStore.open(tmp_path, keys.generate().public_key())
    # What the measurement sees: the one-pass encode holds an encoded copy of every weight.
    assert _peak(lambda: encode_snapshot(state, CodecOptions(chunk_size=16 << 20, zstd_level=0))) > size
    # Two threads, each segment copied a few times on its way into a chunk: about 7 chunks,
    # whatever the model's size (0.7 % of a 16 GB model).
    peak = _peak(lambda: store.save_state(state, 5))
    assert peak < 10 * (16 << 20) < size, (peak, size)
    loaded, version = store.load_state()
    assert version == 5 and loaded.audit() == state.audit()


def test_a_checkpoint_that_fails_half_way_leaves_the_previous_one(tmp_path, monkeypatch):
    store = VersionStore.open(tmp_path, keys.generate().public_key())
    old = _state(scale=100)  # two 16 MiB chunks
    store.save_state(old, 1)
    real_put = FileWriter.put
    seen = []

    def full_disk(self, index, data):
        seen.append(index)
        if index == 1:
            raise OSError(28, "No space left on device")
        real_put(self, index, data)

    monkeypatch.setattr(FileWriter, "put", full_disk)
    with pytest.raises(OSError):
        store.save_state(_state(scale=100, seed=4), 2)
    monkeypatch.undo()
    assert seen == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(STATE_FILE)) == [STATE_FILE]
    loaded, version = store.load_state()
    assert version == 1 and loaded.audit() == old.audit()


def test_a_file_writer_refuses_chunks_out_of_order_or_missing(tmp_path):
    state = _state()
    opts = CodecOptions(chunk_size=64 << 10, zstd_level=0)
    enc = encode_snapshot(state, opts)
    m = build_manifest(enc, model_id="m", target_version=0, chunk_size=opts.chunk_size)
    path = tmp_path / "a.p2s"
    with pytest.raises(CodecError, match="out of order"):
        with FileWriter(path, m) as w:
            w.put(1, enc.chunks[1])
    with pytest.raises(CodecError, match="chunks written"):
        with FileWriter(path, m) as w:
            w.put(0, enc.chunks[0])
    assert list(tmp_path.iterdir()) == []
    with FileWriter(path, m) as w:
        for i, c in enumerate(enc.chunks):
            w.put(i, c)
    with ArtifactFile(path, None, allow_unsigned=True) as art:
        assert [c for _, c in art.chunks()] == [bytes(c) for c in enc.chunks]
