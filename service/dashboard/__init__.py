"""The cache dashboard at /dashboard: server-rendered pages, HTML fragments for live updates, SSE.

Pages are plain `def` endpoints (blocking SQL runs in the thread pool). The browser keeps one
EventSource open; each event makes it re-fetch only the server-rendered fragment that changed (one
overview row, or the plan panels), so all rendering lives in the templates and `views`.

The app factory includes `router` when this module imports; everything it needs from the app is
read from `app.state.pipeplan` (the service's ServiceState: repository, event hub, settings) by
`_repo` / `_hub` below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import math
import time
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlencode

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from fastapi.templating import Jinja2Templates
from pipeplan.planner.contract import Plan, Problem
from starlette.concurrency import run_in_threadpool

from .. import exports_cache, heap
from ..admission import stream_admitted
from ..errors import MAX_PAGE, MAX_REVISION, ApiError, reject_nul
from ..flight import single_flight
from ..frontier_store import FrontierStore
from ..models import JOB_STATES
from . import data, views
from . import traces as dashboard_traces

PREFIX = "/dashboard"
HERE = Path(__file__).resolve().parent.parent  # service/: templates/ and static/ stay there
STATIC_DIR = HERE / "static" / "dashboard"
STATIC_FILES = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
PER_PAGE_CHOICES = (25, 50, 100, 200)
ONE_F_ONE_B_BUDGET_S = 0.25  # per overview request; the rest of the page's 1F1B figures load after
KEEPALIVE_S = 15.0
RECHECK_S = 5.0  # pub/sub is at-most-once: SSE streams re-read the database this often

KEY_COOKIE = "pipeplan_api_key"


class KeyRequired(Exception):
    """Reads are key-gated and the browser presented no valid key: show the key form instead."""


def require_read_key(request: Request) -> None:
    """Honour `read_requires_key`: a page load cannot send a header, so the key the user typed
    (stored in localStorage) also travels as a same-site cookie; API clients may send the header."""
    settings = _state_attr(request, "settings")
    keys = list(getattr(settings, "api_keys", None) or [])
    if not keys or not getattr(settings, "read_requires_key", False):
        return
    auth = request.headers.get("authorization", "")
    presented = (auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")) \
        or unquote(request.cookies.get(KEY_COOKIE) or "") or None
    ok = False
    for key in keys:  # constant time, no early exit
        ok |= presented is not None and hmac.compare_digest(presented.encode(), key.encode())
    if not ok:
        raise KeyRequired()


templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)
gated = [Depends(require_read_key)]

# Baseline figures depend only on the problem, i.e. on its content-addressed key: one process-wide
# cache is right. Rendered revisions depend on the database behind the app, so each app has its own.
BASELINES = data.BaselineCache()
ASSET_VERSION = str(int(max((STATIC_DIR / n).stat().st_mtime for n in STATIC_FILES)))

# Columns of the overview table: label, sort key understood by Repository.list_plans (None: not
# sortable server-side), numeric alignment.
COLUMNS = [
    ("Key", None, False), ("Configuration", "num_devices", False), ("Makespan", "makespan_ms", True),
    ("Lower bound", None, True), ("Gap", "gap", True), ("Bubble", "bubble_ratio", True),
    ("vs 1F1B", None, True), ("Rev", "revision", True), ("Refine job", None, False),
    ("Improved", "updated_at", False),
]


# -- what we need from the app ----------------------------------------------------------------------

def _state_attr(request: Request, *names: str) -> Any:
    """`app.state.pipeplan.<name>` (the service's ServiceState), else `app.state.<name>`."""
    for state in (getattr(request.app.state, "pipeplan", None), request.app.state):
        for name in names:
            value = getattr(state, name, None) if state is not None else None
            if value is not None:
                return value
    return None


def _repo(request: Request):
    repo = _state_attr(request, "repo")
    if repo is None:
        raise HTTPException(503, "the plan cache is not ready")
    return repo


def _hub(request: Request):
    return _state_attr(request, "hub")


def _renders(request: Request) -> data.RenderCache:
    cache = getattr(request.app.state, "dashboard_renders", None)
    if cache is None:  # first use; a racing second one is merely discarded
        settings = _state_attr(request, "settings")
        cache = request.app.state.dashboard_renders = data.RenderCache(
            max_mib=getattr(settings, "dashboard_render_cache_mib", 64.0))
    return cache


def _default_budget(request: Request) -> float:
    settings = _state_attr(request, "settings")
    return float(getattr(settings, "default_time_budget_s", 60.0) or 60.0)


def _ctx(request: Request, **values: Any) -> dict[str, Any]:
    return {"base": PREFIX, "asset_version": ASSET_VERSION, **values}


def mount(app) -> None:
    """Called by the app factory after including the router: the key form for gated reads."""

    @app.exception_handler(KeyRequired)
    async def _key_required(request: Request, exc: KeyRequired) -> HTMLResponse:
        response = templates.TemplateResponse(request, "dashboard/locked.html", _ctx(request), status_code=401)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response


# -- static files ----------------------------------------------------------------------------------

@router.get("/static/{name}")
def static_file(name: str) -> FileResponse:
    """Vendored CSS/JS only (no CDN); a fixed list, so no path from the URL reaches the disk."""
    if name not in STATIC_FILES:
        raise HTTPException(404, "no such file")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name],
                        headers={"Cache-Control": "public, max-age=3600"})


