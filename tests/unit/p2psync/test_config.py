"""NodeConfig: TOML plus overrides, and validation that names the field."""

from __future__ import annotations

import pytest

from p2psync.config import load
from p2psync.typed_toml import parse_overrides
from p2psync.errors import ConfigError

BASE = """
id = "relay-a1"
role = "relay"
region = "eu"
data_dir = "data"
cluster_token = "secret-token-123"
trainer_public_key = "trainer.pub"
parents = ["https://10.0.0.1:7070", "https://10.0.0.2:7070"]

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
    assert cfg.parents == ["https://10.0.0.1:7070", "https://10.0.0.2:7070"]
    assert cfg.limits.parallel_streams == 8 and cfg.limits.stall_timeout == 10.0
    assert cfg.data_dir == str(tmp_path / "data")
    assert cfg.trainer_public_key == str(tmp_path / "trainer.pub")
    assert cfg.materialise  # relays rebuild snapshots by default


def test_overrides_win_and_are_typed(tmp_path):
    cfg = load(_write(tmp_path), ["--listen.port=0", "--limits.stall_timeout", "2.5", "--parents=https://a:1,https://b:2",
                                  "--testing.corrupt_served_chunks=true", "--store.materialise_snapshots=false"])
    assert cfg.listen.port == 0
    assert cfg.limits.stall_timeout == 2.5
    assert cfg.parents == ["https://a:1", "https://b:2"]
    assert cfg.testing.corrupt_served_chunks is True
    assert cfg.materialise is False


def test_parse_overrides_nests_dotted_keys():
    assert parse_overrides(["--a.b=3", "--a.c=x y", "--d=[1, 2]"]) == {"a": {"b": 3, "c": "x y"}, "d": [1, 2]}


@pytest.mark.parametrize("override, field", [
    (["--role=king"], "role"),
    (["--listen.port=70000"], "listen.port"),
    (["--limits.stall_timeout=0"], "limits.stall_timeout"),
    (["--limits.max_rest=0"], "limits.max_rest"),
    (["--limits.parallel_streams=abc"], "limits.parallel_streams"),
    (["--limits.decode_nice=20"], "limits.decode_nice"),
    (["--limits.decode_nice=-1"], "limits.decode_nice"),
    (["--limits.decode_threads=0"], "limits.decode_threads"),
    (["--limits.decode_threads=11"], "limits.decode_threads"),  # the file sets parallel_streams = 8
    (["--limits.forward_first=maybe"], "limits.forward_first"),
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
seeds = ["https://10.0.0.1:7070"]
interval = 0.5
node_class = "preemptible"

[control]
lease_ttl = 12.0
"""
    cfg = load(_write(tmp_path, text))
    assert cfg.gossip.seeds == ["https://10.0.0.1:7070"] and cfg.gossip.interval == 0.5
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
    ("--gossip.report_budget=-5", "gossip.report_budget"),
    ("--gossip.max_body_bytes=4096", "gossip.max_body_bytes"),
    ("--control.lease_ttl=-1", "control.lease_ttl"),
    ("--control.coordinator_url=10.0.0.1", "control.coordinator_url"),
    ("--control.max_staleness=-1", "control.max_staleness"),
])
def test_bad_control_settings_name_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as exc:
        load(_write(tmp_path), [override])
    assert exc.value.field == field


def test_probe_section_is_loaded_and_feeds_the_probe_run(tmp_path):
    from p2psync.probe.run import ProbeOptions

    text = BASE + """
[probe]
max_blob_bytes = 67108864
max_blob_streams = 2
bytes = 4194304
rtt_samples = 3
intra_peers = 5
representatives = 1
parallel = 8
stall_timeout = 2.5
"""
    cfg = load(_write(tmp_path, text))
    p = cfg.probe
    assert (p.max_blob_bytes, p.max_blob_streams, p.bytes, p.rtt_samples) == (64 << 20, 2, 4 << 20, 3)
    assert (p.intra_peers, p.representatives, p.parallel, p.stall_timeout) == (5, 1, 8, 2.5)
    assert p.max_targets == 32 and p.connect_timeout == 5.0  # untouched fields keep their defaults
    opts = ProbeOptions.from_settings(p, seed=4)
    assert (opts.bytes, opts.rtt_samples, opts.intra_peers, opts.representatives, opts.parallel) == (4 << 20, 3, 5, 1, 8)
    assert opts.stall_timeout == 2.5 and opts.seed == 4
    assert load(_write(tmp_path)).probe.bytes == 8 << 20  # no section: defaults
    assert load(_write(tmp_path), ["--probe.parallel=2"]).probe.parallel == 2


