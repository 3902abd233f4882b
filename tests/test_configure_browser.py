"""The configuration page in a real browser (Debian's Chromium through Playwright) against a real
`pipeplan serve` subprocess (embedded mode, SQLite): the ranked table, the chart with every scored
candidate, and a point that leads to its plan page."""

from __future__ import annotations

import os
import re

import httpx
import pytest
from service_proc import Service

pytestmark = [pytest.mark.browser, pytest.mark.integration]

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)", allow_module_level=True)

SPEC = {"model": {"name": "small", "layers": 8, "hidden": 1024, "ffn": 4096, "heads": 16, "kv_heads": 4,
                  "vocab": 32000, "seq_len": 2048},
        "hardware": "H100-80GB", "cluster": "DGX-H100", "precision": "bf16",
        "training": {"devices": 2, "microbatches": 4}}


def test_the_configuration_page_ranks_charts_and_links_every_candidate(tmp_path):
    from playwright.sync_api import sync_playwright

    service = Service(tmp_path, embedded_workers=0).start()
    try:
        r = httpx.post(f"{service.url}/v1/configurations", timeout=120, json={
            "spec": SPEC, "gpus": 8, "gpus_per_node": 8, "global_batch": 16, "top": 3, "micro_batch_sizes": [1, 2]})
        assert r.status_code == 201, r.text
        key, doc = r.json()["configuration_key"], r.json()["configurations"]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{service.url}/dashboard/configurations/{key}")
            rows = page.locator("#ranked tbody tr")
            assert rows.count() == 3
            assert doc["candidates"][0]["name"] in rows.nth(0).inner_text()
            assert page.locator("svg.configurations a.candidate").count() == len(doc["scored"])
            assert page.locator("svg.configurations a.candidate.ranked").count() == 3
            box = page.locator("svg.configurations").bounding_box()
            assert box["width"] > 500 and box["height"] > 200
            os.makedirs("test-artifacts", exist_ok=True)
            page.screenshot(path="test-artifacts/dashboard-configurations.png", full_page=True)
            page.locator('svg.configurations a.candidate[data-rank="1"]').click()
            page.wait_for_url(re.compile(r".*/dashboard/plans/[0-9a-f]{64}$"))
            assert page.locator("svg.gantt").count() == 1
            browser.close()
            assert not errors, errors
    finally:
        service.stop()