# -- overview -----------------------------------------------------------------------------------------

def _rows(repo, items: list[dict[str, Any]], budget_s: float) -> list[data.OverviewRow]:
    keys = [item["problem_key"] for item in items]
    figures = data.fill_one_f_one_b(BASELINES, keys, repo.get_problem, budget_s)
    now = datetime.now(UTC)
    rows = [data.overview_row(item, figures.get(item["problem_key"]), now) for item in items]
    marks = dashboard_traces.marks_of(repo, keys)
    return [replace(r, traced=marks[r.key]) if r.key in marks else r for r in rows]


@router.get("", response_class=HTMLResponse, dependencies=gated)
def overview_noslash() -> RedirectResponse:
    return RedirectResponse(PREFIX + "/", status_code=307)


@router.get("/", response_class=HTMLResponse, dependencies=gated)
def overview(
    request: Request,
    page: int = Query(1, ge=1),
    per_page: int = Query(50, ge=1, le=500),
    sort: str = Query("updated_at"),
    dir: str = Query("desc", pattern="^(asc|desc)$"),
    q: str | None = Query(None, max_length=100),
    state: str | None = Query(None),
) -> HTMLResponse:
    started = time.perf_counter()
    repo = _repo(request)
    q = (reject_nul("q", q) or "").strip() or None
    state = state if state in JOB_STATES else None
    page = min(page, MAX_PAGE)  # beyond it: the last page, below (no offset the database cannot take)
    sortable = {c[1] for c in COLUMNS if c[1]}
    sort = sort if sort in sortable else "updated_at"
    items, total = repo.list_plans(offset=(page - 1) * per_page, limit=per_page, sort=sort,
                                   descending=dir == "desc", q=q, job_state=state)
    pages = max(1, math.ceil(total / per_page))
    if page > pages:  # a stale link past the end: show the last page rather than nothing
        page = pages
        items, total = repo.list_plans(offset=(page - 1) * per_page, limit=per_page, sort=sort,
                                       descending=dir == "desc", q=q, job_state=state)
    rows = _rows(repo, items, ONE_F_ONE_B_BUDGET_S)
    job_counts = sorted(repo.job_counts().items(), key=lambda kv: JOB_STATES.index(kv[0])
                        if kv[0] in JOB_STATES else 99)

    def href(**change: Any) -> str:
        params = {"page": page, "per_page": per_page, "sort": sort, "dir": dir, "q": q or "", "state": state or ""}
        params.update(change)
        return f"{PREFIX}/?" + urlencode({k: v for k, v in params.items() if v not in ("", None)})

    columns = []
    for label, key, num in COLUMNS:
        next_dir = "asc" if (key == sort and dir == "desc") else "desc"
        columns.append({"label": label, "sort": key, "num": num,
                        "href": href(sort=key, dir=next_dir, page=1) if key else ""})
    first = (page - 1) * per_page + 1 if items else 0
    return templates.TemplateResponse(request, "dashboard/overview.html", _ctx(
        request, rows=rows, total=total, page=page, pages=pages, per_page=per_page, sort=sort, dir=dir,
        q=q, state=state, states=JOB_STATES, per_page_choices=PER_PAGE_CHOICES, columns=columns,
        page_links=data.page_links(page, pages), page_href=lambda p: href(page=p), first=first,
        last=first + len(items) - 1 if items else 0, job_counts=job_counts,
        render_ms=(time.perf_counter() - started) * 1000,
    ))


