"""The chaos soak's short mode (``tools/chaos.py --short``): faults of every kind on the emulated WAN while
the trainer publishes, and every check holds: nodes converge bit-exact after each heal, no wrong bits, the
revoked node gets nothing new, no lease held twice, no version of the trainer lost.

Needs root, iproute2, /dev/net/tun and tmpfs mounts. CI runs as root: there (``CI`` set) a missing
prerequisite fails the test instead of skipping it, so the soak cannot stop running unnoticed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.netns, pytest.mark.integration, pytest.mark.slow]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, mount)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip` and `tc`)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (the delay line)"
    return None


@pytest.mark.timeout(300)
def test_short_chaos_soak_holds_every_check(tmp_path):
    why = _missing()
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the chaos soak must run in CI: {why}")
        pytest.skip(why)
    out = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "chaos.py"), "--short", "--json", str(out),
                        "--name", f"cs{os.getpid() % 10**5}", "--state-dir", str(tmp_path / "state"),
                        "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=280, cwd=REPO, check=False)
    assert out.exists(), r.stderr[-4000:]
    res = json.loads(out.read_text())
    detail = json.dumps({k: res[k] for k in ("faults", "unexpected_exits", "final_laggards", "wrong_bits_detail",
                                             "publish_errors")})[:4000]
    assert res["faults_total"] >= 8, detail
    for kind in ("kill", "restart_trainer", "partition", "revoke", "late_join"):
        assert res["faults"][kind] >= 1, (kind, detail)
    assert res["wrong_bits"] == 0, detail
    assert res["revoked_received_after"] == 0, detail
    assert res["leases_double_held"] == 0 and res["results_accepted_twice"] == 0, detail
    assert res["versions_lost"] == 0, detail
    assert res["not_converged"] == 0, [e for e in res["episodes_detail"] if e["converged_s"] is None]
    assert res["converged_after_heal_s"] is not None and res["converged_after_heal_s"] <= res["bound_s"]
    assert res["unexpected_exits"] == [], detail
    assert res["wall_s"] <= 200, res["wall_s"]
    assert r.returncode == 0, r.stderr[-4000:]
