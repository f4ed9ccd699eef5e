"""Sharded producers: every trainer rank publishes what it holds, with no gather of weights.

Pure parts first (where a DTensor placement puts a rank's elements, checked against torch's own split;
rank 0's encode of strided changes, checked against a single process's encode; the table agreement's
refusals), then gloo ranks on the CPU: 2 and 4 ranks whose ``held`` names split a MoE model by layers
and by experts (the tensors a rank does not hold are on the ``meta`` device: nothing can read them), and
4 ranks of FSDP2 over tensor parallelism (``Shard(1)`` row-parallel weights, ``_StridedShard`` from
FSDP2 over column-parallel ones). Every rank's extraction covers exactly its share, the trainer node's
state and fingerprint are the full model's, the bytes between ranks per version stay within 1.1x the
delta's payload, and a rank that fails mid-publish leaves the previous version in force."""

from __future__ import annotations

import itertools
import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

TOKEN = "sharded-test-token-0123"


# --- pure ----------------------------------------------------------------------------------------
def _split_reference(shape, placements, mesh_shape, coord) -> np.ndarray:
    """Global flat positions of a rank's local elements, by torch's own split of an arange."""
    from torch.distributed.tensor import Replicate

    t = torch.arange(int(np.prod(shape))).reshape(shape)
    for md, pl in enumerate(placements):
        if not isinstance(pl, Replicate):
            t = pl._split_tensor(t, mesh_shape[md], with_padding=False)[0][coord[md]]
    return t.reshape(-1).numpy()


def test_box_indices_and_runs_are_where_torch_puts_a_ranks_elements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from trainer.pieces import box_indices, flat_runs

    cases = [((7, 5), (Shard(1),), (2,)), ((7, 5), (Shard(0), Shard(1)), (2, 2)),
             ((9, 6), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2)),
             ((8, 10, 3), (Shard(0), Shard(1)), (2, 3)), ((10, 6), (_StridedShard(1, split_factor=2), Shard(1)), (2, 2)),
             ((5, 4), (Replicate(), Shard(1)), (2, 2)), ((3, 12), (Shard(1), Shard(1)), (2, 2)),
             ((4, 6, 10), (_StridedShard(2, split_factor=3), Shard(2)), (2, 3))]
    for shape, pls, ms in cases:
        for coord in itertools.product(*[range(m) for m in ms]):
            idx = box_indices(shape, pls, ms, coord)
            if idx is None:
                assert any(isinstance(p, Replicate) and coord[d] for d, p in enumerate(pls))
                continue
            want = _split_reference(shape, pls, ms, coord)
            starts, lengths = flat_runs(shape, idx)
            got = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)])
            assert np.array_equal(got, want), (shape, pls, coord)


def test_a_refused_placement_names_the_parameter():
    from torch.distributed.tensor import Partial

    from trainer.pieces import box_indices

    with pytest.raises(ValueError, match="layers.0.w: placement"):
        box_indices((4, 4), (Partial(),), (2,), (0,), "layers.0.w")


def test_rank0_encode_of_strided_changes_is_a_single_process_base_free_encode(monkeypatch):
    """Two ranks holding alternate column blocks of a tensor send their changes; rank 0's segments are,
    byte for byte, what one process holding the tensor encodes with the base-free coding."""
    from p2psync import dtypes
    from p2psync.codec.encode import CodecOptions, encode_sparse_range
    from p2psync.codec.slices import delta_ranges
    from p2psync.state import TensorSpec
    from trainer.strided import encode_strided, pack_changes

    rng = np.random.default_rng(3)
    rows, cols = 300, 96  # >= MIN_SLICED elements: cut at every row block (as if each piece paid)
    monkeypatch.setattr("p2psync.codec.slices.MIN_PIECE_CHANGES", 0)
    w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
    old = dtypes.words_of(w.to(torch.bfloat16).contiguous()).copy()
    w2 = w * (1 + 0.02 * torch.from_numpy((rng.random((rows, cols)) < 0.1).astype(np.float32)))
    w2[5, 7] = float("nan")  # an escape-sized residual
    new = dtypes.words_of(w2.to(torch.bfloat16).contiguous())
    pos = np.flatnonzero(new != old).astype(np.int64)
    spec = TensorSpec("t", "BF16", (rows, cols))
    opts = CodecOptions(chunk_size=64 << 10, segment_elements=4096, context_buckets=1)
    want = [s for a, b in delta_ranges(spec, opts.segment_elements)
            for s in encode_sparse_range(7, spec, old, pos, new[pos], a, b, opts).segments]
    col = pos % cols
    blobs = [pack_changes(spec, pos[m], old[pos[m]], new[pos[m]], 3) for m in (col < 40, col >= 40)]
    got, stats = encode_strided(7, spec, blobs, opts)
    assert [bytes(s) for s in got] == [bytes(s) for s in want] and stats.changed == pos.shape[0]
    assert len(got) > len(delta_ranges(spec, opts.segment_elements))  # cut inside the jobs' ranges
    assert sum(map(len, blobs)) < 1.1 * sum(map(len, want))  # what crosses is about the payload


