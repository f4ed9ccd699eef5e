"""Deltas applied by tensor-parallel ranks together (gloo processes, vLLM-shaped slices, no vLLM).

Each rank holds its slice of a model laid out as vLLM shards it (fused qkv with a
kv head replicated on every rank, fused gate/up, row-parallel o/down projections
split by columns, a vocabulary-parallel embedding with padding rows, replicated
norms). The ranks must reach the trainer's whole-model fingerprint, hold exactly
their slices of the new words, and refuse together, each keeping its old words,
when any one fails.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import numpy as np
import pytest
import torch

from p2psync.artifact import build_manifest
from p2psync.codec.encode import CodecOptions, encode_delta
from p2psync.errors import CodecError, P2PSyncError
from p2psync.state import ModelState
from rollout_helpers import apply_with_failing_writes

H, HEADS, KV, HD, INTER, VOCAB, PAD = 32, 4, 1, 8, 48, 64, 2
P = "model.layers.0."
SHAPES = {
    "model.embed_tokens.weight": (VOCAB, H),
    P + "input_layernorm.weight": (H,),
    P + "self_attn.q_proj.weight": (HEADS * HD, H),
    P + "self_attn.k_proj.weight": (KV * HD, H),
    P + "self_attn.v_proj.weight": (KV * HD, H),
    P + "self_attn.o_proj.weight": (H, HEADS * HD),
    P + "mlp.gate_proj.weight": (INTER, H),
    P + "mlp.up_proj.weight": (INTER, H),
    P + "mlp.down_proj.weight": (H, INTER),
    "model.norm.weight": (H,),
}


# Stand-ins for vLLM's layers, recognised as vLLM's are: by what they hold (the sizes and shards vLLM's
# layers record, :func:`rollout.engines.vllm.placement.rules._split`), never by a class name.
class _Linear(torch.nn.Module):
    """What vLLM's linear layers record: the whole layer's sizes and this rank's part of them."""

    def __init__(self, w: torch.Tensor, rank: int, tp: int, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.tp_rank, self.tp_size = rank, tp
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition, self.input_size_per_partition = w.shape


class _QKVSlice(_Linear):
    """vLLM's ``QKVParallelLinear``: [q; k; v] rows, a kv head replicated when there are more ranks."""

    def __init__(self, w: torch.Tensor, rank: int, tp: int) -> None:
        super().__init__(w, rank, tp, H, (HEADS + 2 * KV) * HD)
        self.head_size = HD
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = HEADS // tp, max(1, KV // tp), max(1, tp // KV)


class _GateUpSlice(_Linear):
    """vLLM's ``MergedColumnParallelLinear``: this rank's rows of [gate; up]."""

    def __init__(self, w: torch.Tensor, rank: int, tp: int) -> None:
        super().__init__(w, rank, tp, H, 2 * INTER)
        self.output_sizes = [INTER, INTER]


class _RowSlice(_Linear):
    """vLLM's ``RowParallelLinear``: this rank's block of input columns."""

    def __init__(self, w: torch.Tensor, rank: int, tp: int) -> None:
        super().__init__(w, rank, tp, w.shape[1] * tp, w.shape[0])


class _VocabSlice(torch.nn.Module):
    """vLLM's ``VocabParallelEmbedding``: this rank's vocabulary rows, then padding rows."""

    def __init__(self, w: torch.Tensor, rank: int, tp: int) -> None:
        super().__init__()
        n = VOCAB // tp
        self.weight = torch.nn.Parameter(torch.cat([w[rank * n:(rank + 1) * n], torch.zeros(PAD, H, dtype=w.dtype)]),
                                         requires_grad=False)
        self.tp_rank, self.tp_size = rank, tp
        self.shard_indices = type("S", (), {"org_vocab_start_index": rank * n, "org_vocab_end_index": (rank + 1) * n})


class Norm(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone(), requires_grad=False)


def _rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[1] // tp
    return w[:, rank * n:(rank + 1) * n].contiguous()


def rank_model(full: dict[str, torch.Tensor], rank: int, tp: int) -> torch.nn.Module:
    """This rank's slices of ``full``, in vLLM's module and parameter layout."""
    kv_rank = rank // max(1, tp // KV)
    k, v = full[P + "self_attn.k_proj.weight"], full[P + "self_attn.v_proj.weight"]
    qkv = torch.cat([_rows(full[P + "self_attn.q_proj.weight"], rank, tp),
                     _rows(k, kv_rank, min(tp, KV)), _rows(v, kv_rank, min(tp, KV))])
    gate_up = torch.cat([_rows(full[P + "mlp.gate_proj.weight"], rank, tp), _rows(full[P + "mlp.up_proj.weight"], rank, tp)])
    layer = torch.nn.Module()
    layer.input_layernorm = Norm(full[P + "input_layernorm.weight"])
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = _QKVSlice(qkv, rank, tp)
    layer.self_attn.o_proj = _RowSlice(_cols(full[P + "self_attn.o_proj.weight"], rank, tp), rank, tp)
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_up_proj = _GateUpSlice(gate_up, rank, tp)
    layer.mlp.down_proj = _RowSlice(_cols(full[P + "mlp.down_proj.weight"], rank, tp), rank, tp)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = _VocabSlice(full["model.embed_tokens.weight"], rank, tp)
    model.model.layers = torch.nn.ModuleList([layer])
    model.model.norm = Norm(full["model.norm.weight"])
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    model.config = type("C", (), {"tie_word_embeddings": False})
    return model


def _state(seed: int) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState([(n, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)) for n, s in SHAPES.items()])


