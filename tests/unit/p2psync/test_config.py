"""NodeConfig: TOML plus overrides, and validation that names the field."""

from __future__ import annotations

import pytest

from p2psync.config import load, parse_overrides
from p2psync.errors import ConfigError

BASE = """
id = "relay-a1"
role = "relay"
region = "eu"
data_dir = "data"
cluster_token = "secret-token-123"
trainer_public_key = "trainer.pub"
parents = ["http://10.0.0.1:7070", "http://10.0.0.2:7070"]

[listen]
port = 7070

[limits]
parallel_streams = 8
"""


def _write(tmp_path, text=BASE):
    p = tmp_path / "node.toml"
    p.write_text(text)
    return p


def test_toml_is_loaded_with_paths_relative_to_the_file(tmp_path):
    cfg = load(_write(tmp_path))
    assert cfg.role == "relay" and cfg.region == "eu"
    assert cfg.parents == ["http://10.0.0.1:7070", "http://10.0.0.2:7070"]
    assert cfg.limits.parallel_streams == 8 and cfg.limits.stall_timeout == 10.0
    assert cfg.data_dir == str(tmp_path / "data")
    assert cfg.trainer_public_key == str(tmp_path / "trainer.pub")
    assert cfg.materialise  # relays rebuild snapshots by default


def test_overrides_win_and_are_typed(tmp_path):
    cfg = load(_write(tmp_path), ["--listen.port=0", "--limits.stall_timeout", "2.5", "--parents=http://a:1,http://b:2",
                                  "--testing.corrupt_served_chunks=true", "--store.materialise_snapshots=false"])
    assert cfg.listen.port == 0
    assert cfg.limits.stall_timeout == 2.5
    assert cfg.parents == ["http://a:1", "http://b:2"]
    assert cfg.testing.corrupt_served_chunks is True
    assert cfg.materialise is False


def test_parse_overrides_nests_dotted_keys():
    assert parse_overrides(["--a.b=3", "--a.c=x y", "--d=[1, 2]"]) == {"a": {"b": 3, "c": "x y"}, "d": [1, 2]}


@pytest.mark.parametrize("override, field", [
    (["--role=king"], "role"),
    (["--listen.port=70000"], "listen.port"),
    (["--limits.stall_timeout=0"], "limits.stall_timeout"),
    (["--limits.parallel_streams=abc"], "limits.parallel_streams"),
    (["--limits.nonsense=1"], "limits.nonsense"),
    (["--parents=ftp://x"], "parents"),
    (["--cluster_token=short"], "cluster_token"),
    (["--store.snapshot_chunk_size=1"], "store.snapshot_chunk_size"),
    (["--trainer_private_key=k.pem"], "trainer_private_key"),
])
def test_invalid_values_name_their_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as err:
        load(_write(tmp_path), override)
    assert err.value.field == field


def test_role_rules(tmp_path):
    with pytest.raises(ConfigError, match="parents"):
        load(_write(tmp_path), ["--role=trainer"])
    with pytest.raises(ConfigError, match="parents"):
        load(_write(tmp_path), ["--parents=[]"])
    assert load(_write(tmp_path), ["--role=trainer", "--parents=[]"]).role == "trainer"


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(_write(tmp_path, "id = "))
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml")


def test_gossip_and_control_sections(tmp_path):
    text = BASE + """
[gossip]
seeds = ["http://10.0.0.1:7070"]
interval = 0.5
node_class = "preemptible"

[control]
lease_ttl = 12.0
"""
    cfg = load(_write(tmp_path, text))
    assert cfg.gossip.seeds == ["http://10.0.0.1:7070"] and cfg.gossip.interval == 0.5
    assert cfg.gossip.on("relay") and cfg.control.lease_ttl == 12.0 and cfg.gossip.node_class == "preemptible"
    plain = load(_write(tmp_path))
    assert not plain.gossip.on("relay") and plain.gossip.on("trainer")  # default: seeds given, or the trainer
    assert not load(_write(tmp_path), ["--gossip.enabled=false"]).gossip.on("trainer")


@pytest.mark.parametrize("override,field", [
    ("--gossip.seeds=10.0.0.1:7070", "gossip.seeds"),
    ("--gossip.node_class=spot", "gossip.node_class"),
    ("--gossip.interval=0", "gossip.interval"),
    ("--gossip.suspect_after=0.5", "gossip.suspect_after"),
    ("--gossip.fanout=0", "gossip.fanout"),
    ("--control.lease_ttl=-1", "control.lease_ttl"),
    ("--control.coordinator_url=10.0.0.1", "control.coordinator_url"),
    ("--control.max_staleness=-1", "control.max_staleness"),
])
def test_bad_control_settings_name_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as exc:
        load(_write(tmp_path), [override])
    assert exc.value.field == field