def test_table_agreement_refuses_a_tensor_held_by_no_rank_or_by_two():
    from p2psync.state import TensorSpec
    from trainer.pieces import RankShare, agree_table

    table = [TensorSpec("a", "BF16", (4, 4)), TensorSpec("b", "BF16", (4,))]
    share = [RankShare(table, {"a": 16}, frozenset()), RankShare(table, {"b": 4}, frozenset())]
    assert agree_table(share) == (table, frozenset())
    with pytest.raises(ValueError, match="b: held by no rank"):
        agree_table([share[0], RankShare(table, {}, frozenset())])
    with pytest.raises(ValueError, match=r"a: ranks \[0, 1\] publish 32 elements"):
        agree_table([share[0], RankShare(table, {"a": 16, "b": 4}, frozenset())])
    with pytest.raises(ValueError, match="rank 1: ValueError: w: placement"):
        agree_table([share[0], RankShare([], {}, frozenset(), "ValueError: w: placement Partial")])
    # Pipeline stages whose modules hold only their own tensors: the union, in rank order.
    stages = [RankShare(table[:1], {"a": 16}, frozenset()), RankShare(table[1:], {"b": 4}, frozenset())]
    assert agree_table(stages)[0] == table


# --- gloo ranks ----------------------------------------------------------------------------------
def _node(rootp: Path):
    from p2psync import config
    from p2psync.certs import Authority
    from trainer.background import BackgroundNode

    # A spawned rank does not run the tests' conftest: the node's certificate is issued here.
    Authority(rootp / "keys").node("trainer", "default", rootp / "t" / "tls")
    cfg = config.load(overrides={
        "cluster_token": TOKEN, "trainer_public_key": str(rootp / "keys" / "trainer.pub"),
        "store": {"snapshot_interval": 0}, "id": "trainer", "role": "trainer", "data_dir": str(rootp / "t"),
        "trainer_private_key": str(rootp / "keys" / "trainer.key")})
    return BackgroundNode(cfg).start()


def _owner(name: str, world: int, split: str, layers: int) -> int:
    """Which rank holds checkpoint tensor ``name``: by layers (pipeline stages) or experts round robin."""
    parts = name.split(".")
    if "layers" not in parts:
        return 0 if "embed" in name else world - 1
    layer = int(parts[parts.index("layers") + 1])
    if split == "experts" and "experts" in parts:
        return (int(parts[parts.index("experts") + 1]) + layer) % world
    return layer * world // layers if split == "layers" else layer % world