@pytest.mark.parametrize("override,field", [
    ("--probe.max_blob_bytes=0", "probe.max_blob_bytes"),
    ("--probe.max_blob_streams=0", "probe.max_blob_streams"),
    ("--probe.max_targets=-3", "probe.max_targets"),
    ("--probe.max_rtt_samples=5000", "probe.max_rtt_samples"),
    ("--probe.bytes=0", "probe.bytes"),
    ("--probe.rtt_samples=0", "probe.rtt_samples"),
    ("--probe.intra_peers=0", "probe.intra_peers"),
    ("--probe.representatives=0", "probe.representatives"),
    ("--probe.parallel=0", "probe.parallel"),
    ("--probe.connect_timeout=0", "probe.connect_timeout"),
    ("--probe.stall_timeout=-1", "probe.stall_timeout"),
    ("--probe.min_rate_bps=inf", "probe.min_rate_bps"),
    ("--probe.bytes=abc", "probe.bytes"),
    ("--probe.samples=3", "probe.samples"),
])
def test_bad_probe_settings_name_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as exc:
        load(_write(tmp_path), [override])
    assert exc.value.field == field


def test_probe_payload_must_fit_the_blob_limit(tmp_path):
    # A payload above this node's own blob limit could never be measured against a node like it.
    with pytest.raises(ConfigError) as exc:
        load(_write(tmp_path), ["--probe.max_blob_bytes=1048576", "--probe.bytes=2097152"])
    assert exc.value.field == "probe.bytes"
    with pytest.raises(ConfigError) as exc:
        load(_write(tmp_path), ["--probe.max_rtt_samples=4", "--probe.rtt_samples=5"])
    assert exc.value.field == "probe.rtt_samples"


def test_probe_measurements_path_is_relative_to_the_config_file(tmp_path):
    d = tmp_path / "conf"
    d.mkdir()
    (d / "trainer.toml").write_text('id = "t"\nrole = "trainer"\ncluster_token = "' + "x" * 24 + '"\n'
                                    'trainer_public_key = "trainer.pub"\n[probe]\nmeasurements = "probe/m.json"\n')
    cfg = load(d / "trainer.toml", data_dir=str(tmp_path / "data"))
    assert cfg.probe.measurements == str(d / "probe" / "m.json")


def test_a_nested_bad_value_names_its_field_and_what_was_expected(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(_write(tmp_path, BASE + 'parallel_streams_typo = 1\n'))  # lands in [limits]
    assert str(err.value).startswith("limits.parallel_streams_typo: unknown key (known: max_header_bytes, ")
    with pytest.raises(ConfigError) as err:
        load(_write(tmp_path, BASE.replace("parallel_streams = 8", 'parallel_streams = "many"')))
    assert str(err.value) == "limits.parallel_streams: must be an integer, got str 'many'"
    with pytest.raises(ConfigError) as err:
        load(_write(tmp_path), ["--store.fsync=maybe"])
    assert str(err.value) == "store.fsync: must be true or false, got str 'maybe'"
    with pytest.raises(ConfigError) as err:
        load(_write(tmp_path), ["--listen=7070"])
    assert str(err.value) == "listen: must be a table, got int 7070"
    with pytest.raises(ConfigError) as err:
        load(_write(tmp_path), ["--cluster_token=12345678"])  # a number on the command line: not a string
    assert err.value.field == "cluster_token" and "12345678" not in str(err.value)


def test_override_text_converts_by_the_fields_type(tmp_path):
    cfg = load(_write(tmp_path), ["--limits.push_bytes=0x10", "--store.fsync=YES", "--limits.decode_nice", "3",
                                  "--gossip.seeds=https://a:1, https://b:2", "--probe.min_rate_bps=2e6"])
    assert (cfg.limits.push_bytes, cfg.store.fsync, cfg.limits.decode_nice) == (16, True, 3)
    assert cfg.gossip.seeds == ["https://a:1", "https://b:2"] and cfg.probe.min_rate_bps == 2e6
