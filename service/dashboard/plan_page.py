"""The plan page (/dashboard/plans/{key}): a plan's figures, Gantt and memory charts, revision history,
refine job, baselines, measured runs and frontiers; and the fragments the page re-fetches when a new
revision lands or the user zooms."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from pipeplan.planner.contract import Plan, Problem
from starlette.concurrency import run_in_threadpool

from .. import heap
from ..errors import MAX_REVISION
from ..frontier_store import FrontierStore
from . import baselines, data, traces, views
from .baselines import BASELINES
from .deps import checked_key, default_budget, gated, renders_of, repo_of
from .templating import PREFIX, context, templates

router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)


def _load_plan(repo, key: str, revision: int | None = None) -> tuple[Problem, Plan]:
    """The key's problem and its best plan, or the stored `revision` when one is asked for."""
    problem = repo.get_problem(checked_key(key))
    plan = repo.best_plan(key) if problem is not None else None
    if problem is None or plan is None:
        raise HTTPException(404, f"no cached plan with key {key}")
    if revision is not None and revision != plan.revision:
        stored = repo.revision_plan(key, revision) if revision <= MAX_REVISION else None
        if stored is None:
            raise HTTPException(404, f"key {key[:12]} has no revision {revision}")
        plan = Plan.model_validate_json(stored)
    return problem, plan


def _live_context(request: Request, repo, key: str, problem: Problem, plan: Plan,
              compute_baselines: bool = True, zoom: int = 1) -> dict[str, Any]:
    charts = renders_of(request).charts(key, problem, plan, zoom)
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
        "default_budget": int(default_budget(request)),
    }
    points = data.revision_points(revisions)
    rev_rows = [{"revision": p.revision, "makespan": views.fmt_ms(p.makespan_ms),
                 "bound": views.fmt_ms(p.lower_bound_ms), "method": p.method,
                 "neighbour_key": r["neighbour_key"], "neighbour_revision": r["neighbour_revision"],
                 "when": views.fmt_age(p.created_at, now)} for p, r in zip(points, revisions)]
    # the neighbour the key's plans grew from (its reused revision 1): the title bar links to it
    grew_from = next(({"key": r["neighbour_key"], "revision": r["neighbour_revision"], "of": r["revision"]}
                      for r in revisions if r["neighbour_key"]), None)
    best_revision = max((p.revision for p in points), default=plan.revision)
    pending = not compute_baselines and not baselines.known(request, key, problem)
    table, note = ([], "") if pending else baselines.table_rows(request, key, problem, plan)
    return {"key": key, "plan": plan, "m": metrics, "c": charts, "history": views.history_svg(points),
            "revisions": rev_rows, "grew_from": grew_from, "best_revision": best_revision, "baselines": table, "baselines_note": note,
            "baselines_pending": pending, "chrome_trace_href": f"/v1/plans/{key}/export/chrome-trace.json"}



@router.get("/plans/{key}", response_class=HTMLResponse, dependencies=gated)
def plan_page(request: Request, key: str, revision: int | None = Query(None, ge=1)) -> HTMLResponse:
    repo = repo_of(request)
    problem, plan = _load_plan(repo, key, revision)
    # Baselines take seconds on a 10k-op problem the first time: then the page comes first and
    # fetches the table (and the 1F1B figure) right after; later views have both cached.
    cached = baselines.known(request, key, problem)
    return templates.TemplateResponse(request, "dashboard/plan.html", context(
        request, summary=views.config_summary(problem), frontiers=_frontiers_of(repo, key),
        measured=traces.measured_of(repo, key, problem),
        **_live_context(request, repo, key, problem, plan, compute_baselines=cached),
    ), background=heap.release_after(_ops(plan)))


@router.get("/plans/{key}/baselines", response_class=HTMLResponse, dependencies=gated)
async def plan_baselines(request: Request, key: str) -> HTMLResponse:
    """The baselines table (planner.baselines.compare on the key's problem), computed once per key,
    in a child process."""
    problem, plan = await run_in_threadpool(_load_plan, repo_of(request), key)
    await baselines.build(request, key, problem)
    table, note = await run_in_threadpool(baselines.table_rows, request, key, problem, plan)
    return templates.TemplateResponse(request, "dashboard/_baselines.html",
                                      context(request, baselines=table, baselines_note=note),
                                      background=heap.release_after(_ops(plan)))


@router.get("/plans/{key}/live", response_class=HTMLResponse, dependencies=gated)
def plan_live(request: Request, key: str, zoom: int = Query(1, ge=1, le=max(data.ZOOMS)),
              revision: int | None = Query(None, ge=1)) -> HTMLResponse:
    """The parts of the plan page that change with a new revision or job state (a page pinned to
    an older revision keeps showing it, with the history and job state brought up to date)."""
    repo = repo_of(request)
    problem, plan = _load_plan(repo, key, revision)
    return templates.TemplateResponse(request, "dashboard/_plan_live.html", context(
        request, **_live_context(request, repo, key, problem, plan, zoom=zoom,
                             compute_baselines=baselines.known(request, key, problem))))


@router.get("/plans/{key}/charts", response_class=HTMLResponse, dependencies=gated)
def plan_charts(request: Request, key: str, zoom: int = Query(1, ge=1, le=max(data.ZOOMS)),
                revision: int | None = Query(None, ge=1)) -> HTMLResponse:
    """The Gantt and memory panels re-drawn at `zoom` × the page width (time axis only)."""
    problem, plan = _load_plan(repo_of(request), key, revision)  # keep the revision on screen
    return templates.TemplateResponse(request, "dashboard/_charts.html", context(
        request, key=key, plan=plan, c=renders_of(request).charts(key, problem, plan, zoom)),
        background=heap.release_after(_ops(plan)))


def _frontiers_of(repo, key: str) -> list[str]:
    """The frontiers a plan's key is a point of (the plan page links to them)."""
    try:
        return FrontierStore(repo).frontiers_of(key)
    except Exception:  # noqa: BLE001 - an old schema without the table: no link, the page still renders
        return []


def _ops(plan: Plan) -> int:
    return sum(len(dp.ops) for dp in plan.devices)
