"""The live terminal view of ``p2psync demo`` (rich), and a plain-text fallback for logs and CI."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def render(snap: dict[str, Any], total_steps: int, region_times: dict[int, dict[str, float]], title: str) -> Group:
    steps = snap["steps"]
    last = steps[-1] if steps else {}
    head = Table.grid(padding=(0, 3))
    head.add_row(
        Text(f"step {last.get('step', 0)}/{total_steps}", style="bold"),
        Text(f"reward {last.get('reward_mean', float('nan')):.3f}" if last else "reward -"),
        Text(f"changed {100 * last.get('changed_fraction', 0.0):.2f} %" if last else "changed -"),
        Text(f"payload {_mb(last.get('payload_bytes', 0))} of {_mb(last.get('full_bytes', 0))}"
             + (f" ({last['full_bytes'] / max(1, last['payload_bytes']):.0f}x smaller)"
                if last.get("payload_bytes") else "") if last else "payload -"),
        Text(f"fingerprints checked {snap['checked']}, mismatches {len(snap['mismatches'])}",
             style="red bold" if snap["mismatches"] else "green"),
    )
    nodes = Table(title=title, title_justify="left", expand=False)
    for col in ("node", "role", "region", "version", "engine", "parent", "in", "out"):
        nodes.add_column(col, justify="right" if col in ("version", "engine", "in", "out") else "left")
    order = {"trainer": 0, "relay": 1, "rollout": 2}
    for v in sorted(snap["nodes"].values(), key=lambda v: (order.get(v.role, 3), v.region, v.name)):
        nodes.add_row(v.name, v.role, v.region,
                      "-" if v.version is None else str(v.version),
                      "-" if v.engine_version is None else str(v.engine_version),
                      v.parent or "-", _mb(v.bytes_in), _mb(v.bytes_out),
                      style=None if v.reachable else "dim")
    diss = Table(title="dissemination: trainer -> last node of each region (s)", title_justify="left")
    regions = sorted({r for t in region_times.values() for r in t})
    diss.add_column("version", justify="right")
    for r in regions:
        diss.add_column(r, justify="right")
    for ver in sorted(region_times)[-5:]:
        diss.add_row(str(ver), *[f"{region_times[ver].get(r, float('nan')):.2f}" for r in regions])
    return Group(head, nodes, diss)


def plain_line(snap: dict[str, Any], total_steps: int) -> str | None:
    """One line per finished step (None if nothing new), for non-terminal output."""
    steps = snap["steps"]
    if not steps:
        return None
    s = steps[-1]
    versions = sorted((v.version for v in snap["nodes"].values() if v.role != "trainer" and v.version is not None))
    return (f"step {s.get('step')}/{total_steps}  reward {s.get('reward_mean', float('nan')):.3f}  "
            f"changed {100 * s.get('changed_fraction', 0.0):.2f}%  payload {_mb(s.get('payload_bytes', 0))} "
            f"of {_mb(s.get('full_bytes', 0))}  step {s.get('step_s', float('nan')):.2f}s  node versions "
            f"{versions[0] if versions else '-'}..{versions[-1] if versions else '-'}  "
            f"checked {snap['checked']} mismatches {len(snap['mismatches'])}")
