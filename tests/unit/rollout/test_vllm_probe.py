"""Placement derived by probing a model's own ``load_weights`` (stand-in modules, no vLLM needed):
each checkpoint element is found where the loader copies it (fused rows, a transposed load, a
blocked repacking's strided block, a permutation that no block describes), the live weights are
never written, and a loader that computes values, writes an element twice or spreads a tensor over
two parameters is refused at init naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2psync.state import TensorSpec
from rollout.engines.vllm.placement import probe
from rollout.engines.vllm.placement import readback
from rollout.engines.vllm.placement.rules import LayoutError
from rollout.engines.vllm.placement.boxes import compress, maximal_runs
from rollout.engines.vllm.placement.probe import derive
from rollout.engines.vllm.placement.kernels import OK, runs

Q, K, H = 8, 4, 6  # rows of q, rows of k, columns


class _Fused(torch.nn.Module):
    """``qkv`` holds q's rows then k's; ``t`` holds ``w`` transposed; ``p`` holds ``v`` permuted;
    ``mode`` breaks the loader one way."""

    def __init__(self, mode: str = "copy") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(Q + K, H, generator=g).to(torch.bfloat16), requires_grad=False)
        self.t = torch.nn.Parameter(torch.randn(H, Q, generator=g).to(torch.bfloat16), requires_grad=False)
        self.p = torch.nn.Parameter(torch.randn(10, generator=g).to(torch.bfloat16), requires_grad=False)
        self.mode = mode

    def load_weights(self, weights):
        for name, t in weights:
            if name == "q":
                src = {"computed": t * 0.5, "negated": -t}.get(self.mode, t)  # a scale (not a copy)
                if self.mode == "spread":  # row 0 elsewhere (v is not loaded then)
                    self.qkv.data[1:Q].copy_(src[1:])
                    self.p.data[:H].copy_(t[0])
                else:
                    self.qkv.data[:Q].copy_(src)
                if self.mode == "twice":
                    self.qkv.data[Q:Q + 1].copy_(t[:1])
            elif name == "k":
                if self.mode != "twice":
                    self.qkv.data[Q:].copy_(t)
            elif name == "w":
                self.t.data.copy_(t.t())
            elif name == "v":
                if self.mode != "spread":
                    self.p.data.copy_(t[torch.tensor([3, 1, 4, 0, 9, 2, 6, 5, 8, 7])])
            else:
                raise KeyError(name)


SPECS = [TensorSpec("q", "BF16", (Q, H)), TensorSpec("k", "BF16", (K, H)), TensorSpec("w", "BF16", (Q, H)),
         TensorSpec("v", "BF16", (10,))]


def _bits(m: torch.nn.Module) -> dict[str, bytes]:
    return {n: p.detach().view(torch.int16).numpy().tobytes() for n, p in m.named_parameters()}


def _pairs(pl) -> tuple[np.ndarray, np.ndarray]:
    ck, dst = map(np.concatenate, zip(*pl.chunks()))
    order = np.argsort(ck)
    return ck[order], dst[order]


@pytest.fixture(params=["runs", "scatter", "passes"])
def read_back(request, monkeypatch):
    """Each probe read back as runs; or (a cap of 4 runs) by the scatter a transposed load falls to;
    or fed 7 ids per pass, as a layer of more than 2**24 elements is (runs cut by passes joined)."""
    if request.param == "scatter":
        monkeypatch.setattr(readback, "_MAX_RUNS", 4)
    if request.param == "passes":
        monkeypatch.setattr(probe, "PASS_IDS", 7)
    return request.param


def test_every_element_is_found_where_the_loader_copies_it_and_nothing_is_written(read_back):
    m = _Fused()
    before = _bits(m)
    places = derive(m, SPECS)
    assert _bits(m) == before
    assert {n: (pl.param, pl.whole) for n, pl in places.items()} == {
        "q": ("qkv", True), "k": ("qkv", True), "w": ("t", True), "v": ("p", True)}
    assert places["q"].simple() == 0 and places["k"].simple() == Q * H  # one contiguous block each
    ck, dst = _pairs(places["w"])
    r, c = np.divmod(ck, H)
    assert np.array_equal(dst, c * Q + r)  # the transposed load, one strided block
    assert len(places["w"].families) == 1 and places["w"].families[0].ck.shape[0] == 1
    ck, dst = _pairs(places["v"])
    assert np.array_equal(ck, np.arange(10)) and np.array_equal(dst, np.argsort([3, 1, 4, 0, 9, 2, 6, 5, 8, 7]))


@pytest.mark.parametrize("mode, message", [
    ("computed", "q: vLLM's loader computes the values of qkv"),
    ("negated", "q: vLLM's loader computes the values of qkv"),
    ("twice", "q: vLLM's loader writes some of its elements to more than one place in qkv"),
    ("spread", "q: vLLM's loader spreads it over several parameters (['p', 'qkv'])"),
])
def test_a_loader_that_does_not_copy_each_element_once_is_refused_naming_the_tensor(mode, message, read_back):
    m = _Fused(mode)
    before = _bits(m)
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        derive(m, SPECS)
    assert _bits(m) == before


class _Router(torch.nn.Module):
    """A MoE router kept in ``float32`` for a ``bfloat16`` checkpoint (GLM-4-MoE's gate and correction
    bias): the loader copies (``Tensor.copy_`` widens), or (``mode``) computes, or narrows (a float32
    checkpoint tensor into a bfloat16 parameter: ``copy_`` rounds)."""

    def __init__(self, mode: str = "copy") -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.zeros(4, H), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16 if mode == "narrowed" else torch.float32),
                                       requires_grad=False)
        self.mode = mode

    def load_weights(self, weights):
        for name, t in weights:
            param = {"router.weight": self.gate, "router.bias": self.bias}[name]
            param.data.copy_(t.float() * 0.5 + 0.25 if self.mode == "computed" and name == "router.bias" else t)


ROUTER = [TensorSpec("router.weight", "BF16", (4, H)), TensorSpec("router.bias", "BF16", (4,))]


def test_a_loader_that_widens_a_copy_is_placed_with_the_cast_recorded(read_back):
    m = _Router()
    places = derive(m, ROUTER)
    assert {n: (pl.param, pl.simple(), pl.cast) for n, pl in places.items()} == {
        "router.weight": ("gate", 0, "float32"), "router.bias": ("bias", 0, "float32")}
    assert not m.gate.any() and not m.bias.any()  # nothing written


def test_a_loader_that_rounds_a_copy_is_placed_with_the_cast_recorded(read_back):
    m = _Router("narrowed")
    places = derive(m, [ROUTER[0], TensorSpec("router.bias", "F32", (4,))])
    assert {n: (pl.param, pl.simple(), pl.cast) for n, pl in places.items()} == {
        "router.weight": ("gate", 0, "float32"), "router.bias": ("bias", 0, "bfloat16")}
    assert not m.gate.any() and not m.bias.any()  # nothing written


@pytest.mark.parametrize("mode, spec, message", [
    ("computed", ROUTER, "router.bias: vLLM's loader computes the values of bias"),
    ("copy", [ROUTER[0], TensorSpec("router.bias", "I32", (4,))],
     "router.bias: vLLM's loader converts it from int32 to float32"),
])
def test_a_conversion_that_is_not_a_float_cast_is_refused_naming_the_tensor(mode, spec, message):
    with pytest.raises(LayoutError, match=message):
        derive(_Router(mode), spec)


@pytest.mark.parametrize("layout", ["row-major", "transposed", "blocked", "offset rows", "every other"])
def test_compress_finds_one_block_wherever_there_is_one(layout):
    """The compiled factorisation against the layouts vLLM's loaders produce; the element map it gives
    back is the pairs it was given."""
    rows, cols = 32, 24
    ck = np.arange(rows * cols, dtype=np.int64)
    r, c = np.divmod(ck, cols)
    dst = {"row-major": ck + 5, "transposed": c * rows + r, "blocked": (r // 16) * 16 * cols + c * 16 + r % 16,
           "offset rows": r * (cols + 8) + c + 100, "every other": ck * 2}[layout]
    for given in (ck, None):
        pl = compress("x", "w", (rows, cols), given, dst, ck_sorted=True)
        assert len(pl.families) == 1 and pl.families[0].ck.shape[0] == 1
        got_ck, got_dst = _pairs(pl)
        assert np.array_equal(got_ck, ck) and np.array_equal(got_dst, dst)
        assert pl.run() == ((0, 5, rows * cols) if layout == "row-major" else None)  # one run on both sides
    rows_of = compress("x", "w", (rows, cols), ck[cols * 4:cols * 9], ck[cols * 4:cols * 9] + 3, ck_sorted=True)
    assert rows_of.run() == (cols * 4, cols * 4 + 3, cols * 5)  # a rank's rows of the tensor


def test_compress_falls_back_to_runs_where_no_block_fits():
    ck = np.array([0, 1, 2, 5, 6, 9], dtype=np.int64)
    dst = np.array([10, 11, 12, 0, 1, 40], dtype=np.int64)
    pl = compress("x", "w", (10,), ck[::-1].copy(), dst[::-1].copy())
    got_ck, got_dst = _pairs(pl)
    assert np.array_equal(got_ck, ck) and np.array_equal(got_dst, dst)
    with pytest.raises(LayoutError, match="more than one place"):
        compress("x", "w", (10,), np.array([1, 1]), np.array([0, 1]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_probe_reads_back_as_its_maximal_runs_across_block_edges(dtype):
    """The compiled read-back (whole blocks of zeros or of a run going on taken at once) against the
    runs of the pairs themselves: rows shorter and longer than a block, abutting rows that merge, a
    permuted stretch, zeros around them."""
    n, total = 9000, 12000
    v = np.zeros(n, dtype=dtype)
    rows = [(400, 40, 0), (440, 40, 0), (0, 7, 1), (1000, 1500, 513), (3000, 600, 0), (3600, 40, 0),
            (5000, 1, 1), (6000, 40, 9), (8000, 2000, 0)]  # (first id, length, gap after)
    pos = 3
    for start, size, gap in rows:
        v[pos:pos + size] = np.arange(start + 1, start + size + 1)
        pos += size + gap
    v[n - 30:n - 20] = np.random.default_rng(1).permutation(10) + total - 10 + 1  # a permutation: runs of one
    held = np.flatnonzero(v)
    ck, dst = v[held].astype(np.int64) - 1, held
    want = sorted(zip(*maximal_runs(ck, dst)))  # the same runs, in checkpoint order
    p0, i0, ln = (np.empty(n, dtype=np.int64) for _ in range(3))
    got, bad = runs(v, total, p0, i0, ln)
    assert bad == OK
    assert sorted(zip(i0[:got], p0[:got], ln[:got])) == want
    assert runs(v, total, p0[:2], i0[:2], ln[:2]) == (-1, OK)  # more runs than room: the caller scatters
    for word in (0.5, -3.0, float(total + 1), np.nan):  # not an id: where it is
        w = v.copy()
        w[held[len(held) // 2]] = word
        assert runs(w, total, p0, i0, ln)[1] == held[len(held) // 2]
