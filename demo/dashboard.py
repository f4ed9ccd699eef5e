"""The live terminal view of ``p2psync demo`` (rich), and a plain-text fallback for logs and CI.

The header is the report's headline table (:func:`demo.summary.headline`) on the
run so far; below it, one row per node.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from demo.summary import headline


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def render(snap: dict[str, Any], summary: dict[str, Any], total_steps: int, title: str,
           running: bool = True) -> Group:
    head = Table(show_header=False, title="p2psync demo" + (" (running)" if running else ""), title_justify="left",
                 expand=False)
    head.add_column(style="bold")
    head.add_column()
    for label, value in headline(summary, total_steps, running=running):
        style = ""
        if label.startswith("verdict"):
            style = "green" if not summary["mismatches"] and (running or summary["ok"]) else "red bold"
        head.add_row(label, Text(value, style=style))
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
    return Group(head, nodes)


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
