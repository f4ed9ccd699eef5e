"""tools/scale_model.py: the cost model of tools/bench_scale.py on fixed measured points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def sm(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tools"))
    import scale_model

    return scale_model


# Points made by a known model: fetch 200 MB/s plus 1 ms per chunk after 0.03 s; decode 50 M changes/s per thread,
# 0.01 s intercept, serial fraction 0.25 (2 threads: 1.6x); write 100 M changes/s, serial 0.5;
# 0.05 s fixed per update.
def dec(c, t):
    return 0.01 + c / 50e6 * (0.25 + 0.75 / t)


def fe(b, n):
    return 0.03 + b / 200e6 + n * 1e-3


def wr(c, t):
    return c / 100e6 * (0.5 + 0.5 / t)


def _points():
    updates = [{"changes": c, "bytes": c * 0.7, "chunks": 4, "threads": t, "fetch_s": fe(c * 0.7, 4),
                "decode_s": dec(c, t), "commit_s": wr(c, t), "s": 0.05 + fe(c * 0.7, 4) + dec(c, t) + wr(c, t)}
               for c, t in ((20e6, 2), (20e6, 1), (10e6, 1))]
    return {"fetch": [{"bytes": b, "chunks": n, "s": fe(b, n)} for b, n in ((3e6, 13), (137e6, 184), (19e6, 376))],
            "decode": [{"changes": c, "threads": t, "s": dec(c, t)} for c in (5e6, 10e6, 20e6) for t in (1, 2)],
            "write": [{"changes": c, "threads": t, "s": wr(c, t)} for c in (5e6, 20e6) for t in (1, 2)],
            "update": updates}


def test_fit_recovers_the_rates_of_exact_points(sm):
    pts = _points()
    rates, err = sm.fit(pts, bytes_per_change=0.7, changed_fraction=0.04)
    assert rates.fetch.rate == pytest.approx(200e6, rel=1e-6) and rates.fetch.intercept == pytest.approx(0.03)
    assert rates.fetch.per_chunk_s == pytest.approx(1e-3)
    assert rates.decode.rate == pytest.approx(50e6, rel=1e-6)
    assert rates.decode.intercept == pytest.approx(0.01, abs=1e-6)
    assert rates.decode.serial == pytest.approx(0.25)
    assert rates.decode.speedup(2) == pytest.approx(1.6)
    assert rates.write.rate == pytest.approx(100e6) and rates.write.serial == pytest.approx(0.5)
    assert rates.fixed_s == pytest.approx(0.05)
    n = sum(len(v) for v in pts.values()) + 3 * len(pts["update"])  # an update's fetch, decode and write too
    assert err["max_abs_rel_error"] < 1e-6 and len(err["points"]) == n


def test_an_update_that_decoded_as_chunks_arrived_gives_no_fetch_or_decode_point(sm):
    """Its fetch_s holds most of its decode and its decode_s only the tail: fitted as parts they would
    make the decode look free; the whole update still gives the fixed cost."""
    pts = _points()
    c, t = 20e6, 1
    pts["update"].append({"changes": c, "bytes": c * 0.7, "chunks": 4, "threads": t, "overlapped": True,
                          "fetch_s": fe(c * 0.7, 4) + dec(c, t) - 0.001, "decode_s": 0.001,
                          "commit_s": wr(c, t), "s": 0.05 + fe(c * 0.7, 4) + dec(c, t) + wr(c, t)})
    rates, _ = sm.fit(pts, bytes_per_change=0.7, changed_fraction=0.04)
    assert rates.decode.rate == pytest.approx(50e6, rel=1e-6)
    assert rates.fetch.rate == pytest.approx(200e6, rel=1e-6)
    assert rates.fixed_s == pytest.approx(0.05)


def test_fit_reports_the_error_of_points_the_model_cannot_follow(sm):
    pts = _points()
    pts["decode"][0]["s"] *= 3  # one disturbed measurement
    _, err = sm.fit(pts, bytes_per_change=0.7, changed_fraction=0.04)
    assert err["max_abs_rel_error"] > 0.1


def test_fit_refuses_points_without_one_thread_or_a_kind(sm):
    pts = _points()
    pts["write"] = [p for p in pts["write"] if p["threads"] == 2]
    pts["update"] = []
    with pytest.raises(ValueError, match="one thread"):
        sm.fit(pts, bytes_per_change=0.7, changed_fraction=0.04)
    with pytest.raises(ValueError, match="fetch"):
        sm.fit({**_points(), "fetch": []}, bytes_per_change=0.7, changed_fraction=0.04)


def test_projection_covers_every_model_link_and_rank_count_with_and_without_slices(sm):
    rates, _ = sm.fit(_points(), bytes_per_change=0.7, changed_fraction=0.04)
    proj = sm.project(rates, fraction=0.02)
    assert len(proj["rows"]) == len(sm.SHAPES) * len(sm.LINKS_GBIT) * len(sm.RANKS) * 2
    assert {"changed_fraction", "bytes_per_change", "shapes", "slices", "update_threads_per_rank"} <= set(
        proj["assumptions"])
    assert {a["system"] for a in proj["anchors"]} >= {"checkpoint-engine (MoonshotAI)", "TransferEngine (Perplexity)"}
    one_t = sm.SHAPES[-1].name
    with_slices = [sm.lookup(proj, one_t, 10.0, n, True) for n in sm.RANKS]
    assert with_slices == sorted(with_slices, reverse=True)  # more ranks, less work per rank
    assert all(sm.lookup(proj, one_t, 10.0, n, False) > s for n, s in zip(sm.RANKS, with_slices))
    assert sm.lookup(proj, one_t, 1.0, 32) > sm.lookup(proj, one_t, 10.0, 32) > sm.lookup(proj, one_t, 100.0, 32)
    # the 1T delta at 2 % changed crosses a 10 Gbit/s link in payload * 8 / 1e10 seconds, at least
    row = next(r for r in proj["rows"] if (r["model"], r["link_gbit"], r["ranks"], r["slices"]) == (one_t, 10.0, 32, True))
    assert row["link_s"] == pytest.approx(1.04e12 * 0.02 * rates.bytes_per_change_at(0.02) * 8 / 1e10, rel=1e-3)
    # the node serves its 8 ranks' bytes at the fetch rate; decode and write at 16 threads
    machine = 8 * row["rank_changes"] * 0.825
    assert row["rank_fetch_s"] == pytest.approx(fe(machine, -(-machine // sm.CHUNK_BYTES)), rel=1e-3)
    assert row["decode_s"] == pytest.approx(0.01 + row["rank_changes"] / 50e6 * (0.25 + 0.75 / 16), rel=1e-3)
    # staged as the node receives it: link, fetch and decode overlap (the largest of the three), then
    # the last 4 MiB chunk's decode on one thread; started once the node holds it, fetch and decode
    # follow the link
    last = 0.01 + min(row["rank_changes"], sm.CHUNK_BYTES / 0.825) / 50e6
    assert row["decode_after_fetch_s"] == pytest.approx(last, rel=1e-2)
    after = sum(row[k] for k in ("decode_after_fetch_s", "write_s", "fixed_s"))
    assert row["s"] == pytest.approx(row["tree_s"] + max(row["link_s"], row["rank_fetch_s"], row["decode_s"]) + after,
                                     abs=0.02)
    assert row["s_after_node_holds"] == pytest.approx(
        row["tree_s"] + row["link_s"] + max(row["rank_fetch_s"], row["decode_s"]) + after, abs=0.02)
    assert row["s"] < row["s_after_node_holds"]
    with pytest.raises(KeyError):
        sm.lookup(proj, one_t, 3.0, 32)


def test_more_threads_help_only_as_far_as_the_measured_serial_fraction(sm):
    rates, _ = sm.fit(_points(), bytes_per_change=0.7, changed_fraction=0.04)
    h = sm.headline(rates, 0.02)
    s = h["s_at_threads"]
    assert s[2] > s[4] > s[16] > s[24]
    assert h["decode_s"] > 0.25 * h["rank_changes"] / 50e6  # never below the serial part


def test_sparser_steps_cost_more_bytes_per_change(sm):
    rates, _ = sm.fit(_points(), bytes_per_change=0.7, changed_fraction=0.04)
    assert rates.bytes_per_change_at(0.04) == pytest.approx(0.7)
    assert rates.bytes_per_change_at(0.02) == pytest.approx(0.7 + 1 / 8)


def test_points_files_are_pooled_with_their_machines(sm, tmp_path):
    pts = _points()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"machine": "vm", "date": "d", "workload": {"params": 100, "changed": 4, "delta_bytes": 3},
                             "fetch": pts["fetch"], "decode": pts["decode"][:2], "write": pts["write"]}))
    b.write_text(json.dumps({"machine": "host16", "date": "d", "decode": pts["decode"][2:]}))
    got, machines, bpc, frac = sm.load_points([str(a), str(b)])
    assert len(got["decode"]) == len(pts["decode"]) and bpc == 0.75 and frac == 0.04
    assert [m.split(" ")[0] for m in machines] == ["vm", "host16"]
