"""The demo's report page in a real headless Chromium: what a person sees first, and that the pictures load.

The run is made up (:mod:`demo_fixture`) and rendered by the real report code; the screenshot is kept
under the test's tmp dir (``report.png``).
"""

from __future__ import annotations

import asyncio
import json

import needs
import pytest
from demo_fixture import fake_run
from ui_browser import Browser

from demo import report
from demo.summary import summarize

pytestmark = pytest.mark.integration

HEAD_JS = ("JSON.stringify([...document.querySelectorAll('table.head tr')]"
           ".map(r => [...r.cells].map(c => c.textContent)))")
IMGS_JS = ("JSON.stringify([...document.images].map(i => [i.getAttribute('src'), i.naturalWidth, "
           "i.getBoundingClientRect().top]))")


@pytest.mark.timeout(180)
def test_the_report_opens_with_the_headline_then_the_pictures(tmp_path):
    chromium = needs.chromium()
    snap = fake_run(steps=12, detour=True)
    summary = summarize(snap, problems=[], wall_s=201.0, regime={"model": "preset demo", "lr": 6e-5})
    index = report.write(tmp_path / "report", snap, summary)
    shot = tmp_path / "report.png"

    async def drive() -> None:
        async with Browser.launch(tmp_path / "chromium", chromium) as browser:
            page = await browser.new_page(1280, 1000)
            await page.goto(index.as_uri())
            await page.wait_for("[...document.images].every(i => i.complete)", 30, "the pictures loaded")
            # The first thing under the title is the headline table, not a dump of JSON.
            first = await page.evaluate("document.querySelector('h1').nextElementSibling.nextElementSibling.tagName")
            assert first == "TABLE"
            assert await page.evaluate("document.querySelectorAll('pre').length") == 0
            text = await page.evaluate("document.body.innerText")
            assert '"payload_bytes_total"' not in text and "payload_bytes_total" not in text
            head = dict(json.loads(await page.evaluate(HEAD_JS)))
            assert head["verdict"].startswith("OK: every node and engine held the trainer's bits")
            assert await page.evaluate("getComputedStyle(document.querySelector('table.head tr td.ok')).color") \
                == "rgb(0, 136, 0)"
            assert head["reward"].startswith("0.340 -> 0.520")
            assert head["changed per step"] == "2.00 % of the bf16 weights (median)"
            assert "0.40 MB vs 38.00 MB full bf16 weights (95x smaller, median)" == head["payload per step"]
            assert "(95x smaller)" in head["payload, all steps"]
            assert head["region r0"].startswith("held 0.048 s median, 0.048 s max; engines serving 0.138 s median")
            assert head["region r1"].startswith("held 0.160 s median")
            assert "regions entered r1 via r1-relay1 + r1-rollout2" in head["tree"]  # the detour enters r1 too
            assert "1 nodes pulled from a parent the plan did not name (r1-rollout2)" in head["tree"]
            assert head["fingerprints checked"].endswith(", 0 mismatches")
            assert head["wall time"] == "3 min 21.0 s"
            # Then the four pictures, in order, each loaded and below the table.
            imgs = json.loads(await page.evaluate(IMGS_JS))
            assert [i[0] for i in imgs] == ["reward.png", "payload.png", "dissemination.png", "topology.png"]
            table_bottom = await page.evaluate("document.querySelector('table.head').getBoundingClientRect().bottom")
            assert all(w > 300 and top >= table_bottom for _, w, top in imgs)
            # The raw figures are one click away.
            href = await page.evaluate("document.querySelector('a[href=\"summary.json\"]').href")
            assert href.endswith("/report/summary.json")
            # The detour is explained where the tree is detailed.
            assert "failover: r1-relay1 failed (stream closed)" in text
            await page.screenshot(shot)

    asyncio.run(drive())
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 50_000
    saved = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert saved["ok"] is True and saved["median_region_s"]["r1"] == pytest.approx(0.16, abs=1e-6)
