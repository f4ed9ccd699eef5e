"""The report written at the end of ``p2psync demo``: one HTML page and its PNG figures.

Order on the page: the headline table (the same rows the terminal shows), the
pictures (reward; payload per step against the full weights; dissemination per
region from the nodes' timestamps; the tree as planned and as used), then the
details (per step, per node, per tree edge, the regime). The raw figures are in
``summary.json`` beside the page, linked, not printed.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from demo import figures
from demo.summary import headline

_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:1.5em auto;color:#222;padding:0 1em}
h1{margin-bottom:.2em}.sub{color:#555;margin-top:0}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 10px}
th{background:#f4f4f4}td.num{text-align:right}
table.head td:first-child{font-weight:bold;white-space:nowrap;background:#fafafa}
table.head{font-size:1.05em;min-width:70%}
.ok{color:#080;font-weight:bold}.bad{color:#c00;font-weight:bold}
.figs{display:grid;grid-template-columns:1fr 1fr;gap:12px}.figs img{width:100%;border:1px solid #ddd}
.figs .wide{grid-column:1 / span 2}.diff{color:#c00}"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _headline_html(summary: dict[str, Any]) -> str:
    rows = []
    for label, value in headline(summary):
        cls = ""
        if label == "verdict":
            cls = ' class="ok"' if summary["ok"] else ' class="bad"'
        rows.append(f"<tr><td>{_esc(label)}</td><td{cls}>{_esc(value)}</td></tr>")
    return '<table class="head">' + "".join(rows) + "</table>"


def _steps_html(steps: list[dict]) -> str:
    rows = "".join(
        f"<tr><td class=num>{s.get('step')}</td><td class=num>{s.get('version')}</td>"
        f"<td class=num>{_fmt(s.get('reward_mean'))}</td><td class=num>{_fmt(s.get('accuracy'), '.2f')}</td>"
        f"<td class=num>{100 * s.get('changed_fraction', 0):.3f}</td><td class=num>{s.get('payload_bytes', 0):,}</td>"
        f"<td class=num>{s.get('full_bytes', 0) / max(1, s.get('payload_bytes', 1)):.0f}x</td>"
        f"<td class=num>{_fmt(s.get('train_s'), '.2f')}</td><td class=num>{_fmt(s.get('step_s'), '.2f')}</td></tr>"
        for s in steps)
    return ("<table><tr><th>step</th><th>version</th><th>reward</th><th>exact</th><th>changed %</th>"
            "<th>payload bytes</th><th>smaller than full</th><th>train s</th><th>step s</th></tr>" + rows + "</table>")


def _nodes_html(summary: dict[str, Any], roles: dict[str, str], regions: dict[str, str]) -> str:
    rows = []
    for node, st in summary["node_delays_s"].items():
        cells = "".join(f"<td class=num>{_fmt((st.get(k) or {}).get('median'))}</td>"
                        f"<td class=num>{_fmt((st.get(k) or {}).get('max'))}</td>"
                        for k in ("held", "applied", "engine"))
        rows.append(f"<tr><td>{_esc(node)}</td><td>{_esc(roles.get(node, ''))}</td>"
                    f"<td>{_esc(regions.get(node, ''))}</td>{cells}</tr>")
    return ("<table><tr><th rowspan=2>node</th><th rowspan=2>role</th><th rowspan=2>region</th>"
            "<th colspan=2>holds every chunk</th><th colspan=2>own copy applied</th><th colspan=2>engine serving</th>"
            "</tr><tr>" + "<th>median s</th><th>max s</th>" * 3 + "</tr>" + "".join(rows) + "</table>")


def _tree_html(tree: dict[str, Any]) -> str:
    rows = []
    for node, v in tree["nodes"].items():
        used = ", ".join(f"{p} ({n} versions)" for p, n in sorted(v["used_counts"].items(), key=lambda x: -x[1]))
        cls = ' class="diff"' if v["differs"] else ""
        rows.append(f"<tr{cls}><td>{_esc(node)}</td><td>{_esc(v['planned'] or '-')}</td><td>{_esc(used or '-')}</td>"
                    f"<td>{_esc(v['reason'] or '')}</td></tr>")
    ent_p = "; ".join(f"{r}: {', '.join(ns)}" for r, ns in tree["entries_planned"].items()) or "-"
    ent_u = "; ".join(f"{r}: {', '.join(ns)}" for r, ns in tree["entries_used"].items()) or "-"
    return (f"<p>Nodes entering each region from outside it: planned {_esc(ent_p)}; used {_esc(ent_u)}. "
            f"Plans published during the run: {tree['plan_epochs']}.</p>"
            "<table><tr><th>node</th><th>planned parent</th><th>pulled from</th><th>why not as planned</th></tr>"
            + "".join(rows) + "</table>")


def _regime_html(summary: dict[str, Any]) -> str:
    r = dict(summary.get("regime", {}))
    w = summary.get("warm_start")
    if w:
        r["warm start"] = (f"{w.get('steps')} supervised steps, loss {_fmt(w.get('loss_first'))} -> "
                           f"{_fmt(w.get('loss_last'))}, {_fmt(w.get('seconds'), '.1f')} s (shipped as version 0)")
    for k in ("median_step_s", "median_train_s", "cpu_s_by_role"):
        if summary.get(k) is not None:
            r[k] = summary[k]
    return "<table>" + "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in r.items()) + "</table>"


def write(out: Path, snap: dict[str, Any], summary: dict[str, Any]) -> Path:
    """Write ``index.html``, its figures and ``summary.json`` under ``out``; the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    t = snap.get("timings", {})
    roles, regions = t.get("roles", {}), t.get("regions", {})
    figs: list[tuple[Path, str]] = []
    for make, name, alt in ((lambda p: figures.reward_png(snap["steps"], p), "reward.png", "reward per step"),
                            (lambda p: figures.payload_png(snap["steps"], p), "payload.png", "payload per step"),
                            (lambda p: figures.dissemination_png(t, p), "dissemination.png",
                             "dissemination time per region"),
                            (lambda p: figures.tree_png(summary["tree"], roles, regions, _root(roles), p),
                             "topology.png", "the dissemination tree: plan and parents used")):
        try:
            figs.append((make(out / name), alt))
        except Exception as exc:  # noqa: BLE001 - a picture must not sink the report
            summary.setdefault("notes", []).append(f"{name} failed: {exc!r}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    imgs = "".join(f'<img src="{p.name}" alt="{_esc(alt)}"' + (' class="wide"' if p.name == "topology.png" else "")
                   + ">" for p, alt in figs)
    notes = "".join(f"<li>{_esc(n)}</li>" for n in summary.get("notes", []))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>p2psync demo report</title>
<style>{_CSS}</style></head><body>
<h1>p2psync demo</h1>
<p class="sub">A GRPO run on one machine: a trainer, relays and rollout nodes as separate processes; every
optimizer step shipped as a signed, bit-exact sparse delta through the planned relay tree.</p>
{_headline_html(summary)}
<h2>Pictures</h2><div class="figs">{imgs}</div>
<h2>Details</h2>
<h3>Dissemination per node</h3><p>Seconds after the trainer announced each delta, from each node's own log
timestamps; median and max over the deltas.</p>{_nodes_html(summary, roles, regions)}
<h3>Tree</h3>{_tree_html(summary['tree'])}
<h3>Steps</h3>{_steps_html(snap['steps'])}
<h3>Regime</h3>{_regime_html(summary)}
{f'<h3>Notes</h3><ul>{notes}</ul>' if notes else ''}
<p>Raw figures: <a href="summary.json">summary.json</a>. Node logs (JSON lines): <code>../cluster/logs/</code>.</p>
</body></html>"""
    index = out / "index.html"
    index.write_text(page)
    return index


def _root(roles: dict[str, str]) -> str:
    return next((n for n, r in roles.items() if r == "trainer"), "trainer")
