"""The dashboard at scale: 1,000 cached configurations and a plan of 10,000+ ops, served from a
real Repository on SQLite. Prints the measured times (run with -s to see them); the asserted limits
are generous so a busy 2-core machine passes, the printed figures are what docs/dashboard.md quotes."""

from __future__ import annotations

import re
import time

import pytest
from dashboard_fixtures import dashboard_app, gpipe_plan, make_problem, op_count
from fastapi.testclient import TestClient

N_PLANS = 1000


@pytest.fixture(scope="module")
def big_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("dash-scale") / "cache.sqlite"
    app, repo, engine = dashboard_app(f"sqlite:///{path}")
    base = make_problem(4, 8, limit_mib=None)
    plan = gpipe_plan(base)
    started = time.perf_counter()
    for i in range(N_PLANS):  # distinct keys (static memory differs), one schedule for all
        static = 1000.0 + i
        problem = make_problem(4, 8, limit_mib=None, static_mib=static)
        peaks = [p - base.devices[0].static_mib + static for p in plan.peak_memory_mib]
        repo.store_first(problem, plan.model_copy(update={"peak_memory_mib": peaks}), 5.0)
    seeded_s = time.perf_counter() - started
    big = make_problem(8, 420, limit_mib=None)
    big_plan = gpipe_plan(big, one_f_one_b=True)
    repo.store_first(big, big_plan, 5.0)
    print(f"\nseeded {N_PLANS} plans in {seeded_s:.1f} s")
    yield app, big.key(), op_count(big_plan)
    engine.dispose()


def _timed(client, url: str) -> tuple[float, str]:
    started = time.perf_counter()
    r = client.get(url)
    assert r.status_code == 200, r.text[:500]
    return (time.perf_counter() - started) * 1000, r.text


def test_overview_pages_stay_fast_at_1000_plans(big_cache):
    app, _, _ = big_cache
    with TestClient(app) as client:
        first_ms, html = _timed(client, "/dashboard/?per_page=50")
        assert f"of {N_PLANS + 1}" in html and len(re.findall(r'<tr id="row-', html)) == 50
        again_ms, _ = _timed(client, "/dashboard/?per_page=50")
        deep_ms, deep = _timed(client, "/dashboard/?per_page=50&page=15&sort=makespan_ms&dir=asc")
        assert len(re.findall(r'<tr id="row-', deep)) == 50
        filt_ms, _ = _timed(client, "/dashboard/?q=ab&state=queued")
        row_ms, _ = _timed(client, "/dashboard/rows/" + re.search(r'<tr id="row-([0-9a-f]{64})"', html).group(1))
    print(f"\noverview at {N_PLANS} plans, 50 rows: first view {first_ms:.0f} ms (1F1B computed), cached "
          f"{again_ms:.0f} ms, page 15 sorted by makespan {deep_ms:.0f} ms, filtered {filt_ms:.0f} ms, "
          f"one row fragment {row_ms:.0f} ms")
    assert again_ms < 1500 and deep_ms < 2500 and filt_ms < 1500


def test_plan_page_with_10k_ops(big_cache):
    app, key, n_ops = big_cache
    with TestClient(app) as client:
        first_ms, html = _timed(client, f"/dashboard/plans/{key}")
        again_ms, _ = _timed(client, f"/dashboard/plans/{key}")
        live_ms, _ = _timed(client, f"/dashboard/plans/{key}/live")
    assert n_ops >= 10_000 and html.count('<rect class="op ') == n_ops
    print(f"\nplan page with {n_ops} ops: first view {first_ms:.0f} ms (charts rendered, baselines "
          f"deferred to their own request), cached view {again_ms:.0f} ms, live fragment "
          f"{live_ms:.0f} ms, HTML {len(html) / 1e6:.2f} MB")
    assert first_ms < 3000 and again_ms < 1500
