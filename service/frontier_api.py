"""/v1/frontiers: request a time-memory frontier, read its curve, follow it, and query it.

POST places the budgets and computes every point's first plan (peers, the unlimited-memory first
plan, adaptive points probed with the service's cheap first plan), in a killable child process with
a time box, holding an admission slot, and only for requests within `frontier_max_ops`. Each point is
stored as an ordinary cached plan under its own problem key, with one ordinary refine job per point on
the shared queue, so several workers share one frontier. Revision 1 of each point is already the
best of its first plan, the next smaller point's plan and every peer that fits (monotone from the
first answer); workers then offer each finished point's plan to the larger ones
(service.frontier_store.propagate).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from pipeplan.planner.contract import Problem
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from . import inline
from .admission import rate_limited, stream_admitted
from .api import KEY_RE, enqueue, refine_budget
from .deps import StateDep
from .document_stream import document_events
from .errors import ApiError
from .frontier_store import FrontierStore, check_size, first_points, frontier_key
from .models import QUEUED
from .security import require_read, require_write
from .state import ServiceState

router = APIRouter(prefix="/v1", tags=["frontiers"])
GIB = 1024.0


class FrontierRequest(BaseModel):
    """Exactly one of `problem` or `spec`; how many points; each point's refine budget."""

    model_config = ConfigDict(extra="forbid")

    problem: Problem | None = Field(None, description="A pipeplan.problem/v1 document.")
    spec: dict[str, Any] | None = Field(None, description="A model spec for the cost model.")
    points: int = Field(12, ge=2, le=64, description="Points on the curve (both ends included).")
    budgets: Literal["uniform", "scaled"] = Field(
        "uniform", description="uniform: one memory cap per GPU, the same on every device; scaled: each"
        " device's free memory scaled by one factor (clusters of mixed GPUs).")
    time_budget_s: float | None = Field(None, gt=0, description="Refine budget of each point (default from settings).")

    @model_validator(mode="after")
    def _one_of(self) -> FrontierRequest:
        if (self.problem is None) == (self.spec is None):
            raise ValueError("give exactly one of problem or spec")
        return self


def frontier_links(key: str) -> dict[str, str]:
    return {"self": f"/v1/frontiers/{key}", "events": f"/v1/frontiers/{key}/events",
            "least_memory": f"/v1/frontiers/{key}/least-memory?target_ms=", "fastest": f"/v1/frontiers/{key}/fastest?budget_gib=",
            "dashboard": f"/dashboard/frontiers/{key}"}


def _store(st: ServiceState) -> FrontierStore:
    return FrontierStore.of(st.repo)


def _queue_new_points(st: ServiceState, keys: list[str]) -> None:
    """Publish each new point's revision 1 and enqueue its refine job (the child cannot reach an
    in-process queue; a point it stored but nobody enqueued is found by the reconciler)."""
    for pkey in keys:
        st.events.publish_revision(pkey, 1)
        job = st.repo.job(pkey)
        if job is not None and job.state == QUEUED:
            enqueue(st, pkey, job)


def _answer(st: ServiceState, key: str, created: bool) -> Response:
    doc = _store(st).curve(key)
    return JSONResponse({"frontier_key": key, "created": created, "frontier": doc, "links": frontier_links(key)},
                        status_code=201 if created else 200)


@router.post("/frontiers", status_code=200, summary="Request a time-memory frontier (one refine job per point)",
             responses={201: {"description": "New frontier: points stored, their jobs queued"},
                        422: {"description": "Invalid input, or more points than this problem's size allows"},
                        429: {"description": "Rate limited; retry after Retry-After seconds"},
                        503: {"description": "Busy or past the time box; retry after Retry-After seconds"}},
             dependencies=[Depends(require_write), Depends(rate_limited)])
async def create_frontier(body: FrontierRequest, request: Request, st: StateDep) -> Response:
    s = st.settings
    budget = refine_budget(st, body.time_budget_s)
    job: dict[str, Any] = {"limits": s.limits.model_dump(), "database_url": s.resolved_database_url,
                           "points": body.points, "budgets": body.budgets, "max_ops": s.frontier_max_ops,
                           "budget_s": budget, "greedy_s": s.inline_greedy_s, "greedy_max_s": s.inline_greedy_max_s}
    if body.spec is not None:
        inline.check_spec(body.spec, s.limits)  # microseconds; the conversion runs in the child
        job["spec"] = body.spec
    else:
        inline.check_problem(body.problem, s.limits)
        check_size(body.problem, body.points, s.frontier_max_ops)
        key = frontier_key(body.problem.key(), body.points, body.budgets)
        if await run_in_threadpool(_store(st).exists, key):
            return await run_in_threadpool(_answer, st, key, False)
        job["problem"] = body.problem.model_dump_json()
    async with st.admission.frontier_slot():
        try:
            result = await inline.run_in_child(job, s.frontier_timeout_s, request.is_disconnected, s.retry_after_s,
                                               entry=first_points, what="the frontier's first plans")
        except inline.Gone:
            return Response(status_code=499)  # nobody is listening; the work was stopped
    await run_in_threadpool(_queue_new_points, st, result["new"])
    return await run_in_threadpool(_answer, st, result["key"], result["created"])