def _delta(old: ModelState, seed: int):
    new = old.clone()
    rng = np.random.default_rng(seed)
    for n in new:
        w = new.words(n)
        idx = rng.choice(w.shape[0], size=max(1, w.shape[0] // 20), replace=False)
        w[idx] ^= rng.integers(1, 8, size=idx.shape[0]).astype(w.dtype)
    new.words(P + "input_layernorm.weight")[:4] = [0x7FC1, 0x8000, 0x0001, 0xFF80]  # NaN payload, -0, subnormal, -inf
    new.invalidate()
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=1024))
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=64 << 10, private_key=None)
    return new, m, enc.chunks


def _params(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: p.detach().view(torch.int16).numpy().tobytes() for n, p in model.named_parameters()}


def _streamed_apply(live, apply, m, chunks) -> str:
    """What the backend does with ``overlap`` on: each rank decodes its chunks as they are handed over
    (voted), then the ranges rebuilt together, then the check and commit."""
    import asyncio

    from rollout.engines.vllm.apply.stream import Streamed
    from rollout.engines.vllm.worker.fetch import decoding
    from rollout.engines.vllm.apply.ranks import together

    stream = together(live.group, lambda: Streamed(live, m), "refused")
    stream.agree()

    async def source(on_chunk):
        for i, c in enumerate(chunks):
            if c is not None:
                await on_chunk(i, memoryview(c))

    together(live.group, lambda: asyncio.run(decoding(stream, source, 2)), "refused")
    return apply(m, chunks, stream)


