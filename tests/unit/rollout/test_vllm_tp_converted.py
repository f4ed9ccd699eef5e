"""Tensor-parallel ranks whose tensors vLLM converts at load (gloo processes, vLLM-shaped slices, no vLLM).

A ``float32`` checkpoint served in ``bfloat16`` is rounded at load, and each rank
keeps the checkpoint words of its own slice only (a box of each tensor: its rows,
its columns), read from the checkpoint as that box; a ``bfloat16`` checkpoint kept
in ``float32`` is widened. The ranks rebuild the ranges they share as checkpoint
words (from the kept words, or read back from the widened ones), reach the
trainer's fingerprint, hold the conversion of the new words, and a refused update
leaves every live and kept word as it was. The slice arithmetic of the kept copy
is checked alone first.
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
from p2psync.state import ModelState, TensorSpec
from rollout.engines.vllm.apply.kept import CheckpointUnreadable, Kept, box_of
from rollout.engines.vllm.placement.boxes import compress
from rollout.engines.vllm.placement.rules import LayoutError
from rollout_helpers import apply_with_failing_writes
from test_vllm_tp import P, SHAPES, _params, rank_model

ROWS, COLS = 12, 40
LAYOUTS = {  # (checkpoint positions held, box) of a [12, 40] tensor
    "whole": (np.arange(ROWS * COLS), ((0, ROWS), (0, COLS))),
    "rows 3..8": (np.arange(3 * COLS, 9 * COLS), ((3, 9), (0, COLS))),
    "columns 10..29": (np.flatnonzero((np.arange(ROWS * COLS) % COLS >= 10) & (np.arange(ROWS * COLS) % COLS < 30)),
                       ((0, ROWS), (10, 30))),
    "rows 2..4 x columns 5..9": (np.array([r * COLS + c for r in range(2, 5) for c in range(5, 10)]),
                                 ((2, 5), (5, 10))),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_keeps_its_box_in_checkpoint_order(layout):
    ck, box = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    dst = rng.permutation(ck.shape[0]) + 3  # anywhere in the parameter: the box is of checkpoint positions
    place = compress("x", "p", (ROWS, COLS), ck, dst)
    assert box_of(place, (ROWS, COLS)) == box
    full = rng.integers(0, 1 << 32, size=ROWS * COLS, dtype=np.uint64).astype(np.uint32)
    mine = full.reshape(ROWS, COLS)[tuple(slice(a, b) for a, b in box)].reshape(-1).copy()
    kept = Kept((ROWS, COLS), box, mine)
    assert kept.whole == (layout == "whole")
    order = rng.permutation(ck)
    assert np.array_equal(kept.at(order), full[order])  # any order
    run = ck[1:5]  # consecutive positions, all held (inside one row of the box)
    assert np.array_equal(kept.at(slice(int(run[0]), int(run[-1]) + 1)), full[run[0]:run[-1] + 1])
    kept.put(order[:5], np.arange(5, dtype=np.uint32))
    want = full.copy()
    want[order[:5]] = np.arange(5)
    assert np.array_equal(kept.at(ck), want[ck]) and kept.words.shape == (ck.shape[0],)
    # Its words as a placement: a range rebuilt from it holds them at their positions, zeros elsewhere.
    from rollout.engines.vllm.apply.ranks import Solo, gather_ranges

    rebuilt = np.zeros(ROWS * COLS, dtype=np.uint32)
    rebuilt[ck] = want[ck]
    flat = torch.from_numpy(kept.words.view(np.int32))
    for a, b in [(0, ROWS * COLS), (37, 131), (125, 126)]:
        got, = gather_ranges(Solo(), [(kept.placement(place), flat, a, b, np.uint32)])
        assert np.array_equal(got, rebuilt[a:b]), (a, b)


def test_held_elements_that_are_not_one_box_are_refused_naming_the_tensor():
    ck = np.array([0, 1, 2, COLS + 5])  # a row's start and one element of the next row
    place = compress("x", "p", (ROWS, COLS), ck, np.arange(4))
    with pytest.raises(LayoutError, match="x: vLLM rounds it at load and this rank holds 4 of its elements, not one"):
        box_of(place, (ROWS, COLS))


def test_the_folder_is_read_as_the_box_asked_for(tmp_path):
    from safetensors.torch import save_file

    from rollout.engines.vllm.worker.checkpoint import read_folder

    full = torch.randn(ROWS, COLS)
    save_file({"w": full, "v": full[0].clone()}, str(tmp_path / "model.safetensors"))
    specs = [TensorSpec("w", "F32", (ROWS, COLS)), TensorSpec("v", "F32", (COLS,))]
    got = read_folder(str(tmp_path), specs, boxes=[((3, 9), (10, 30)), ((0, COLS),)])
    assert np.array_equal(got["w"], full[3:9, 10:30].contiguous().view(torch.int32).numpy().view(np.uint32).reshape(-1))
    assert np.array_equal(got["v"], full[0].view(torch.int32).numpy().view(np.uint32))
    with pytest.raises(CheckpointUnreadable, match="w: .*holds it as F32 \\[12, 40\\], the trainer's table as BF16"):
        read_folder(str(tmp_path), [TensorSpec("w", "BF16", (ROWS, COLS))], boxes=[((0, 6), (0, COLS))])


# --- two ranks ---------------------------------------------------------------------------------
F32_SPECIAL = [0x3F808000, 0x7FC00001, 0xFFC12345, 0x7F800000, 0x80000000, 0x00000001, 0x7F7FFFFF, 0x3F818000]


def _state(dtype: torch.dtype) -> ModelState:
    g = torch.Generator().manual_seed(0)
    return ModelState([(n, (torch.randn(s, generator=g) * 0.02).to(dtype)) for n, s in SHAPES.items()])


def _delta(old: ModelState, wide: bool):
    new = old.clone()
    rng = np.random.default_rng(1)
    for n in new:
        w = new.words(n)
        idx = rng.choice(w.shape[0], size=max(1, w.shape[0] // 10), replace=False)
        flips = rng.integers(1, 1 << 8, size=idx.shape[0]) << (0 if w.itemsize == 2 else 12)  # float32: some round apart
        w[idx] ^= flips.astype(w.dtype)
    norm = new.words(P + "input_layernorm.weight")
    special = [0x7FC1, 0x8000, 0x0001, 0xFF80] if norm.itemsize == 2 else F32_SPECIAL
    norm[:len(special)] = special
    new.invalidate()
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=1024))
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=64 << 10, private_key=None)
    return new, m, enc.chunks


def _tensors(words: dict, ckpt: torch.dtype, served: torch.dtype) -> dict:
    """The checkpoint's tensors as vLLM's load holds them (``Tensor.to``: what ``copy_`` makes)."""
    signed = {2: np.int16, 4: np.int32}
    return {n: torch.from_numpy(w.view(signed[w.itemsize])).view(ckpt).reshape(SHAPES[n]).to(served)
            for n, w in words.items()}


def _rank(rank: int, port: int, wide: bool, old: dict, new: dict, fps: tuple[str, str], m, chunks, out) -> None:
    import torch.distributed as dist

    from rollout.engines.vllm.apply.ranks import TorchGroup
    from rollout.engines.vllm.apply.slices import chunks_needed
    from rollout.engines.vllm.apply.weights import LiveWeights

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        ckpt, served = (torch.bfloat16, torch.float32) if wide else (torch.float32, torch.bfloat16)
        model = rank_model(_tensors(old, ckpt, served), rank, 2)
        boxes: dict = {}

        def read(specs, asked):  # the checkpoint vLLM loaded, a box of each tensor
            boxes.update({s.name: b for s, b in zip(specs, asked)})
            return {s.name: old[s.name].reshape(s.shape)[tuple(slice(a, b) for a, b in box)].reshape(-1).copy()
                    for s, box in zip(specs, asked)}

        live = LiveWeights(model, list(m.tensors), group=TorchGroup(dist.group.WORLD), checkpoint=read)
        res: dict = {"base": live.fingerprint == fps[0], "boxes": boxes,
                     "casts": sorted({pl.cast for pl in live.places if pl is not None}),
                     "sharded": sorted(s.name for s, sh in zip(live.specs, live.sharded) if sh),
                     "kept": {s.name: k.words.shape[0] for s, k in zip(live.specs, live.kept) if k is not None},
                     "held": {s.name: pl.held for s, pl in zip(live.specs, live.places) if pl is not None}}
        need = chunks_needed(live, m)
        chunks = [c if need is None or i in need else None for i, c in enumerate(chunks)]
        before = _params(model)
        kept_before = [None if k is None else k.words.copy() for k in live.kept]
        # Rank 0's writes fail after they were made: both ranks take theirs back.
        res["write"] = apply_with_failing_writes(live, m, chunks, fail=rank == 0)
        res["live_kept"] = _params(model) == before
        res["kept_kept"] = all((a is None and k is None) or np.array_equal(a, k.words)
                               for a, k in zip(kept_before, live.kept))
        res["audit_kept"] = live.audit() == fps[0]
        res["applied"] = live.apply_delta(m, chunks) == fps[1]
        res["words"] = _params(model) == _params(rank_model(_tensors(new, ckpt, served), rank, 2))
        read_back = True
        for s, pl in zip(live.specs, live.places):
            if pl is not None:
                ck = np.sort(np.concatenate([c for c, _ in pl.chunks()]))
                read_back &= np.array_equal(live.read(s.name), new[s.name][ck])
        res["read"] = read_back
        res["audit"] = live.audit() == fps[1]
        out.put((rank, res))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("wide", [False, True], ids=["float32-served-bfloat16", "bfloat16-kept-float32"])
def test_ranks_apply_converted_slices_bit_exact_and_refuse_together(wide, monkeypatch):
    monkeypatch.setattr("p2psync.codec.slices.MIN_SLICED", 256)  # row blocks: each rank decodes its own
    monkeypatch.setattr("p2psync.codec.slices.MIN_PIECE_CHANGES", 0)
    old = _state(torch.bfloat16 if wide else torch.float32)
    new, m, chunks = _delta(old, wide)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    words = lambda st: {n: st.words(n).copy() for n in st}  # noqa: E731
    procs = [ctx.Process(target=_rank, args=(r, port, wide, words(old), words(new), (old.fingerprint, new.fingerprint),
                                             m, [bytes(c) for c in chunks], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert all(isinstance(got[r], dict) for r in range(2)), got
    o, down = P + "self_attn.o_proj.weight", P + "mlp.down_proj.weight"
    for r in range(2):
        res = got[r]
        assert res["base"] and res["casts"] == ["float32" if wide else "bfloat16"], res
        assert {o, down, P + "self_attn.q_proj.weight", "model.embed_tokens.weight"} <= set(res["sharded"])
        assert res["write"] == ("OSError" if r == 0 else "RankRefused")
        assert res["live_kept"] and res["kept_kept"] and res["audit_kept"], res
        assert res["applied"] and res["words"] and res["read"] and res["audit"], res
        if wide:  # read back from the live words: nothing kept, nothing read from the checkpoint
            assert res["kept"] == {} and res["boxes"] == {}
            continue
        # Each rank keeps and reads only its slice: its columns of the row-parallel weights, its rows.
        assert res["kept"] == res["held"], res
        assert res["boxes"][o] == ((0, SHAPES[o][0]), (r * SHAPES[o][1] // 2, (r + 1) * SHAPES[o][1] // 2))
        q = P + "self_attn.q_proj.weight"
        assert res["boxes"][q] == ((r * SHAPES[q][0] // 2, (r + 1) * SHAPES[q][0] // 2), (0, SHAPES[q][1]))
        assert sum(res["kept"].values()) < sum(np.prod(s) for s in SHAPES.values())
