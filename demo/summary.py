"""The demo's figures: ``summary.json`` and the headline a person reads (terminal and report alike).

Pure functions of the monitor's snapshot (:meth:`demo.monitor.Monitor.snapshot`)
and the run's outcome; the live dashboard calls them on the run so far.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any


def median(xs: Sequence[float | None]) -> float | None:
    ys = sorted(x for x in xs if x is not None)
    if not ys:
        return None
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"median": round(median(xs) or 0.0, 4), "max": round(max(xs), 4), "n": len(xs)} if xs else None


def reward_ends(steps: list[dict]) -> tuple[float | None, float | None, int]:
    """Mean reward of the first k and the last k steps, and k (3 when there are at least 9 steps)."""
    rewards = [s["reward_mean"] for s in steps if s.get("reward_mean") is not None]
    k = max(1, min(3, len(rewards) // 3))
    if not rewards:
        return None, None, k
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k, k


def dissemination(timings: dict[str, Any]) -> dict[str, Any]:
    """Per region and per node: median and max seconds after the trainer's announcement of each delta."""
    out: dict[str, Any] = {}
    for stage in ("held", "engine"):
        per = timings.get(f"region_{stage}", {})
        regions = sorted({r for t in per.values() for r in t})
        out[stage] = {r: _spread([t[r] for t in per.values() if r in t]) for r in regions}
    nodes: dict[str, dict[str, Any]] = {}
    for v in timings.get("deltas", []):
        for node, d in timings.get("delays", {}).get(v, {}).items():
            for stage, s in d.items():
                nodes.setdefault(node, {}).setdefault(stage, []).append(s)
    out["nodes"] = {n: {stage: _spread(xs) for stage, xs in st.items()} for n, st in sorted(nodes.items())}
    return out


