"""The overview page (/dashboard/): one page of the plan cache, sortable and searchable, with each
key's gap, 1F1B comparison and refine job; and the one-row fragment the page re-fetches live."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from ..errors import MAX_PAGE, reject_nul
from ..models import JOB_STATES
from . import data, traces
from .baselines import BASELINES
from .deps import checked_key, gated, repo_of
from .templating import PREFIX, context, templates

PER_PAGE_CHOICES = (25, 50, 100, 200)
ONE_F_ONE_B_BUDGET_S = 0.25  # per overview request; the rest of the page's 1F1B figures load after
router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)

# Columns of the overview table: label, sort key understood by Repository.list_plans (None: not
# sortable server-side), numeric alignment.
COLUMNS = [
    ("Key", None, False), ("Configuration", "num_devices", False), ("Makespan", "makespan_ms", True),
    ("Lower bound", None, True), ("Gap", "gap", True), ("Bubble", "bubble_ratio", True),
    ("vs 1F1B", None, True), ("Rev", "revision", True), ("Refine job", None, False),
    ("Improved", "updated_at", False),
]


def _rows(repo, items: list[dict[str, Any]], budget_s: float) -> list[data.OverviewRow]:
    keys = [item["problem_key"] for item in items]
    figures = data.fill_one_f_one_b(BASELINES, keys, repo.get_problem, budget_s)
    now = datetime.now(UTC)
    rows = [data.overview_row(item, figures.get(item["problem_key"]), now) for item in items]
    marks = traces.marks_of(repo, keys)
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
    repo = repo_of(request)
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
    return templates.TemplateResponse(request, "dashboard/overview.html", context(
        request, rows=rows, total=total, page=page, pages=pages, per_page=per_page, sort=sort, dir=dir,
        q=q, state=state, states=JOB_STATES, per_page_choices=PER_PAGE_CHOICES, columns=columns,
        page_links=data.page_links(page, pages), page_href=lambda p: href(page=p), first=first,
        last=first + len(items) - 1 if items else 0, job_counts=job_counts,
        render_ms=(time.perf_counter() - started) * 1000,
    ))


@router.get("/rows/{key}", response_class=HTMLResponse, dependencies=gated)
def overview_row(request: Request, key: str) -> HTMLResponse:
    """One overview `<tr>`, re-fetched by the page when an event names the key."""
    repo = repo_of(request)
    item = _list_item(repo, checked_key(key))
    if item is None:
        raise HTTPException(404, f"no cached plan with key {key}")
    row = _rows(repo, [item], budget_s=30.0)[0]
    macro = templates.env.get_template("dashboard/_row.html").module.row
    return HTMLResponse(str(macro(row, PREFIX)))


def _list_item(repo, key: str) -> dict[str, Any] | None:
    """The listing's summary for one key (a key-prefix query on the primary key, one row)."""
    items, _ = repo.list_plans(offset=0, limit=2, q=key)
    return next((i for i in items if i["problem_key"] == key), None)
