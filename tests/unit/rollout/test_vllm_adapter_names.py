"""How ``vllm serve`` names p2psync adapter versions: the path a client loads, the names and window the
API server keeps, and ``init_info.adapters`` (no engine: the rules are plain Python)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from p2psync import keys
from p2psync.errors import ConfigError
from rollout.engines.vllm import served_adapters
from rollout.engines.vllm.worker.adapter_source import parse_path, served_name, window
from rollout.engines.vllm.worker.infos import TransferInfoError, init_info


def test_paths_parse_into_adapter_and_version_and_others_are_left_to_vllm():
    assert parse_path("p2psync:policy@3") == ("policy", 3)
    assert parse_path("p2psync:team/policy-a@0") == ("team/policy-a", 0)
    assert parse_path("/models/adapter") is None
    assert served_name("policy", 3) == "policy@v3"
    for bad in ("p2psync:policy", "p2psync:policy@x", "p2psync:@3", "p2psync:policy@-1", "p2psync:policy@03",
                "p2psync:a b@1"):
        with pytest.raises(ConfigError, match="lora_path"):
            parse_path(bad)


def test_window_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("P2PSYNC_LORA_WINDOW", raising=False)
    assert window() == 2
    monkeypatch.setenv("P2PSYNC_LORA_WINDOW", "3")
    assert window() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("P2PSYNC_LORA_WINDOW", bad)
        with pytest.raises(ConfigError, match="P2PSYNC_LORA_WINDOW"):
            window()


def test_after_each_load_the_alias_names_the_newest_and_the_window_keeps_the_last_versions(monkeypatch):
    monkeypatch.setenv("P2PSYNC_LORA_WINDOW", "2")
    folder = SimpleNamespace(lora_name="mine", lora_path="/adapters/mine", lora_int_id=1)
    other = SimpleNamespace(lora_name="other@v5", lora_path="p2psync:other@5", lora_int_id=2)
    models = SimpleNamespace(lora_requests={"mine": folder, "other@v5": other})
    ids = iter(range(10, 20))
    for v in (0, 1, 2):
        models.lora_requests[f"policy@v{v}"] = SimpleNamespace(lora_name=f"policy@v{v}", lora_path=f"p2psync:policy@{v}",
                                                               lora_int_id=next(ids))
        served_adapters._settle(models, "policy")
        assert models.lora_requests["policy"] is models.lora_requests[f"policy@v{v}"]  # same id: no reload
    assert sorted(models.lora_requests) == ["mine", "other@v5", "policy", "policy@v1", "policy@v2"]
    assert models.lora_requests["mine"] is folder and models.lora_requests["other@v5"] is other


def test_init_info_names_a_node_per_adapter_with_the_parents_credentials(tmp_path):
    keys.write_pair(keys.generate(), tmp_path / "keys")
    good = {"url": "http://127.0.0.1:7001", "token": "t0k", "public_key": str(tmp_path / "keys" / "trainer.pub")}
    got = init_info({**good, "adapters": {"policy": "http://127.0.0.1:7002/"}})
    assert got.adapter_parent("policy").url == "http://127.0.0.1:7002"
    assert got.adapter_parent("policy").token == "t0k"
    assert got.adapter_parent("other") is got.parent
    plain = init_info(good)
    assert plain.adapter_parent("policy") is plain.parent
    for bad, field in (({"policy": "127.0.0.1:7002"}, "init_info.adapters.policy"),
                       ({"policy": 7002}, "init_info.adapters"),
                       ({"policy": "https://127.0.0.1:7002"}, "init_info.tls_dir"),
                       (["http://127.0.0.1:7002"], "init_info.adapters")):
        with pytest.raises(TransferInfoError) as err:
            init_info({**good, "adapters": bad})
        assert err.value.field.startswith(field), (bad, err.value.field)


def test_engine_vllm_lora_is_registered_and_needs_the_base_checkpoint():
    pytest.importorskip("vllm")
    from rollout.engines import EngineConfig, build_engine, check_name

    check_name("vllm-lora")
    with pytest.raises(ConfigError) as err:
        build_engine(EngineConfig(engine="vllm-lora", model_config={"model_type": "qwen3"}))
    assert err.value.field == "model_path"
