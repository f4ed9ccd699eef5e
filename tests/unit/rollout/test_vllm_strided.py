"""Tensors held as one strided block of a parameter (transposed, blocked like CPU MoE experts, at an
offset in a fused parameter): their ranges are copied out of the live memory by a compiled gather, and
a delta of many small segments lands bit-exact through it (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.state import ModelState
from rollout.engines.vllm.placement.boxes import Placement, compress
from rollout.engines.vllm.apply.weights import LiveWeights

R, C = 6, 2048  # checkpoint shape of the transposed tensor: a 1024-element segment lies inside one row
E, I, H = 3, 32, 64  # experts, rows, columns of the blocked one


def _blocked(rows: int, cols: int) -> np.ndarray:
    """Flat position, in a [rows, cols] parameter stored as 16-row blocks column by column (the CPU
    MoE kernel's repacking), of each row-major element."""
    r, c = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
    return (r // 16) * 16 * cols + c * 16 + r % 16


class _Params(torch.nn.Module):
    """Live parameters: ``t`` holds ``a.weight`` transposed; ``w13`` holds expert ``e``'s ``b.{e}``
    blocked at offset ``e * I * H``; ``f`` holds ``c`` and ``d`` one after the other."""

    def __init__(self, state: ModelState) -> None:
        super().__init__()
        self.places: dict[str, Placement] = {}
        ck = np.arange(R * C, dtype=np.int64)
        r, c = np.divmod(ck, C)
        t = np.empty(R * C, dtype=np.uint16)
        t[c * R + r] = state.words("a.weight")
        self.places["a.weight"] = compress("a.weight", "t", (R, C), ck, c * R + r)
        w13 = np.empty(E * I * H, dtype=np.uint16)
        for e in range(E):
            dst = e * I * H + _blocked(I, H)
            w13[dst] = state.words(f"b.{e}")
            self.places[f"b.{e}"] = compress(f"b.{e}", "w13", (I, H), np.arange(I * H, dtype=np.int64), dst)
        f = np.concatenate([state.words("c"), state.words("d")])
        self.places["c"] = compress("c", "f", (7, 9), np.arange(63, dtype=np.int64), np.arange(63, dtype=np.int64))
        self.places["d"] = compress("d", "f", (5, 3, 4), np.arange(60, dtype=np.int64),
                                    63 + np.arange(60, dtype=np.int64))
        for name, words, shape in (("t", t, (C, R)), ("w13", w13, (E, I, H)), ("f", f, (123,))):
            tensor = torch.from_numpy(words.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
            self.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


def _state(seed: int) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    items = [("a.weight", torch.randn(R, C, generator=g))] + [(f"b.{e}", torch.randn(I, H, generator=g))
                                                             for e in range(E)]
    items += [("c", torch.randn(7, 9, generator=g)), ("d", torch.randn(5, 3, 4, generator=g))]
    return ModelState([(n, t.to(torch.bfloat16)) for n, t in items])


def _step(old: ModelState, seed: int) -> ModelState:
    new = old.clone()
    g = np.random.default_rng(seed)
    for n in new:
        w = new.words(n)
        idx = g.choice(w.shape[0], size=max(1, w.shape[0] // 7), replace=False)
        w[idx] ^= g.integers(1, 64, size=idx.shape[0]).astype(w.dtype)
    new.invalidate()
    return new


def test_a_range_of_a_strided_block_is_the_words_its_positions_map_to():
    state = _state(0)
    model = _Params(state)
    live = LiveWeights(model, state.specs, places=model.places)
    names = [s.name for s in state.specs]
    g = np.random.default_rng(3)
    for name in ("a.weight", "b.1", "b.2"):
        i = names.index(name)
        assert live._maps[i] is not None, name
        n = state.specs[i].numel
        for start, stop in [(0, n), (0, 1), (n - 1, n), (5, 6), (3, 3)] + [
                tuple(sorted(g.integers(0, n + 1, size=2))) for _ in range(50)]:
            got = live.host_words(i, int(start), int(stop))
            assert got.flags.c_contiguous and got.ndim == 1
            assert np.array_equal(got, state.words(name)[start:stop]), (name, start, stop)
    assert live._maps[names.index("c")] is None and live.offset[names.index("c")] == 0  # the fast path


@pytest.mark.parametrize("word", [np.uint8, np.uint16, np.uint32])
def test_the_compiled_gather_and_map_give_the_words_the_placement_gives(word):
    """:func:`kernels.gather_mapped` (16-row blocks copied by a vector transpose, other lines in
    groups, partial lines alone) and :func:`kernels.map_positions` against the placement's own
    positions, for blocked experts (widths a multiple of 16 or not, 16 rows or many), transposed and
    one-dimensional strided tensors, over random ranges."""
    from rollout.engines.vllm.apply import kernels

    g = np.random.default_rng(5)
    cases = [((r, c), _blocked(r, c)) for r, c in ((64, 1024), (48, 40), (16, 17), (80, 33))]
    for rows, cols in ((6, 2048), (40, 24), (17, 3)):
        r, c = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
        cases.append(((rows, cols), c * rows + r))
    cases.append(((100,), np.arange(100, dtype=np.int64) * 3))
    for shape, layout in cases:
        n = int(np.prod(shape))
        mem = g.integers(0, 250, 7 + int(layout.max()) + 5).astype(word)
        bm = compress("x", "w", shape, np.arange(n, dtype=np.int64), layout + 7).block_map()
        assert bm is not None, shape
        cstr, dstr = np.array(bm[2], dtype=np.int64), np.array(bm[3], dtype=np.int64)
        for k in range(40):
            a = 0 if k == 0 else int(g.integers(0, n + 1))
            b = n if k == 0 else int(g.integers(a, n + 1))
            got = kernels.gather_mapped(mem, a, b, bm[0], cstr, dstr, np.empty(b - a, dtype=word))
            assert np.array_equal(got, mem[layout[a:b] + 7]), (shape, a, b)
            pos = g.permutation(np.arange(a, b, dtype=np.int64))[:(b - a) // 3]
            assert np.array_equal(kernels.map_positions(pos, bm[0], cstr, dstr), layout[pos] + 7), shape


@pytest.mark.parametrize("segment", [1024, 1536, 1 << 16])
def test_deltas_of_small_segments_land_through_strided_blocks(segment):
    """Segments shorter than one row of the transposed tensor (the range is then one strided row
    of memory), and longer ones, over several versions."""
    versions = [_state(0)]
    for v in range(1, 4):
        versions.append(_step(versions[-1], v))
    model = _Params(versions[0])
    live = LiveWeights(model, versions[0].specs, places=model.places)
    assert live._maps[0] is not None  # the transposed tensor is read and written as a strided block
    assert live.fingerprint == versions[0].fingerprint
    opts = CodecOptions(chunk_size=64 << 10, segment_elements=segment)
    for v in range(1, 4):
        enc = encode_delta(versions[v - 1], versions[v], opts)
        m = build_manifest(enc, model_id="t", base_version=v - 1, target_version=v, chunk_size=64 << 10,
                           private_key=None)
        assert live.apply_delta(m, enc.chunks) == versions[v].fingerprint
        for name in versions[v]:
            assert np.array_equal(live.read(name), versions[v].words(name)), (v, name)
    assert live.audit() == versions[3].fingerprint


def test_a_refused_write_through_strided_blocks_is_taken_back():
    from p2psync.errors import FingerprintMismatch

    old, new = _state(0), None
    new = _step(old, 1)
    model = _Params(old)
    live = LiveWeights(model, old.specs, places=model.places)
    assert all(live._maps[i] is not None for i in range(1 + E))  # written by the mapped compiled pass
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=1024))
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=64 << 10, private_key=None)
    changes, _ = live.decode(m, enc.chunks)
    with pytest.raises(FingerprintMismatch):
        live.commit(changes, "0" * 64)
    for n, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
    assert live.audit() == old.fingerprint