@router.get("/rows/{key}", response_class=HTMLResponse, dependencies=gated)
def overview_row(request: Request, key: str) -> HTMLResponse:
    """One overview `<tr>`, re-fetched by the page when an event names the key."""
    repo = _repo(request)
    item = _list_item(repo, _checked(key))
    if item is None:
        raise HTTPException(404, f"no cached plan with key {key}")
    row = _rows(repo, [item], budget_s=30.0)[0]
    macro = templates.env.get_template("dashboard/_row.html").module.row
    return HTMLResponse(str(macro(row, PREFIX)))


def _list_item(repo, key: str) -> dict[str, Any] | None:
    """The listing's summary for one key (a key-prefix query on the primary key, one row)."""
    items, _ = repo.list_plans(offset=0, limit=2, q=key)
    return next((i for i in items if i["problem_key"] == key), None)


# -- plan page ---------------------------------------------------------------------------------------

def _checked(key: str) -> str:
    """Keys are SHA-256 hex; anything else cannot be cached, so it is a 404 without a query."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise HTTPException(404, f"no cached plan with key {key[:80]}")
    return key


def _load_plan(repo, key: str, revision: int | None = None) -> tuple[Problem, Plan]:
    """The key's problem and its best plan, or the stored `revision` when one is asked for."""
    problem = repo.get_problem(_checked(key))
    plan = repo.best_plan(key) if problem is not None else None
    if problem is None or plan is None:
        raise HTTPException(404, f"no cached plan with key {key}")
    if revision is not None and revision != plan.revision:
        stored = repo.revision_plan(key, revision) if revision <= MAX_REVISION else None
        if stored is None:
            raise HTTPException(404, f"key {key[:12]} has no revision {revision}")
        plan = Plan.model_validate_json(stored)
    return problem, plan


