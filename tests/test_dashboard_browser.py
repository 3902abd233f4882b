"""The dashboard in a real browser (Debian's Chromium through Playwright) against a real
`pipeplan serve` subprocess: embedded mode, a temporary SQLite file, the in-process worker pool.

Screenshots land in test-artifacts/ (docs/img/dashboard-*.png are copies of good ones).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from dashboard_fixtures import make_problem, slow_plan
from service_support import free_port

pytestmark = [pytest.mark.browser, pytest.mark.integration]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`pipeplan serve` on a free port with its own data dir (SQLite), nothing else configured."""
    data_dir = tmp_path_factory.mktemp("pipeplan-serve")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPLAN_")}
    env.update({
        "PIPEPLAN_DATA_DIR": str(data_dir), "PIPEPLAN_SOLVER_WORKERS": "1", "PIPEPLAN_SSE_POLL_S": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    cli = Path(sys.executable).with_name("pipeplan")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-c", "from pipeplan.cli import main; main()"]
    log = open(data_dir / "serve.log", "w")  # noqa: SIM115 — open for the server's whole life
    proc = subprocess.Popen([*cmd, "serve", "--port", str(port), "--log-level", "warning"], cwd=data_dir,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("pipeplan serve did not start:\n" + (data_dir / "serve.log").read_text()[-3000:])
        time.sleep(0.3)
    yield {"base": base, "data_dir": data_dir, "url": f"sqlite:///{data_dir / 'pipeplan.db'}"}
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _ms(value: str) -> str:
    """As the tooltip writes times: rounded to µs, no trailing zeros."""
    return f"{float(value):.3f}".rstrip("0").rstrip(".")


def _shot(pg, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / name), full_page=True)


def _post(server, problem, budget_s: float = 2.0) -> dict:
    r = httpx.post(server["base"] + "/v1/plans", json={"problem": problem.model_dump(mode="json"),
                                                      "time_budget_s": budget_s}, timeout=60)
    assert r.status_code in (200, 201), r.text[:500]
    return r.json()


def test_overview_lists_a_plan_created_through_the_api(server, page):
    problem = make_problem(4, 8, offload=True)
    created = _post(server, problem)
    key = problem.key()
    assert created["problem_key"] == key
    page.goto(server["base"] + "/dashboard/")
    row = page.locator(f"#row-{key}")
    row.wait_for(state="visible", timeout=10_000)
    assert key[:12] in row.inner_text()
    assert "4 GPUs" in row.inner_text()
    # the speed-up column gets its 1F1B figure (computed server-side, cached per key)
    page.wait_for_function(f"!document.querySelector('#row-{key}').hasAttribute('data-pending')", timeout=20_000)
    page.wait_for_timeout(300)
    _shot(page, "dashboard-overview.png")
    page.locator(f"#row-{key} a").first.click()
    page.wait_for_url(re.compile(rf".*/dashboard/plans/{key}$"))
    assert page.locator("svg.gantt").count() == 1


def test_plan_page_draws_exactly_one_bar_per_op(server, page):
    problem = make_problem(4, 12, offload=True, limit_mib=10500.0)
    _post(server, problem)
    key = problem.key()
    page.goto(f"{server['base']}/dashboard/plans/{key}")
    page.locator("svg.gantt").wait_for()
    # one read of the page: the live region may swap in a newer revision (the worker improves the
    # plan meanwhile) between two separate reads
    revision, bars, said = page.evaluate(
        "() => [+document.querySelector('#m-revision').textContent,"
        " document.querySelectorAll('svg.gantt rect.op').length, +document.querySelector('svg.gantt').dataset.ops]")
    plan = httpx.get(f"{server['base']}/v1/plans/{key}/revisions/{revision}", timeout=10).json()
    n_ops = sum(len(d["ops"]) for d in plan["devices"])
    assert bars == said == n_ops, (revision, bars, said, n_ops)
    assert page.locator("svg.memory g.mem-device").count() == problem.num_devices
    assert page.locator("svg.memory line.mem-limit").count() == problem.num_devices
    # hover: the single delegated handler shows op, stage, microbatch, start and end
    bar = page.locator("svg.gantt rect.op.F").nth(3)
    _kind, stage, mb, start, end = bar.get_attribute("data-o").split(",")
    bar.hover()
    tip = page.locator("#tip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert f"stage {stage}" in text and f"mb {mb}" in text and "ms" in text
    assert f"{_ms(start)} → {_ms(end)} ms" in text
    links = {label: page.get_by_role("link", name=label).get_attribute("href")
             for label in ("Plan JSON", "torch CSV", "Chrome trace", "Runtimes")}
    got = {label: httpx.get(server["base"] + href, timeout=10) for label, href in links.items()}
    assert all(got[label].status_code == 200 for label in ("Plan JSON", "Chrome trace", "Runtimes")), got
    torch_runs = next(r for r in got["Runtimes"].json()["runtimes"] if r["runtime"] == "torch")["runs"]
    assert got["torch CSV"].status_code == (200 if torch_runs else 409), got["torch CSV"].text[:300]
    _shot(page, "dashboard-plan.png")


def test_a_new_revision_from_the_worker_shows_up_without_a_reload(server, browser, page):
    """Seed a poor revision 1 (as an old cache entry), open the overview and the plan page, press
    Refine in the page: the embedded worker's better revision must reach both pages by SSE."""
    from pipeplan.service.db import make_engine
    from pipeplan.service.repository import Repository

    problem = make_problem(4, 8)
    key = problem.key()
    engine = make_engine(server["url"], 2)
    repo = Repository(engine)
    seeded = slow_plan(problem)
    repo.store_first(problem, seeded, 2.0)
    repo.request_cancel(key)  # an idle cache entry: nothing refines it until the button is pressed
    engine.dispose()

    overview = page.context.new_page()
    overview.goto(server["base"] + "/dashboard/?sort=updated_at&dir=desc")
    overview.locator(f"#row-{key}").wait_for()
    overview.evaluate("window.__sameDocument = 'yes'")
    assert overview.locator(f"#row-{key}").get_attribute("data-revision") == "1"

    page.goto(f"{server['base']}/dashboard/plans/{key}")
    page.evaluate("window.__sameDocument = 'yes'")
    assert page.locator("#m-revision").inner_text() == "1"
    page.wait_for_function("document.getElementById('live-dot').classList.contains('on')", timeout=10_000)
    page.fill("#api-key", "key-from-the-box")  # kept in localStorage, sent with refine / cancel
    page.dispatch_event("#api-key", "change")
    page.fill("#refine-budget", "3")
    with page.expect_request(lambda r: r.url.endswith("/refine") and r.method == "POST") as sent:
        page.click("button[data-action=refine]")
    assert sent.value.headers.get("x-api-key") == "key-from-the-box"
    assert sent.value.post_data_json == {"time_budget_s": 3}
    page.wait_for_function("parseInt(document.getElementById('m-revision').textContent) > 1", timeout=60_000)
    assert page.evaluate("window.__sameDocument") == "yes"  # updated in place, not reloaded
    best = httpx.get(f"{server['base']}/v1/plans/{key}", timeout=10).json()
    assert best["makespan_ms"] < seeded.makespan_ms
    page.wait_for_function(
        f"parseInt(document.getElementById('m-revision').textContent) === {best['revision']}"
        " || document.querySelector('#job-state').textContent !== 'solving'", timeout=30_000)
    # the overview row followed too, without a reload
    overview.wait_for_function(
        f"parseInt(document.getElementById('row-{key}').getAttribute('data-revision')) > 1", timeout=30_000)
    assert overview.evaluate("window.__sameDocument") == "yes"
    page.wait_for_timeout(300)
    _shot(page, "dashboard-plan-live.png")
    _shot(overview, "dashboard-overview-live.png")


def test_a_10k_op_plan_page_loads_and_hovers_fast(server, page):
    """One <rect> per op and one delegated handler: the page stays responsive at 10,000+ ops."""
    from dashboard_fixtures import gpipe_plan, op_count
    from pipeplan.service.db import make_engine
    from pipeplan.service.repository import Repository

    problem = make_problem(8, 420, limit_mib=None)
    plan = gpipe_plan(problem, one_f_one_b=True)
    key = problem.key()
    engine = make_engine(server["url"], 2)
    repo = Repository(engine)
    repo.store_first(problem, plan, 2.0)
    repo.request_cancel(key)  # keep the embedded worker off a 10k-op solve during the test
    engine.dispose()

    started = time.perf_counter()
    page.goto(f"{server['base']}/dashboard/plans/{key}", wait_until="load")
    load_s = time.perf_counter() - started
    assert page.locator("svg.gantt rect.op").count() == op_count(plan)
    # 200 hovers over different bars through the page's own handler, timed inside the browser
    per_hover_ms = page.evaluate("""() => {
        const bars = document.querySelectorAll('svg.gantt rect.op');
        const t0 = performance.now();
        for (let i = 0; i < 200; i++) {
            const el = bars[(i * 53) % bars.length], box = el.getBoundingClientRect();
            el.dispatchEvent(new MouseEvent('mousemove', {bubbles: true, clientX: box.x + 1, clientY: box.y + 1}));
        }
        return (performance.now() - t0) / 200;
    }""")
    assert page.locator("#tip").is_visible()
    started = time.perf_counter()
    page.click("button[data-zoom='in']")
    page.wait_for_selector(".zoom[data-zoom-level='2']")
    page.click("button[data-zoom='in']")
    page.wait_for_selector(".zoom[data-zoom-level='4']")
    zoom_s = time.perf_counter() - started
    assert page.locator("svg.gantt rect.op").count() == op_count(plan)
    assert float(page.locator("svg.gantt").get_attribute("width")) > 4000
    print(f"\n10k-op plan page in Chromium: load {load_s * 1000:.0f} ms, hover {per_hover_ms:.2f} ms each, "
          f"zoom 1x->2x->4x {zoom_s * 1000:.0f} ms (server re-render)")
    assert per_hover_ms < 20 and load_s < 15
    _shot(page, "dashboard-plan-10k.png")


def test_redoc_renders_the_api_document(server, page):
    """Issue 38 point 3: /redoc shows the API (ReDoc 3 is an ES module; as a classic script it broke)."""
    page.goto(server["base"] + "/redoc")
    page.get_by_text("Pipeline-parallel schedule plans as a service").first.wait_for(timeout=30_000)
    for path in ("/v1/plans/{key}/events", "/v1/plans/{key}/traces"):  # the operations, as they render
        page.get_by_text(path, exact=True).first.wait_for(timeout=30_000)
    _shot(page, "redoc.png")


def test_overview_row_shows_one_gap_and_every_column_at_1400px(server, browser):
    """Issue 38 points 6 and 8: a finished run that proved a tighter bound than its plan's shows one
    gap (the Gap column; the job's words leave theirs out), its text wraps inside its column so
    "Improved" stays in view at 1400 px, and the key shown copies as the key the API accepts."""
    from pipeplan.service.dashboard.views import fmt_ms
    from pipeplan.service.db import make_engine
    from pipeplan.service.repository import Repository

    problem = make_problem(4, 8).model_copy(update={"metadata": {
        "model": "Meta-Llama-3-8B-Instruct (128k vocabulary), tensor parallel 2, sequence parallel, FP8"}})
    key = problem.key()
    plan = slow_plan(problem)
    bound = plan.lower_bound_ms + 0.6 * (plan.makespan_ms - plan.lower_bound_ms)  # what a run proved
    gap_pct = 100 * (plan.makespan_ms - bound) / plan.makespan_ms
    engine = make_engine(server["url"], 2)
    repo = Repository(engine)
    _, _, job = repo.store_first(problem, plan, 30.0)
    assert repo.claim(key, job.run_id, "test")
    assert repo.finish(key, job.run_id, "done", outcome="budget", gap_pct=gap_pct, searched_s=30.2,
                       run_improvements=0, bound_ms=bound)
    engine.dispose()

    context = browser.new_context(viewport={"width": 1400, "height": 900}, device_scale_factor=1)
    pg = context.new_page()
    try:
        pg.goto(f"{server['base']}/dashboard/?q={key[:16]}")
        row = pg.locator(f"#row-{key}")
        row.wait_for()
        cells = row.locator("td")
        assert cells.nth(4).inner_text().strip() == f"{gap_pct:.1f}%"  # the Gap column: the run's bound
        assert cells.nth(3).inner_text().strip() == fmt_ms(bound)  # the bound that gap is against
        outcome = row.locator(".outcome")
        assert outcome.inner_text() == "budget spent after 30 s; no better plan found"  # no second gap
        boxes = pg.evaluate("""key => {
            const row = document.getElementById('row-' + key), cells = row.querySelectorAll('td');
            const box = e => e.getBoundingClientRect().toJSON();
            return {job: box(cells[8]), outcome: box(row.querySelector('.outcome')), improved: box(cells[9]),
                    width: document.documentElement.clientWidth, scroll: row.closest('div').scrollWidth,
                    view: row.closest('div').clientWidth, key: row.querySelector('a.key').textContent};
        }""", key)
        assert boxes["outcome"]["right"] <= boxes["job"]["right"] + 0.5, boxes
        assert boxes["improved"]["left"] >= boxes["job"]["right"] - 0.5, boxes
        assert boxes["improved"]["right"] <= boxes["width"] and boxes["scroll"] <= boxes["view"], boxes
        assert boxes["key"] == key and httpx.get(f"{server['base']}/v1/plans/{boxes['key']}").status_code == 200
        _shot(pg, "dashboard-overview-1400.png")
    finally:
        context.close()


def test_memory_chart_labels_stay_off_the_curves(server, page):
    """Issue 38 point 6: static and limit are named beside each memory strip, not drawn over it."""
    problem = make_problem(4, 12, offload=True, limit_mib=10400.0)
    _post(server, problem)
    page.goto(f"{server['base']}/dashboard/plans/{problem.key()}")
    page.locator("svg.memory g.mem-device").first.wait_for()
    clashes = page.evaluate("""() => {
        const strips = [...document.querySelectorAll('svg.memory rect.row-bg')].map(r => r.getBoundingClientRect());
        const out = [];
        for (const t of document.querySelectorAll('svg.memory text')) {
            const b = t.getBoundingClientRect();
            for (const s of strips)
                if (b.left < s.right && b.right > s.left && b.top < s.bottom && b.bottom > s.top)
                    out.push(t.textContent);
        }
        return out;
    }""")
    assert clashes == [], clashes
    captions = page.locator("svg.memory text.floor-label").all_text_contents()
    assert len(captions) == 4 and all(c.startswith("static 7.8 GiB · limit 10.2 GiB") for c in captions), captions
