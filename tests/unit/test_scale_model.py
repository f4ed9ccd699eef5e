"""tools/scale_model.py: the cost model of tools/bench_scale.py on fixed measured points."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def sm(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tools"))
    import scale_model

    return scale_model


# Points made by a known model: decode 50 M changes/s per thread, 0.01 s intercept, serial fraction
# 0.25 (2 threads: 1.6x), write 100 M changes/s, fetch 1 GB/s, 0.05 s fixed per update.
def _points():
    def dec(c, t):
        return 0.01 + c / 50e6 * (0.25 + 0.75 / t)

    updates = [{"changes": c, "bytes": c * 0.7, "threads": t, "fetch_s": c * 0.7 / 1e9, "decode_s": dec(c, t),
                "commit_s": c / 100e6, "s": 0.05 + c * 0.7 / 1e9 + dec(c, t) + c / 100e6}
               for c, t in ((20e6, 2), (20e6, 1), (10e6, 1))]
    decodes = [{"changes": c, "threads": t, "s": dec(c, t)} for c in (5e6, 10e6, 20e6) for t in (1, 2)]
    return updates, decodes


def test_fit_recovers_the_rates_of_exact_points(sm):
    updates, decodes = _points()
    rates, err = sm.fit(updates, decodes, speedup_2=1.6, bytes_per_change=0.7, changed_fraction=0.04)
    assert rates.decode_changes_per_s == pytest.approx(50e6, rel=1e-6)
    assert rates.decode_intercept_s == pytest.approx(0.01, abs=1e-6)
    assert rates.serial_fraction == pytest.approx(0.25)
    assert rates.write_changes_per_s == pytest.approx(100e6)
    assert rates.fetch_bytes_per_s == pytest.approx(1e9)
    assert rates.fixed_s == pytest.approx(0.05)
    assert err["max_abs_rel_error"] < 1e-6 and len(err["points"]) == len(updates) + len(decodes)


def test_fit_reports_the_error_of_points_the_model_cannot_follow(sm):
    updates, decodes = _points()
    decodes[0]["s"] *= 3  # one disturbed measurement
    _, err = sm.fit(updates, decodes, speedup_2=1.6, bytes_per_change=0.7, changed_fraction=0.04)
    assert err["max_abs_rel_error"] > 0.1


def test_projection_covers_every_model_link_and_rank_count_with_and_without_slices(sm):
    rates, _ = sm.fit(*_points(), speedup_2=1.6, bytes_per_change=0.7, changed_fraction=0.04)
    proj = sm.project(rates, fraction=0.02)
    assert len(proj["rows"]) == len(sm.SHAPES) * len(sm.LINKS_GBIT) * len(sm.RANKS) * 2
    assert {"changed_fraction", "bytes_per_change", "shapes", "slices"} <= set(proj["assumptions"])
    assert {a["system"] for a in proj["anchors"]} >= {"checkpoint-engine (MoonshotAI)", "TransferEngine (Perplexity)"}
    one_t = sm.SHAPES[-1].name
    with_slices = [sm.lookup(proj, one_t, 10.0, n, True) for n in sm.RANKS]
    assert with_slices == sorted(with_slices, reverse=True)  # more ranks, less work per rank
    assert all(sm.lookup(proj, one_t, 10.0, n, False) > s for n, s in zip(sm.RANKS, with_slices))
    assert sm.lookup(proj, one_t, 1.0, 32) > sm.lookup(proj, one_t, 10.0, 32) > sm.lookup(proj, one_t, 100.0, 32)
    # the 1T delta at 2 % changed crosses a 10 Gbit/s link in payload * 8 / 1e10 seconds, at least
    row = next(r for r in proj["rows"] if (r["model"], r["link_gbit"], r["ranks"], r["slices"]) == (one_t, 10.0, 32, True))
    assert row["link_s"] == pytest.approx(1.04e12 * 0.02 * rates.bytes_per_change_at(0.02) * 8 / 1e10, rel=1e-3)
    with pytest.raises(KeyError):
        sm.lookup(proj, one_t, 3.0, 32)


def test_sparser_steps_cost_more_bytes_per_change(sm):
    rates, _ = sm.fit(*_points(), speedup_2=1.6, bytes_per_change=0.7, changed_fraction=0.04)
    assert rates.bytes_per_change_at(0.04) == pytest.approx(0.7)
    assert rates.bytes_per_change_at(0.02) == pytest.approx(0.7 + 1 / 8)