def _live_ctx(request: Request, repo, key: str, problem: Problem, plan: Plan,
              compute_baselines: bool = True, zoom: int = 1) -> dict[str, Any]:
    charts = _renders(request).charts(key, problem, plan, zoom)
    revisions = repo.revisions(key)
    job = repo.job(key)
    one = (BASELINES.one_f_one_b_of(key, problem) if compute_baselines
           else BASELINES.one_f_one_b.get(key) or data.OneF1B(None, "…", "computing 1F1B…"))
    now = datetime.now(UTC)
    peak = max(plan.peak_memory_mib, default=0.0)
    limits = [problem.limit_of(d) for d in range(problem.num_devices)]
    headroom = min((lim - p for lim, p in zip(limits, plan.peak_memory_mib) if math.isfinite(lim)), default=None)
    if job is None:
        job_state, job_note = None, "no refine job"
    else:
        job_state = job.state
        job_note = job.outcome_words or {  # a finished run's own words: "optimal (proven)", "budget spent …"
            "queued": "waiting for a worker",
            "solving": f"{job.used_s:.0f} of {job.budget_s:.0f} s used",
            "done": "outcome not recorded (finished before outcomes were kept)",
            "failed": (job.error or "failed")[:80],
            "cancelled": "cancelled"}.get(job.state, job.state)
    # one bound, one gap: the plan's, or the tighter one a run proved (the job's words leave theirs out)
    bound = min(plan.makespan_ms, max(plan.lower_bound_ms, plan.solver_bound_ms or 0.0, (job and job.bound_ms) or 0.0))
    metrics = {
        "makespan": views.fmt_ms(plan.makespan_ms),
        "bound": views.fmt_ms(bound),
        "gap": views.fmt_pct((plan.makespan_ms - bound) / plan.makespan_ms if plan.makespan_ms > 0 else 0.0),
        "bubble": views.fmt_pct(plan.bubble_ratio),
        "speedup": views.speedup_over(one.makespan_ms, plan.makespan_ms),
        "speedup_note": (f"{one.detail or '1F1B'} {views.fmt_ms(one.makespan_ms)} at same memory"
                         if one.makespan_ms else (one.detail or one.note)),
        "peak": views.fmt_mib(peak),
        "peak_note": "no limits" if headroom is None else f"min headroom {views.fmt_mib(max(0.0, headroom))}",
        "job_state": job_state,
        "job_outcome": job.outcome if job else None,
        "job_note": job_note,
        "ops": charts["ops"],
        "default_budget": int(_default_budget(request)),
    }
    points = data.revision_points(revisions)
    rev_rows = [{"revision": p.revision, "makespan": views.fmt_ms(p.makespan_ms),
                 "bound": views.fmt_ms(p.lower_bound_ms), "method": p.method,
                 "when": views.fmt_age(p.created_at, now)} for p in points]
    best_revision = max((p.revision for p in points), default=plan.revision)
    pending = not compute_baselines and not _baselines_known(request, key, problem)
    baselines, note = ([], "") if pending else _baseline_rows(request, key, problem, plan)
    return {"key": key, "plan": plan, "m": metrics, "c": charts, "history": views.history_svg(points),
            "revisions": rev_rows, "best_revision": best_revision, "baselines": baselines, "baselines_note": note,
            "baselines_pending": pending, "chrome_trace_href": f"/v1/plans/{key}/export/chrome-trace.json"}


def _ratio(baseline_ms: float, this_ms: float) -> str:
    """How this plan compares with a baseline: '1.14× faster', '1.05× slower' or 'as fast'."""
    if abs(baseline_ms - this_ms) <= 5e-4 * this_ms:
        return "as fast"
    return f"{baseline_ms / this_ms:.2f}× faster" if baseline_ms > this_ms else f"{this_ms / baseline_ms:.2f}× slower"


def _baselines_known(request: Request, key: str, problem: Problem) -> bool:
    """In the process cache, or on disk (then loaded into it): computed once per problem, kept across
    restarts and shared by this host's API processes (service.exports_cache)."""
    if BASELINES.tables.contains(key):
        return True
    root = getattr(_state_attr(request, "settings"), "resolved_export_cache_dir", None)
    stored = exports_cache.read_baselines(root, key) if root is not None else None
    if stored is None:
        return False
    BASELINES.put_table(key, problem, [data.BaselineRow(**row) for row in stored], "")
    return True


_BASELINE_BUILDS: dict[str, asyncio.Future] = {}  # key -> the child computing its table (single flight)


def _baseline_slot(request: Request) -> asyncio.Semaphore:
    """One table at a time per app (a big one is a minute of a core); made in the app's own loop."""
    slot = getattr(request.app.state, "baseline_slot", None)
    if slot is None:
        slot = request.app.state.baseline_slot = asyncio.Semaphore(1)
    return slot


async def _build_baselines(request: Request, key: str, problem: Problem) -> None:
    """Compute the key's baselines table in a killable child process (service.inline), which writes it
    beside the exports; then load it. Without a service (a bare dashboard app) it is computed on
    first read in the thread pool instead. A table that failed or timed out is noted, not retried
    until the process restarts."""
    from .. import inline

    settings = _state_attr(request, "settings")
    if settings is None or _baselines_known(request, key, problem):
        return

    async def build() -> None:
        async with _baseline_slot(request):
            job = {"key": key, "root": str(settings.resolved_export_cache_dir),
                   "database_url": settings.resolved_database_url}
            try:
                result = await inline.run_in_child(job, settings.baselines_timeout_s, None,
                                                   settings.retry_after_s, entry=data.build_baselines,
                                                   what="the baselines table")
            except ApiError as exc:  # the time box, a crash: said in the table's place
                result = {"rows": 0, "note": f"Baselines could not be computed: {exc.detail}"}
        if not _baselines_known(request, key, problem):  # no rows written: keep the note instead
            note = result.get("note") or "No baseline applies to this problem."
            BASELINES.put_table(key, problem, [], note)

    await single_flight(_BASELINE_BUILDS, key, build)


