"""``p2psync plan --from`` and ``p2psync viz`` end to end through the CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2psync.cli import main
from topology.synthetic import synthetic_model
from topology.tree import Plan


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "model.json"
    synthetic_model(3, 4, seed=1, measured_fraction=0.3).save(path)
    return path


def test_plan_from_a_saved_model_prints_and_writes_the_plan(model_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--from", str(model_file), "-o", str(out), "--payload-bytes", str(32 * 2**20)]) == 0
    text = capsys.readouterr().out
    assert "estimated completion" in text and "per-flow bandwidth" in text
    for name in ("planned tree", "star", "fixed tiers", "random tree", "lower bound, any tree"):
        assert name in text
    p = Plan.load(out)
    assert p.root == "trainer" and len(p.parents) == 12 and p.payload_bytes == 32 * 2**20


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_viz_writes_a_picture(model_file, tmp_path, suffix, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--from", str(model_file), "-o", str(plan_path), "--no-sim"]) == 0
    pic = tmp_path / f"plan.{suffix}"
    assert main(["viz", str(plan_path), "--model", str(model_file), "-o", str(pic)]) == 0
    data = pic.read_bytes()
    assert len(data) > 1000
    assert data.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in data[:2000]


def test_bad_model_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    data = synthetic_model(2, 2).to_json()
    data["nodes"][1]["uplink_bps"] = -5
    bad.write_text(json.dumps(data))
    assert main(["plan", "--from", str(bad)]) == 1
    assert "nodes[1].uplink_bps" in capsys.readouterr().err


def test_help_does_not_import_the_heavy_modules():
    code = ("import sys; from p2psync.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('networkx', 'matplotlib', 'topology.planner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_probe_settings_come_from_a_node_config_and_bad_ones_are_refused_before_probing(tmp_path, capsys):
    cfg = tmp_path / "node.toml"
    cfg.write_text("[probe]\nbytes = 0\n")
    (tmp_path / "token").write_text("t" * 24)
    # Unreachable URLs: a run that got past the settings would report them, not a settings error.
    args = ["plan", "--probe", "http://127.0.0.1:1", "--token-file", str(tmp_path / "token"), "--no-sim"]
    assert main([*args, "--config", str(cfg)]) != 0
    assert "probe.bytes" in capsys.readouterr().err
    cfg.write_text("[probe]\nbytes = 1048576\nmax_blob_bytes = 1048576\n")
    assert main([*args, "--config", str(cfg), "--probe-bytes", str(2 << 20)]) != 0  # the flag wins, and is checked
    assert "probe.bytes" in capsys.readouterr().err
    assert main([*args, "--rtt-samples", "0"]) != 0
    assert "probe.rtt_samples" in capsys.readouterr().err