def _rank(rank: int, port: int, old: dict, new: dict, fps: tuple[str, str], m, chunks, out, sliced: bool,
          streamed: bool = False, gather_words: int | None = None, tp: int = 2) -> None:
    import torch.distributed as dist

    if gather_words is not None:  # several collectives, each rebuilding several ranges
        from rollout.engines.vllm.apply import slices

        slices._GATHER_WORDS = gather_words

    from rollout.engines.vllm.apply.ranks import RankRefused, TorchGroup
    from rollout.engines.vllm.apply.weights import LiveWeights

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
        group = TorchGroup(dist.group.WORLD)
        specs = list(m.tensors)
        model = rank_model({n: torch.from_numpy(w).view(torch.bfloat16).reshape(SHAPES[n]) for n, w in old.items()}, rank, tp)
        want_new = _params(rank_model({n: torch.from_numpy(w).view(torch.bfloat16).reshape(SHAPES[n]) for n, w in new.items()}, rank, tp))
        before = _params(model)
        live = LiveWeights(model, specs, group=group)
        if streamed:
            real_apply = live.apply_delta
            live.apply_delta = lambda m_, c_: _streamed_apply(live, real_apply, m_, c_)  # type: ignore[method-assign]
        res: dict = {"base": live.fingerprint == fps[0]}
        if sliced:  # only the chunks this rank's slice needs, the others None
            from rollout.engines.vllm.apply.slices import chunks_needed

            need = chunks_needed(live, m)
            chunks = [c if i in need else None for i, c in enumerate(chunks)]
        # One rank's chunk is corrupt: all refuse, all keep their words.
        bad = list(chunks)
        if rank == 1:
            k = next(i for i, c in enumerate(bad) if c is not None)
            bad[k] = bytes(bad[k][:40]) + bytes(len(bad[k]) - 40)
        try:
            live.apply_delta(m, bad)
            res["corrupt"] = "applied"
        except RankRefused:
            res["corrupt"] = "RankRefused"
        except CodecError as exc:
            res["corrupt"] = type(exc).__name__
        res["corrupt_kept"] = _params(model) == before and live.audit() == fps[0]
        # One rank's write fails after the others wrote: all take their writes back.
        res["write"] = apply_with_failing_writes(live, m, chunks, fail=rank == 0)
        res["write_kept"] = _params(model) == before and live.audit() == fps[0]
        spans: list = []  # the segments this rank decodes in the update that lands
        decode_segment = live.decode_segment
        live.decode_segment = lambda p, base=None, out=None: (  # type: ignore[method-assign]
            spans.append((p.tensor, p.start)), decode_segment(p, base, out))[1]
        res["applied"] = live.apply_delta(m, chunks) == fps[1]
        res["spans"] = spans
        res["decoded"] = live.decoded
        res["words"] = _params(model) == want_new
        res["audit"] = live.audit() == fps[1]
        out.put((rank, res))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("sliced,streamed,gather_words,tp", [(False, False, None, 2), (True, False, None, 2),
                                                            (True, True, None, 2), (False, False, 2048, 2),
                                                            (True, False, None, 4), (True, True, None, 4)],
                         ids=["whole", "sliced", "sliced-streamed", "whole-small-batches", "sliced-4-ranks",
                              "sliced-streamed-4-ranks"])