def _baseline_rows(request: Request, key: str, problem: Problem, plan: Plan) -> tuple[list[dict[str, Any]], str]:
    computed = not _baselines_known(request, key, problem)
    rows, note = BASELINES.table_of(key, problem)
    root = getattr(_state_attr(request, "settings"), "resolved_export_cache_dir", None)
    if computed and rows and not note and root is not None:
        exports_cache.write_baselines(root, key, [dataclasses.asdict(r) for r in rows])
    entries = [{"name": "this plan", "makespan_ms": plan.makespan_ms,
                "peak_mib": max(plan.peak_memory_mib, default=0.0), "reason": "", "this": True}]
    entries += [{"name": r.name, "makespan_ms": r.makespan_ms, "peak_mib": r.peak_mib, "reason": r.reason,
                 "this": False} for r in rows]
    longest = max((e["makespan_ms"] for e in entries if e["makespan_ms"]), default=1.0)
    out = []
    for e in entries:
        ms = e["makespan_ms"]
        out.append({
            "name": e["name"], "this": e["this"], "reason": views.short_reason(e["reason"]),
            "reason_full": e["reason"],
            "makespan": views.fmt_ms(ms) if ms is not None else None,
            "bar": 100.0 * ms / longest if ms else 0.0,
            "ratio": _ratio(ms, plan.makespan_ms) if ms and not e["this"] else ("—" if e["this"] else ""),
            "peak": views.fmt_mib(e["peak_mib"]) if e["peak_mib"] is not None else "",
        })
    return (out if rows else []), note


@router.get("/plans/{key}", response_class=HTMLResponse, dependencies=gated)
def plan_page(request: Request, key: str, revision: int | None = Query(None, ge=1)) -> HTMLResponse:
    repo = _repo(request)
    problem, plan = _load_plan(repo, key, revision)
    # Baselines take seconds on a 10k-op problem the first time: then the page comes first and
    # fetches the table (and the 1F1B figure) right after; later views have both cached.
    cached = _baselines_known(request, key, problem)
    return templates.TemplateResponse(request, "dashboard/plan.html", _ctx(
        request, summary=views.config_summary(problem), frontiers=_frontiers_of(repo, key),
        measured=dashboard_traces.measured_of(repo, key, problem),
        **_live_ctx(request, repo, key, problem, plan, compute_baselines=cached),
    ), background=heap.release_after(_ops(plan)))


@router.get("/plans/{key}/baselines", response_class=HTMLResponse, dependencies=gated)
async def plan_baselines(request: Request, key: str) -> HTMLResponse:
    """The baselines table (planner.baselines.compare on the key's problem), computed once per key,
    in a child process."""
    problem, plan = await run_in_threadpool(_load_plan, _repo(request), key)
    await _build_baselines(request, key, problem)
    baselines, note = await run_in_threadpool(_baseline_rows, request, key, problem, plan)
    return templates.TemplateResponse(request, "dashboard/_baselines.html",
                                      _ctx(request, baselines=baselines, baselines_note=note),
                                      background=heap.release_after(_ops(plan)))


@router.get("/plans/{key}/live", response_class=HTMLResponse, dependencies=gated)
def plan_live(request: Request, key: str, zoom: int = Query(1, ge=1, le=max(data.ZOOMS)),
              revision: int | None = Query(None, ge=1)) -> HTMLResponse:
    """The parts of the plan page that change with a new revision or job state (a page pinned to
    an older revision keeps showing it, with the history and job state brought up to date)."""
    repo = _repo(request)
    problem, plan = _load_plan(repo, key, revision)
    return templates.TemplateResponse(request, "dashboard/_plan_live.html", _ctx(
        request, **_live_ctx(request, repo, key, problem, plan, zoom=zoom,
                             compute_baselines=_baselines_known(request, key, problem))))