def _perturb(model: torch.nn.Module, held_sources: set[str], v: int) -> None:
    """A deterministic 'optimizer step' of the tensors this rank holds (every rank's the same function)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in held_sources or p.device.type == "meta":
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * v)
            mask = torch.rand(p.shape, generator=g) < 0.05
            p.add_(p * 0.03 * torch.randn(p.shape, generator=g) * mask)


def _drop(model: torch.nn.Module, keep: set[str]) -> None:
    """Every parameter not in ``keep`` replaced by one on the meta device (a stage that lacks it)."""
    for name, p in list(model.named_parameters()):
        if name in keep:
            continue
        mod = model.get_submodule(name.rpartition(".")[0])
        setattr(mod, name.rpartition(".")[2], torch.nn.Parameter(torch.empty_like(p, device="meta")))


def _held_rank(rank: int, world: int, root: str, split: str) -> None:
    import torch.distributed as dist

    from p2psync import dtypes
    from p2psync.checkpoint_names import checkpoint_views
    from p2psync.presets import build_moe
    from p2psync.state import ModelState
    from trainer.publish_record import PublishError
    from trainer.publisher import Publisher

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=world)
    layers = 4
    try:
        model = build_moe("qwen3_moe", seed=5, vocab_size=515, num_hidden_layers=layers)
        views = checkpoint_views(model)
        held = {v.name for v in views if _owner(v.name, world, split, layers) == rank}
        sources = {v.source for v in views if v.name in held}
        if split == "layers":
            _drop(model, sources)  # a pipeline stage: the other stages' tensors are not here at all
        reference = build_moe("qwen3_moe", seed=5, vocab_size=515, num_hidden_layers=layers) if rank == 0 else None
        bg = _node(rootp) if rank == 0 else None
        pub = Publisher(model, bg.node if bg else None, loop=bg.loop if bg else None, held=held,
                        chunk_size=64 << 10, bucket_bytes=16 << 10)
        pub.start_sync()
        # Extraction covers exactly this rank's share: whole tensors, the ones it holds, its copy no more.
        assert {p.spec.name for p in pub._pieces} == held
        assert all(p.offset == 0 and p.numel == p.spec.numel and p.runs is None for p in pub._pieces)
        assert sum(b.numel() for b in pub._base) == sum(p.spec.numel for p in pub._pieces)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, sorted(held))
        names = [s.name for s in pub._specs]
        assert sorted(itertools.chain(*everyone)) == sorted(names)  # each tensor on exactly one rank
        steps, fail_at = (2, 3) if split == "layers" else (2, None)
        log = []
        for v in range(steps + 1 + (fail_at is not None)):
            if v:
                _perturb(model, sources, v)
                if reference is not None:
                    _perturb(reference, {n for n, _ in reference.named_parameters()}, v)
            if v == fail_at:
                if rank == 1:
                    def broken(*_a, **_k):
                        raise RuntimeError("rank 1 died mid-publish")
                    pub._read = broken  # type: ignore[method-assign]
                    with pytest.raises(PublishError):
                        pub.publish_sync()
                else:
                    assert pub.publish_sync() == v
                with pytest.raises(PublishError):
                    pub.flush_sync()
                if rank == 0:
                    assert bg.node.version == v - 1 and bg.node.fingerprint == pub.fingerprints[v - 1]
                    assert bg.node.state.audit() == pub.fingerprints[v - 1] and v not in pub.fingerprints
                    log.append({"version": v, "failed": True, "head": bg.node.version})
                break
            if v:
                assert pub.publish_sync() == v
            pub.flush_sync()
            if rank == 0:
                assert reference is not None
                full = {w.name: w.of(dict(reference.state_dict())[w.source]).to(torch.bfloat16)
                        for w in checkpoint_views(reference)}
                state = bg.node.state
                for name, t in full.items():
                    assert np.array_equal(state.words(name), dtypes.words_of(t.contiguous())), (v, name)
                assert state.audit() == bg.node.fingerprint == pub.fingerprints[v] == ModelState(full).fingerprint
                rec = pub.records[-1]
                log.append({"version": v, "payload": rec.payload_bytes, "exchanged": rec.exchanged_bytes,
                            "changed": rec.changed, "elements": rec.elements})
            dist.barrier()
        if fail_at is not None:
            with pytest.raises(PublishError):
                pub.close_sync()
        else:
            pub.close_sync()
        if rank == 0:
            bg.stop()
            (rootp / "result.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, fn, world: int, *args) -> list[dict]:
    import torch.multiprocessing as mp

    from p2psync import keys

    keys.write_pair(keys.generate(), tmp_path / "keys")
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[3] / ".numba_cache"))
    mp.spawn(fn, args=(world, str(tmp_path), *args), nprocs=world, join=True)
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,split", [(2, "layers"), (4, "experts")])
def test_ranks_holding_whole_tensors_publish_the_full_model(tmp_path, world, split):
    log = _spawn(tmp_path, _held_rank, world, split)
    deltas = [e for e in log if e["version"] and not e.get("failed")]
    assert [e["version"] for e in log if not e.get("failed")] == [0, 1, 2]
    for e in deltas:
        assert 0 < e["changed"] < e["elements"]
        assert e["exchanged"] <= 1.1 * e["payload"], e  # only the compressed delta crossed
    if split == "layers":
        assert log[-1] == {"version": 3, "failed": True, "head": 2}


class _Net(torch.nn.Module):
    """Embedding, two MLP blocks (column- then row-parallel under TP), norm, head. Odd sizes: splits uneven."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.embed = torch.nn.Embedding(97, 47)
        self.up = torch.nn.Linear(47, 102, bias=False)
        self.down = torch.nn.Linear(102, 47, bias=False)
        self.up2 = torch.nn.Linear(47, 200, bias=False)
        self.down2 = torch.nn.Linear(200, 47, bias=False)
        self.norm = torch.nn.LayerNorm(47)
        self.head = torch.nn.Linear(47, 97, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.down2(torch.relu(self.up2(h)))
        return self.head(self.norm(h))


def _tp_rank(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    import trainer.pieces
    from p2psync import dtypes
    from p2psync.state import ModelState
    from trainer.publisher import Publisher

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=world)
    # Runs of down2 (100 elements) count as long: one flat piece per run; down's (51) make a strided piece.
    trainer.pieces.MIN_RUN = 64
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _Net()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                               "up2": ColwiseParallel(), "down2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        params = dict(model.named_parameters())
        assert any(isinstance(pl, _StridedShard) for pl in params["up.weight"].placements)
        assert Shard(1) in params["down.weight"].placements
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        bg = _node(rootp) if rank == 0 else None
        pub = Publisher(model, bg.node if bg else None, loop=bg.loop if bg else None, chunk_size=64 << 10,
                        bucket_bytes=16 << 10)
        pub.start_sync()
        kinds = {p.spec.name: ("strided" if p.runs is not None else "flat") for p in pub._pieces}
        assert kinds.get("down.weight", "strided") == "strided" and kinds.get("down2.weight", "flat") == "flat"

        # Every rank's pieces are its own elements (checked against DTensor.full_tensor()), and all ranks'
        # pieces cover every element of every tensor exactly once.
        full = {n: p.full_tensor().detach() for n, p in params.items()}  # the test's gather, not the publisher's
        mine: dict[str, list[np.ndarray]] = {}
        local_total = 0
        for piece in pub._pieces:
            gp = piece.global_positions(np.arange(piece.numel, dtype=np.int64))
            got = piece.local().detach()
            assert torch.equal(full[piece.spec.name].reshape(-1)[torch.from_numpy(gp)], got), piece.spec.name
            mine.setdefault(piece.spec.name, []).append(gp)
            local_total += piece.numel
        assert sum(b.numel() for b in pub._base) == local_total  # its copy is its share, no more
        for name, p in params.items():
            assert sum(piece.numel for piece in pub._pieces if piece.spec.name == name) <= p.to_local().numel()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, {n: np.concatenate(g) for n, g in mine.items()})
        for name, t in full.items():
            counts = np.bincount(np.concatenate([m[name] for m in everyone if name in m]), minlength=t.numel())
            assert counts.shape[0] == t.numel() and np.all(counts == 1), name

        gen = torch.Generator().manual_seed(rank // 2)  # the dp rank picks the batch; tp ranks share it
        log = []
        for v in range(3):
            if v:
                ids = torch.randint(0, 97, (2, 12), generator=gen)
                logits = model(ids)
                torch.nn.functional.cross_entropy(logits.reshape(-1, 97), ids.reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
                assert pub.publish_sync() == v
            pub.flush_sync()
            want = {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in params.items()}
            if rank == 0:
                state = bg.node.state
                for name, t in want.items():
                    assert np.array_equal(state.words(name), dtypes.words_of(t.contiguous())), (v, name)
                assert state.audit() == pub.fingerprints[v] == ModelState(want).fingerprint
                rec = pub.records[-1]
                log.append({"version": v, "payload": rec.payload_bytes, "exchanged": rec.exchanged_bytes,
                            "changed": rec.changed, "elements": rec.elements})
            dist.barrier()
        pub.close_sync()
        if rank == 0:
            bg.stop()
            (rootp / "result.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp2_over_tensor_parallel_ranks_publish_the_full_model(tmp_path):
    log = _spawn(tmp_path, _tp_rank, 4)
    assert [e["version"] for e in log] == [0, 1, 2]
    for e in log[1:]:
        assert 0 < e["changed"] < e["elements"]
        assert e["exchanged"] <= 1.1 * e["payload"], e