def _curve(st: ServiceState, key: str) -> dict[str, Any]:
    _known_key(key)
    doc = _store(st).curve(key)
    if doc is None:
        raise ApiError(404, "not_found", f"no frontier {key}")
    return doc


def _known_key(key: str) -> None:
    if not KEY_RE.fullmatch(key):
        raise ApiError(404, "not_found", "frontier keys are 64 lowercase hex characters (SHA-256)")


def _curve_body(st: ServiceState, key: str) -> str:
    """GET's body: the cached curve JSON with the key and links spliced in (not re-encoded per read)."""
    _known_key(key)
    doc = _store(st).curve_json(key)
    if doc is None:
        raise ApiError(404, "not_found", f"no frontier {key}")
    return f'{{"frontier_key":{json.dumps(key)},"links":{json.dumps(frontier_links(key))},{doc[1:]}'


@router.get("/frontiers/{key}", summary="The curve: each point's best stored plan now (pipeplan.frontier/v1)",
            responses={200: {"content": {"application/json": {}}, "description": "pipeplan.frontier/v1"}},
            dependencies=[Depends(require_read)])
async def get_frontier(key: str, st: StateDep) -> Response:
    body = await run_in_threadpool(_curve_body, st, key)
    return Response(body, media_type="application/json")


def _point_answer(key: str, point: dict[str, Any]) -> dict[str, Any]:
    return {"frontier_key": key, "point": point, "plan": f"/v1/plans/{point['problem_key']}"}


@router.get("/frontiers/{key}/least-memory", summary="The least memory per GPU that reaches target_ms",
            dependencies=[Depends(require_read)])
def least_memory(key: str, st: StateDep, target_ms: float = Query(..., gt=0)) -> Any:
    from pipeplan.planner.frontier import view_of

    view = view_of(_curve(st, key))
    hit = view.least_memory(target_ms)
    if hit is None:
        best = min(view.points, key=lambda p: p.makespan_ms)
        raise ApiError(404, "not_found", f"target_ms: no point reaches {target_ms:g} ms; the fastest is"
                       f" {best.makespan_ms:.2f} ms at {best.budget_mib / GIB:.2f} GiB per GPU",
                       {"fastest": best.doc})
    return _point_answer(key, hit.doc)


@router.get("/frontiers/{key}/fastest", summary="The fastest plan within budget_gib per GPU",
            dependencies=[Depends(require_read)])
def fastest(key: str, st: StateDep, budget_gib: float = Query(..., gt=0)) -> Any:
    from pipeplan.planner.frontier import view_of

    view = view_of(_curve(st, key))
    hit = view.fastest(budget_gib * GIB)
    if hit is None:
        least = min(view.points, key=lambda p: p.budget_mib)
        raise ApiError(404, "not_found", f"budget_gib: {budget_gib:g} GiB per GPU is below the least any schedule"
                       f" needs ({least.budget_mib / GIB:.2f} GiB)", {"least": least.doc})
    return _point_answer(key, hit.doc)


async def _known_frontier(key: str, st: StateDep) -> str:
    """Dependency: 404 before the stream starts (raised inside the generator it breaks the response)."""
    await run_in_threadpool(_curve, st, key)
    return key


@router.get("/frontiers/{key}/events", response_class=EventSourceResponse,
            summary="Server-sent events: one `curve` event (the whole document) whenever a point improves",
            dependencies=[Depends(require_read), Depends(_known_frontier), Depends(stream_admitted)])
async def frontier_events(key: str, request: Request, st: StateDep):
    def signature(doc: dict[str, Any]) -> tuple:
        return tuple((p["revision"], p.get("job_state")) for p in doc["points"])

    async for event in document_events(request, st, lambda: _curve(st, key),
                                       lambda doc: (p["problem_key"] for p in doc["points"]), signature, "curve"):
        yield event