def test_ranks_apply_a_delta_bit_exact_and_refuse_together(sliced, streamed, gather_words, tp, monkeypatch):
    """``sliced``: the trainer cuts these small tensors into row blocks too (as it does large ones), so
    each rank decodes the blocks of its own rows alone, from only the chunks that hold them.
    ``streamed``: each rank decodes its chunks as they are handed over, the shared ranges after.
    ``gather_words``: the ranges the ranks rebuild together go in batches of at most that many words
    (by default all of this model's in one). ``tp``: ranks; at 4 each decoded row-parallel segment
    goes to three others, each sent only its own columns' changes."""
    if sliced:
        monkeypatch.setattr("p2psync.codec.slices.MIN_SLICED", 256)
        monkeypatch.setattr("p2psync.codec.slices.MIN_PIECE_CHANGES", 0)  # every split, however few changes
    old = _state(0)
    new, m, chunks = _delta(old, 1)
    segments = sum(len(e) // 3 for e in m.segments)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    words = lambda st: {n: st.words(n).copy() for n in st}  # noqa: E731
    procs = [ctx.Process(target=_rank, args=(r, port, words(old), words(new), (old.fingerprint, new.fingerprint),
                                             m, [bytes(c) for c in chunks], out, sliced, streamed, gather_words, tp))
             for r in range(tp)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    ranks = range(tp)
    assert all(isinstance(got[r], dict) for r in ranks), got
    assert all(got[r]["base"] for r in ranks)
    assert got[1]["corrupt"] == "CodecError" and all(got[r]["corrupt"] == "RankRefused" for r in ranks if r != 1)
    assert got[0]["write"] == "OSError" and all(got[r]["write"] == "RankRefused" for r in ranks if r != 0)
    for r in ranks:
        assert got[r]["corrupt_kept"] and got[r]["write_kept"], got[r]
        assert got[r]["applied"] and got[r]["words"] and got[r]["audit"], got[r]
    # Each rank decodes only segments it holds elements of, together all of them; cut into row
    # blocks, each rank's share is smaller, and a row-parallel weight's segment (every rank holds
    # part of its rows) is decoded by one rank only, the one whose row block holds it.
    assert sum(got[r]["decoded"] for r in ranks) >= segments
    assert all(got[r]["decoded"] < segments * (0.8 if sliced else 1) for r in ranks), (got, segments)
    if sliced:
        rows = [i for i, t in enumerate(m.tensors) if t.name.endswith(("o_proj.weight", "down_proj.weight"))]
        every = {(t, e[k + 1]) for e in m.segments for k in range(0, len(e), 3) for t in [e[k]] if t in rows}
        mine = [{sp for sp in map(tuple, got[r]["spans"]) if sp[0] in rows} for r in ranks]
        assert sum(map(len, mine)) == len(every) and set().union(*mine) == every  # each once, all of them
        assert sum(1 for s in mine if s) >= 2


def test_a_slice_without_a_rank_group_is_refused():
    from rollout.engines.vllm.placement.rules import LayoutError
    from rollout.engines.vllm.apply.weights import LiveWeights

    old = _state(0)
    model = rank_model({n: old.tensor(n) for n in old}, 0, 2)
    with pytest.raises(LayoutError, match="tensor-parallel slice"):
        LiveWeights(model, old.specs)
    assert issubclass(LayoutError, P2PSyncError)


@pytest.mark.parametrize("layout", ["column slice", "whole at an offset", "one row", "transposed"])
def test_a_range_rebuilt_holds_exactly_the_words_this_rank_owns(layout):
    """What one rank adds to a rebuilt range (a group of one: nothing else is added): its own words
    at their checkpoint positions, zeros elsewhere, for ranges that start and end inside rows."""
    from rollout.engines.vllm.placement.boxes import compress
    from rollout.engines.vllm.apply.ranks import Solo, gather_ranges

    rows, cols = 12, 40
    ck = np.arange(rows * cols, dtype=np.int64)
    r, c = np.divmod(ck, cols)
    if layout == "column slice":  # columns 10..29 of each row, stored as a [12, 20] parameter
        keep = (c >= 10) & (c < 30)
        ck, dst = ck[keep], r[keep] * 20 + c[keep] - 10
    elif layout == "whole at an offset":
        dst = ck + 7
    elif layout == "one row":
        ck = ck[cols * 3:cols * 4]
        dst = np.arange(cols, dtype=np.int64) + 5
    else:
        dst = c * rows + r
    place = compress("x", "p", (rows, cols), ck, dst, ck_sorted=True)
    rng = np.random.default_rng(0)
    flat = torch.from_numpy(rng.integers(1, 1 << 15, size=int(dst.max()) + 9).astype(np.int16))
    want = np.zeros(rows * cols, dtype=np.uint16)
    want[ck] = flat.numpy().view(np.uint16)[dst]
    spans = [(0, rows * cols), (3, 17), (35, 95), (45, 75), (130, 131), (0, 1), (rows * cols - 50, rows * cols)]
    got = gather_ranges(Solo(), [(place, flat, a, b, np.uint16) for a, b in spans])
    for (a, b), g in zip(spans, got):
        assert np.array_equal(g, want[a:b]), (layout, a, b)


def test_a_layer_is_split_by_what_it_holds_not_by_its_class_name():
    """The hand rules read how a layer is split from the sizes it records (as vLLM's layers do): a
    row-parallel slice gives this rank its block of columns; a layer holding the whole weight is
    replicated, even when its class bears the name of vLLM's row-parallel layer."""
    from rollout.engines.vllm.placement.rules import place

    old = _state(0)
    model = rank_model({n: old.tensor(n) for n in old}, 1, 2)
    o = P + "self_attn.o_proj.weight"
    piece = place(model, o, SHAPES[o], dict(model.named_parameters()), 1)
    assert (piece.rows, piece.cols, piece.counted) == ((0, H), (HEADS * HD // 2, HEADS * HD), True)
    named = type("RowParallelLinear", (torch.nn.Module,), {})()
    named.weight = torch.nn.Parameter(old.tensor(o).clone(), requires_grad=False)
    named.tp_rank, named.tp_size = 1, 2
    model.model.layers[0].self_attn.o_proj = named
    piece = place(model, o, SHAPES[o], dict(model.named_parameters()), 1)
    assert (piece.rows, piece.cols, piece.counted) == ((0, H), (0, HEADS * HD), False)
