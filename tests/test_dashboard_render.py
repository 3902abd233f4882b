"""Dashboard rendering without a browser: the SVG builders and the pages served from a real
Repository on a real (temporary) SQLite database migrated by the service's own Alembic scripts."""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

import pytest
from dashboard_fixtures import dashboard_app, gpipe_plan, make_problem, op_count
from fastapi.testclient import TestClient
from pipeplan.service.dashboard import views
from pipeplan.service.dashboard.data import page_links

SVG = "{http://www.w3.org/2000/svg}"


def _op_rects(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [r for r in root.iter(f"{SVG}rect") if r.get("class", "").split()[0] == "op"]


def test_gantt_has_exactly_one_bar_per_op_with_its_identity_and_times():
    problem = make_problem(4, 6, offload=True)
    plan = gpipe_plan(problem, offload_every=2)
    rects = _op_rects(views.gantt_svg(problem, plan))
    assert len(rects) == op_count(plan)
    drawn = sorted(tuple(r.get("data-o").split(",")) for r in rects)
    expected = sorted((op.kind, str(op.stage), str(op.mb), views._t(op.start_ms), views._t(op.end_ms))
                      for dp in plan.devices for op in dp.ops)
    assert drawn == expected
    for r in rects:  # the class names the kind, so CSS colours it
        assert r.get("class").split()[1] == r.get("data-o").split(",")[0]


def test_gantt_puts_copies_on_their_own_lanes_and_bars_scale_with_duration():
    problem = make_problem(2, 4, offload=True)
    plan = gpipe_plan(problem, offload_every=1)
    rects = _op_rects(views.gantt_svg(problem, plan))
    ys = {kind: {float(r.get("y")) for r in rects if r.get("class").split()[1] == kind}
          for kind in ("F", "OFFLOAD", "RELOAD")}
    # device 0's compute, D2H and H2D lanes are three distinct rows
    assert len({min(ys["F"]), min(ys["OFFLOAD"]), min(ys["RELOAD"])}) == 3
    f = next(r for r in rects if r.get("data-o").startswith("F,"))
    off = next(r for r in rects if r.get("data-o").startswith("OFFLOAD,"))
    # forward 1.0 ms vs offload 0.6 ms
    assert float(off.get("width")) / float(f.get("width")) == pytest.approx(0.6, rel=0.02)


def test_gantt_copy_lane_labels_only_when_the_problem_can_offload():
    problem = make_problem(3, 4)
    plan = gpipe_plan(problem)
    assert "D2H" not in views.gantt_labels_svg(problem, plan)
    assert len(_op_rects(views.gantt_svg(problem, plan))) == op_count(plan)
    offload = make_problem(3, 4, offload=True)
    labels = views.gantt_labels_svg(offload, gpipe_plan(offload, offload_every=2))
    assert labels.count(">D2H<") == 3 and labels.count(">H2D<") == 3


def test_zoom_stretches_time_only():
    problem = make_problem(2, 4)
    plan = gpipe_plan(problem)
    narrow, wide = views.gantt_svg(problem, plan), views.gantt_svg(problem, plan, views.CHART_W * 4)
    a, b = _op_rects(narrow), _op_rects(wide)
    assert [r.get("y") for r in a] == [r.get("y") for r in b]  # same rows
    assert ET.fromstring(narrow).get("height") == ET.fromstring(wide).get("height")
    assert float(b[-1].get("width")) == pytest.approx(4 * float(a[-1].get("width")), rel=0.01)


def test_memory_chart_peaks_match_the_plan_and_limits_are_drawn():
    problem = make_problem(4, 8, offload=True)
    plan = gpipe_plan(problem, offload_every=2)
    root = ET.fromstring(views.memory_svg(problem, plan))
    groups = [g for g in root.iter(f"{SVG}g") if g.get("class") == "mem-device"]
    assert len(groups) == problem.num_devices
    for g, peak in zip(groups, plan.peak_memory_mib):
        assert float(g.get("data-peak")) == pytest.approx(peak, abs=0.01)
        assert any(line.get("class") == "mem-limit" for line in g.iter(f"{SVG}line"))


def test_memory_chart_without_limit_draws_no_limit_line():
    problem = make_problem(2, 4, limit_mib=None)
    svg = views.memory_svg(problem, gpipe_plan(problem))
    assert "mem-limit" not in svg and "mem-line" in svg


def test_history_chart_has_a_point_per_revision():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    points = [views.RevisionPoint(1, t0, 40.0, 30.0, "heuristic"),
              views.RevisionPoint(2, t0 + timedelta(seconds=2), 36.0, 31.0, "cp-sat"),
              views.RevisionPoint(3, t0 + timedelta(seconds=5), 33.5, 32.0, "cp-sat <lns>")]
    svg = views.history_svg(points)
    root = ET.fromstring(svg)  # well-formed even with '<' in a method name
    assert len([c for c in root.iter(f"{SVG}circle")]) == 3
    assert "hist-bound" in svg and "hist-makespan" in svg


def test_formatting_and_paging_helpers():
    assert views.fmt_ms(0.5) == "0.5 ms" and views.fmt_ms(27.0) == "27.00 ms" and views.fmt_ms(12345) == "12.35 s"
    assert views.fmt_mib(None) == "unlimited" and views.fmt_mib(20480) == "20.0 GiB"
    assert views.nice_step(33.0) == 5
    assert page_links(1, 1) == [1]
    assert page_links(10, 20) == [1, None, 8, 9, 10, 11, 12, None, 20]


def test_10k_op_gantt_renders_fast_and_lean():
    problem = make_problem(8, 420, limit_mib=None)
    plan = gpipe_plan(problem, one_f_one_b=True)
    assert op_count(plan) >= 10_000
    started = time.perf_counter()
    svg = views.gantt_svg(problem, plan)
    gantt_s = time.perf_counter() - started
    started = time.perf_counter()
    mem = views.memory_svg(problem, plan)
    memory_s = time.perf_counter() - started
    assert svg.count('<rect class="op ') == op_count(plan)
    assert "<text class=\"mb\"" not in svg  # no per-bar labels at this size
    assert len(svg) / op_count(plan) < 120  # bytes per op: one short rect each
    assert len(mem) < 400_000  # memory curves are merged to half-pixel steps
    assert gantt_s < 2.0 and memory_s < 2.0, (gantt_s, memory_s)


# -- pages from a real repository ------------------------------------------------------------------

@pytest.fixture()
def dash_app(tmp_path):
    app, repo, engine = dashboard_app(f"sqlite:///{tmp_path / 'cache.sqlite'}")
    yield app, repo
    engine.dispose()


def test_plan_page_html_has_one_rect_per_op_and_download_links(dash_app):
    app, repo = dash_app
    problem = make_problem(4, 8, offload=True)
    plan = gpipe_plan(problem, offload_every=3)
    repo.store_first(problem, plan, 5.0)
    key = problem.key()
    with TestClient(app) as client:
        page = client.get(f"/dashboard/plans/{key}")
        assert page.status_code == 200
        assert len(re.findall(r'<rect class="op ', page.text)) == op_count(plan)
        for href in (f"/v1/plans/{key}", f"/v1/plans/{key}/export/torch.csv",
                     f"/v1/plans/{key}/export/chrome-trace.json"):
            assert f'href="{href}"' in page.text
        assert 'src="/dashboard/static/dashboard.js' in page.text and "cdn" not in page.text.lower()
        table = client.get(f"/dashboard/plans/{key}/baselines")
        assert table.status_code == 200
        for name in ("this plan", "1f1b", "zb-h1", "pipeoffload"):
            assert f'data-baseline="{name}"' in table.text
        again = client.get(f"/dashboard/plans/{key}")  # now cached: the table is inline
        assert 'id="baselines"' in again.text and "vs 1F1B" in again.text
        live = client.get(f"/dashboard/plans/{key}/live")
        assert live.status_code == 200 and len(re.findall(r'<rect class="op ', live.text)) == op_count(plan)
        assert client.get("/dashboard/plans/" + "0" * 64).status_code == 404
        assert client.get("/dashboard/plans/not-a-key%27%3B").status_code == 404
        assert client.get("/dashboard/static/dashboard.css").headers["content-type"].startswith("text/css")
        assert client.get("/dashboard/static/..%2Fdashboard.py").status_code == 404


def test_overview_lists_sorts_filters_and_paginates(dash_app):
    app, repo = dash_app
    keys = {}
    for m in range(2, 9):  # 7 configurations, makespan grows with microbatches
        problem = make_problem(2, m)
        repo.store_first(problem, gpipe_plan(problem), 5.0)
        keys[m] = problem.key()
    with TestClient(app) as client:
        page1 = client.get("/dashboard/?per_page=3&sort=makespan_ms&dir=asc")
        assert page1.status_code == 200
        rows = re.findall(r'<tr id="row-([0-9a-f]{64})"', page1.text)
        assert rows == [keys[2], keys[3], keys[4]]
        page3 = client.get("/dashboard/?per_page=3&sort=makespan_ms&dir=asc&page=3")
        assert re.findall(r'<tr id="row-([0-9a-f]{64})"', page3.text) == [keys[8]]
        assert "7–7 of 7" in page3.text
        past_the_end = client.get("/dashboard/?per_page=3&sort=makespan_ms&dir=asc&page=99")
        assert re.findall(r'<tr id="row-([0-9a-f]{64})"', past_the_end.text) == [keys[8]]
        one = client.get(f"/dashboard/?q={keys[5][:10]}")
        assert re.findall(r'<tr id="row-([0-9a-f]{64})"', one.text) == [keys[5]]
        none = client.get("/dashboard/?state=failed")
        assert "No cached plan matches" in none.text
        row = client.get(f"/dashboard/rows/{keys[6]}")
        assert row.status_code == 200 and row.text.startswith(f'<tr id="row-{keys[6]}"')


def test_history_with_makespan_equal_to_bound_up_to_float_noise_terminates():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    svg = views.history_svg([views.RevisionPoint(1, t0, 27.150000000000002, 27.15)])
    assert svg.count("<circle") == 1
    assert views._ticks(27.15, 27.150000000000002) == [27.15]


def test_later_chunks_of_a_v_placement_are_marked():
    base = make_problem(2, 3)
    stage = base.stages[0]
    problem = base.model_copy(update={"stages": [stage.model_copy(update={"device": d}) for d in (0, 1, 1, 0)]})
    problem = type(base).model_validate(problem.model_dump())
    plan = gpipe_plan(problem)
    rects = _op_rects(views.gantt_svg(problem, plan))
    assert len(rects) == op_count(plan)
    for r in rects:
        stage_of = int(r.get("data-o").split(",")[1])
        assert ("c1" in r.get("class").split()) == (stage_of in (2, 3)), r.attrib


def test_key_gated_reads_ask_for_the_key_and_accept_header_or_cookie(dash_app):
    from pipeplan.service import dashboard

    from pipeplan.settings import Settings

    app, repo = dash_app
    app.state.settings = Settings(api_keys=["s3cret", "other"], read_requires_key=True)
    dashboard.mount(app)
    problem = make_problem(2, 3)
    repo.store_first(problem, gpipe_plan(problem), 5.0)
    with TestClient(app) as client:
        locked = client.get("/dashboard/")
        assert locked.status_code == 401 and "API key required" in locked.text
        assert client.get(f"/dashboard/plans/{problem.key()}").status_code == 401
        assert client.get("/dashboard/", headers={"X-API-Key": "wrong"}).status_code == 401
        assert client.get("/dashboard/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        client.cookies.set("pipeplan_api_key", "other")
        page = client.get(f"/dashboard/plans/{problem.key()}")
        assert page.status_code == 200 and 'class="op ' in page.text
        assert client.get("/dashboard/static/dashboard.js").status_code == 200  # assets stay open


def test_plan_page_can_show_an_older_revision(dash_app):
    from dashboard_fixtures import slow_plan

    app, repo = dash_app
    problem = make_problem(3, 4)
    key = problem.key()
    first, better = slow_plan(problem), gpipe_plan(problem)
    repo.store_first(problem, first, 5.0)
    assert repo.store_if_better(key, better, problem) == 2
    with TestClient(app) as client:
        best = client.get(f"/dashboard/plans/{key}")
        assert 'id="m-revision">2<' in best.text and "pinned-notice" not in best.text
        old = client.get(f"/dashboard/plans/{key}?revision=1")
        assert old.status_code == 200
        assert 'id="m-revision">1<' in old.text and 'data-pinned="1"' in old.text and "pinned-notice" in old.text
        assert views.fmt_ms(first.makespan_ms) in old.text
        live = client.get(f"/dashboard/plans/{key}/live?revision=1&zoom=2")
        assert 'id="m-revision">1<' in live.text and 'data-zoom-level="2"' in live.text
        assert client.get(f"/dashboard/plans/{key}?revision=9").status_code == 404


def test_finished_jobs_say_how_they_ended_with_the_gap(dash_app):
    """Overview rows and the plan page print the API's and CLI's words: a spent budget or a stalled
    search is "done" with its gap, never an unqualified "converged". The gap itself is shown once, in
    the Gap column; the words beside it leave it out (the full sentence is the tooltip)."""
    app, repo = dash_app
    ends = {"optimal": (0.0, 3.2, 1), "budget": (4.13, 30.0, 2), "stalled": (7.44, 12.4, 0)}
    texts = {"optimal": "optimal (proven)",
             "budget": "budget spent after 30 s, gap 4.1% to the proven bound",
             "stalled": "no better plan found in 12 s (gap 7.4%)"}
    words = {"optimal": "optimal (proven)", "budget": "budget spent after 30 s",
             "stalled": "no better plan found in 12 s"}
    keys = {}
    for m, (outcome, (gap, searched, found)) in enumerate(ends.items(), start=3):
        problem = make_problem(2, m)
        _, _, job = repo.store_first(problem, gpipe_plan(problem), 30.0)
        repo.claim(problem.key(), job.run_id, "w")
        assert repo.finish(problem.key(), job.run_id, "done", outcome=outcome, gap_pct=gap, searched_s=searched,
                           run_improvements=found)
        keys[outcome] = problem.key()
    with TestClient(app) as client:
        overview = client.get("/dashboard/?state=done")
        assert overview.status_code == 200
        assert set(re.findall(r'<tr id="row-([0-9a-f]{64})"', overview.text)) == set(keys.values())
        assert "converged" not in overview.text
        for outcome, key in keys.items():
            row = client.get(f"/dashboard/rows/{key}").text
            assert f'class="badge done {outcome}"' in row, row
            assert f'<div class="outcome" title="{texts[outcome]}">{words[outcome]}</div>' in row, row
            live = client.get(f"/dashboard/plans/{key}/live").text
            assert f'<div class="sub" id="job-note">{words[outcome]}</div>' in live, live[:3000]


def test_vs_1f1b_card_names_the_worst_gpu_not_every_device():
    """At 16 GPUs the card printed every device's figure (30 lines); it says where 1F1B runs out."""
    from core_schedules import make_problem
    from pipeplan.service.dashboard.data import compute_one_f_one_b

    card = compute_one_f_one_b(make_problem(p=16, m=32, limit=800.0))
    assert card.note == "1F1B OOM"
    assert card.detail.startswith("1F1B needs 1.6 GiB on GPU 0 (limit 0.8 GiB; 7 more GPUs over)")


def test_render_cache_is_bounded_by_bytes_not_only_entries():
    """64 cached charts of big plans held over a GB: the cache counts their bytes."""
    from pipeplan.service.dashboard.data import _LRU

    lru = _LRU(64, max_weight=10, weight=len)
    lru.put("a", "x" * 6)
    lru.put("b", "y" * 6)
    assert not lru.contains("a") and lru.contains("b")
    lru.put("c", "z" * 20)  # larger than the budget: kept alone, the newest is always kept
    assert lru.contains("c") and not lru.contains("b")
    lru.put("c", "z")
    lru.put("d", "w" * 9)
    assert lru.contains("c") and lru.contains("d")