def tree(snap: dict[str, Any]) -> dict[str, Any]:
    """The last plan, the parents each node actually pulled from, every difference with its reason,
    and which nodes enter each region from outside it (in the plan and in use)."""
    t = snap.get("timings", {})
    roles, regions = t.get("roles", {}), t.get("regions", {})
    # The newest of the plans that placed the most nodes: the rollout nodes leave first when the
    # demo stops, and the coordinator re-plans without them.
    plans = [p for _, p in snap.get("plans", [])]
    plan = max(reversed(plans), key=len) if plans else {}
    used: dict[str, dict[str, int]] = t.get("parents_used", {})
    changes = t.get("parent_changes", [])
    nodes: dict[str, Any] = {}
    for n in sorted(x for x, r in roles.items() if r != "trainer"):
        counts = Counter(used.get(n, {}))
        main = counts.most_common(1)[0][0] if counts else None
        planned = plan.get(n)
        others = sorted(p for p in counts if p != planned)
        reason = None
        if others:
            why = [c["reason"] for c in changes if c["node"] == n and c["parent"] in others]
            if t.get("configured", {}).get(n) in others:
                why.insert(0, "its configured parent, before a plan named another")
            reason = "; ".join(dict.fromkeys(why)) or "not recorded in its log"
        nodes[n] = {"planned": planned, "used": main, "used_counts": dict(counts), "differs": bool(others),
                    "reason": reason}

    def entries(parents: dict[str, str | None]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for c, p in parents.items():
            if p is not None and regions.get(p) != regions.get(c):
                out.setdefault(regions.get(c, "?"), []).append(c)
        return {r: sorted(v) for r, v in sorted(out.items())}

    return {"plan": plan, "plan_epochs": len(snap.get("plans", [])), "nodes": nodes,
            "entries_planned": entries(dict(plan)),
            "entries_used": entries({n: v["used"] for n, v in nodes.items()})}


def summarize(snap: dict[str, Any], *, problems: list[str], wall_s: float, regime: dict[str, Any],
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json``: the keys in ``KEYS`` plus details."""
    steps = snap["steps"]
    first, last, k = reward_ends(steps)
    payload = [s.get("payload_bytes", 0) for s in steps]
    full = [s.get("full_bytes", 0) for s in steps]
    diss = dissemination(snap.get("timings", {}))
    summary: dict[str, Any] = {
        "ok": not problems,
        "verdict": "every node and engine held the trainer's bits at every version"
        if not problems else "FAILED: " + "; ".join(problems),
        "steps": len(steps), "versions": len(snap["expected"]),
        "fingerprints_checked": snap["checked"], "mismatches": [vars(m) for m in snap["mismatches"]],
        "reward_first": first, "reward_last": last, "reward_k": k,
        "changed_fraction_median": median([s.get("changed_fraction") for s in steps]),
        "payload_bytes_median": median(payload), "full_bytes": max(full, default=0),
        "payload_bytes_total": sum(payload), "full_bytes_total": sum(full),
        "median_region_s": {r: v["median"] for r, v in diss["held"].items() if v},
        "max_region_s": {r: v["max"] for r, v in diss["held"].items() if v},
        "engine_median_region_s": {r: v["median"] for r, v in diss["engine"].items() if v},
        "engine_max_region_s": {r: v["max"] for r, v in diss["engine"].items() if v},
        "node_delays_s": diss["nodes"],
        "tree": tree(snap),
        "warm_start": snap.get("warm_start"),
        "regime": regime,
        "wall_s": round(wall_s, 1),
        "median_step_s": median([s.get("step_s") for s in steps]),
        "median_train_s": median([s.get("train_s") for s in steps]),
    }
    summary.update(extra or {})
    return summary


KEYS = ("ok", "payload_bytes_total", "full_bytes_total", "reward_first", "reward_last",
        "changed_fraction_median", "median_region_s")
"""Keys other programs read from ``summary.json``; they keep their meaning."""


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def _ratio(full: float, part: float) -> str:
    return f"{full / part:.0f}x smaller" if part else "-"


def _clock(s: float) -> str:
    return f"{int(s // 60)} min {s % 60:04.1f} s" if s >= 60 else f"{s:.1f} s"


def headline(summary: dict[str, Any], total_steps: int | None = None, running: bool = False) -> list[tuple[str, str]]:
    """(label, value) rows, most important first: the page's first table and the dashboard's header."""
    rows: list[tuple[str, str]] = []
    if running:
        n = len(summary["mismatches"])
        rows.append(("verdict so far", "no fingerprint differs from the trainer's" if not n
                     else f"{n} fingerprint mismatches"))
    else:
        rows.append(("verdict", ("OK: " if summary["ok"] else "") + summary["verdict"]))
    r = summary.get("regime", {})
    steps = f"{summary['steps']}" + (f" of {total_steps}" if total_steps else "")
    rows.append(("RL steps", f"{steps} GRPO steps, each shipped as a signed delta"
                 + (f" ({r['model']})" if r.get("model") else "")))
    if summary["reward_first"] is not None:
        k = summary["reward_k"]
        rows.append(("reward", f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
                               f"(mean of the first {k} / last {k} steps)"))
    else:
        rows.append(("reward", "-"))
    cf = summary["changed_fraction_median"]
    rows.append(("changed per step", "-" if cf is None else f"{100 * cf:.2f} % of the bf16 weights (median)"))
    pay, full = summary["payload_bytes_median"], summary["full_bytes"]
    tot, ftot = summary["payload_bytes_total"], summary["full_bytes_total"]
    rows.append(("payload per step", "-" if not pay else
                 f"{_mb(pay)} vs {_mb(full)} full bf16 weights ({_ratio(full, pay)}, median)"))
    rows.append(("payload, all steps", "-" if not tot else f"{_mb(tot)} vs {_mb(ftot)} ({_ratio(ftot, tot)})"))
    held, engine = summary["median_region_s"], summary["engine_median_region_s"]
    for region in sorted(set(held) | set(engine)):
        parts = []
        if region in held:
            parts.append(f"held {held[region]:.3f} s median, {summary['max_region_s'][region]:.3f} s max")
        if region in engine:
            parts.append(f"engines serving {engine[region]:.3f} s median, "
                         f"{summary['engine_max_region_s'][region]:.3f} s max")
        rows.append((f"region {region}", "; ".join(parts) + " (after the trainer's announcement, last node)"))
    t = summary["tree"]
    ent = t["entries_used"]
    if ent:
        desc = ", ".join(f"{reg} via {' + '.join(ns)}" for reg, ns in ent.items())
        once = all(len(ns) == 1 for ns in ent.values())
        diff = [n for n, v in t["nodes"].items() if v["differs"]]
        rows.append(("tree", ("each region entered once from outside: " if once else "regions entered ") + f"{desc}; "
                     + ("every node pulled from its planned parent" if not diff
                        else f"{len(diff)} nodes pulled from a parent the plan did not name ({', '.join(diff)})")))
    rows.append(("fingerprints checked", f"{summary['fingerprints_checked']}, "
                 f"{len(summary['mismatches'])} mismatches"))
    rows.append(("wall time", _clock(summary["wall_s"])))
    return rows
