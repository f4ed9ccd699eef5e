"""A bad input to any ``p2psync`` command ends in one line naming what is wrong, a non-zero exit, no traceback.

Each case runs the real CLI as a subprocess (the way a user meets it).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import tlsutil
from nodeproc import CLI, TOKEN, Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def p2psync(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=90, cwd=cwd,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def one_line_error(out: subprocess.CompletedProcess, progress: str = "\0") -> str:
    """The one error line on stderr (beside progress lines starting with ``progress``)."""
    assert out.returncode != 0, out
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(progress)]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("p2psync: error: "), lines
    return lines[0]


@pytest.fixture
def taken_port():
    """A port some other process (here: this test) listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_node_on_a_port_in_use_names_the_port_and_the_setting(tmp_path, cluster: Cluster, taken_port):
    tlsutil.certify(tmp_path / "t", "trainer")
    out = p2psync("node", "--role", "trainer", "--id", "trainer", "--listen.host=127.0.0.1",
                  f"--listen.port={taken_port}", f"--data_dir={tmp_path / 't'}", f"--cluster_token={TOKEN}",
                  f"--trainer_public_key={cluster.keydir / 'trainer.pub'}",
                  f"--trainer_private_key={cluster.keydir / 'trainer.key'}", cwd=tmp_path)
    line = one_line_error(out)
    assert "listen.port" in line and f"port {taken_port}" in line and "in use" in line
    assert out.stdout == ""  # no address printed: it never listened


def test_ui_on_a_port_in_use_names_the_port_and_the_setting(tmp_path, taken_port):
    out = p2psync("ui", "--node", "https://127.0.0.1:9", "--tls-dir", str(tlsutil.authority().client()),
                  "--port", str(taken_port), "--token", TOKEN, cwd=tmp_path)
    line = one_line_error(out)
    assert "--port" in line and f"port {taken_port}" in line and "in use" in line


@pytest.mark.parametrize("args", [
    ["viz", "nope.json"],
    ["plan", "--from", "nope.json"],
    ["delta", "encode", "nope.safetensors", "nope2.safetensors", "-o", "d.p2s"],
    ["delta", "apply", "nope.safetensors", "nope.p2s", "-o", "out.safetensors"],
    ["delta", "inspect", "nope.p2s"],
    ["snapshot", "nope.safetensors", "-o", "s.p2sa", "--key", "nope.key"],
])
def test_a_missing_file_is_one_line_naming_it(tmp_path, args):
    line = one_line_error(p2psync(*args, cwd=tmp_path))
    assert "nope" in line


def test_probe_with_http_against_a_tls_node_says_to_use_https(tmp_path, cluster: Cluster):
    tr = cluster.start("trainer", "trainer")
    assert tr.url.startswith("https://")
    token = tmp_path / "token"
    token.write_text(TOKEN)
    plain = "http://" + tr.url.removeprefix("https://")
    out = p2psync("plan", "--probe", plain, "--token-file", str(token), "--no-sim", cwd=tmp_path)
    line = one_line_error(out, progress="probing ")
    assert line.endswith(f"{plain}: node speaks TLS; use https://"), line