@router.get("/plans/{key}/charts", response_class=HTMLResponse, dependencies=gated)
def plan_charts(request: Request, key: str, zoom: int = Query(1, ge=1, le=max(data.ZOOMS)),
                revision: int | None = Query(None, ge=1)) -> HTMLResponse:
    """The Gantt and memory panels re-drawn at `zoom` × the page width (time axis only)."""
    problem, plan = _load_plan(_repo(request), key, revision)  # keep the revision on screen
    return templates.TemplateResponse(request, "dashboard/_charts.html", _ctx(
        request, key=key, plan=plan, c=_renders(request).charts(key, problem, plan, zoom)),
        background=heap.release_after(_ops(plan)))


def _frontiers_of(repo, key: str) -> list[str]:
    """The frontiers a plan's key is a point of (the plan page links to them)."""
    try:
        return FrontierStore(repo).frontiers_of(key)
    except Exception:  # noqa: BLE001 - an old schema without the table: no link, the page still renders
        return []


def _ops(plan: Plan) -> int:
    return sum(len(dp.ops) for dp in plan.devices)


# -- live events ----------------------------------------------------------------------------------------

def _snapshot(repo, key: str) -> tuple[int | None, str | None]:
    job = repo.job(key)
    return repo.best_revision(key), (job.state if job else None)


@router.get("/events", response_class=EventSourceResponse, dependencies=[*gated, Depends(stream_admitted)])
async def events(request: Request, key: str | None = Query(None, max_length=64),
                 rev: int | None = Query(None, ge=0), state: str | None = Query(None, max_length=20)):
    """Revision and job-state events for one key, or for every key (the overview).

    Messages come from the service's event hub; a per-key stream also re-reads the database at once
    (against the `rev`/`state` the page was rendered with) and then every few seconds, because
    pub/sub may drop a message and a change that landed while the page loaded must still show.
    """
    repo = _repo(request)
    hub = _hub(request)
    settings = _state_attr(request, "settings")
    keepalive_s = float(getattr(settings, "sse_keepalive_s", KEEPALIVE_S))
    recheck_s = float(getattr(settings, "sse_poll_s", RECHECK_S))
    yield ServerSentEvent(comment="connected", retry=2000)
    # What the page shows (rev, state): anything newer that landed while it loaded is sent at once.
    last = (rev, state or None) if key and rev is not None else (
        await run_in_threadpool(_snapshot, repo, key) if key else None)
    next_check = time.monotonic()
    quiet_since = time.monotonic()
    with _subscribe(hub, key or "*") as sub:
        while True:
            wait = keepalive_s if not key else max(0.05, min(keepalive_s, next_check - time.monotonic()))
            message = await _next(sub, wait)
            if message:
                quiet_since = time.monotonic()
                kind = message.get("type")
                yield ServerSentEvent(event=kind if kind in ("revision", "job") else "message", data=message)
                if key:  # the hub told us: do not announce the same change again from the re-check
                    last = await run_in_threadpool(_snapshot, repo, key)
                continue
            if key and time.monotonic() >= next_check:
                next_check = time.monotonic() + recheck_s
                now = await run_in_threadpool(_snapshot, repo, key)
                if now[0] != last[0]:
                    yield ServerSentEvent(event="revision", data={"type": "revision", "key": key,
                                                                  "revision": now[0]})
                if now[1] != last[1]:
                    yield ServerSentEvent(event="job", data={"type": "job", "key": key, "state": now[1]})
                if now != last:
                    last, quiet_since = now, time.monotonic()
            if time.monotonic() - quiet_since >= keepalive_s:
                quiet_since = time.monotonic()
                yield ServerSentEvent(comment="keepalive")


@contextmanager
def _subscribe(hub, key: str):
    """The hub's subscription, or None when the app has no hub (then only the re-check runs)."""
    if hub is None:
        yield None
    else:
        with hub.subscribe(key) as sub:
            yield sub


async def _next(sub, timeout: float) -> dict[str, Any] | None:
    if sub is None:
        await asyncio.sleep(timeout)
        return None
    return await sub.get(timeout)
