"""/v1/frontiers: request a time-memory frontier, read its curve, follow it, and query it.

POST fixes the budgets inline (peers, the unlimited-memory heuristic, adaptive points probed with the
best heuristic: a second or two) and stores each point as an ordinary cached plan under its own
problem key, with one ordinary refine job per point on the shared queue, so several workers share
one frontier. Revision 1 of each point is already the best of its heuristic, every smaller point's
plan and every peer that fits (monotone from the first answer); workers then offer each finished
point's plan to the larger ones (service.frontier_store.propagate).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pipeplan.planner.bounds import MemoryInfeasibleError
from pipeplan.planner.contract import Limits, Plan, Problem
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from . import inline
from .admission import stream_admitted
from .api import KEY_RE, enqueue, refine_budget, state_of
from .errors import ApiError
from .events import ALL
from .frontier_store import FrontierStore, frontier_key
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


def _problem_from_spec(spec: dict[str, Any], limits: Limits) -> Problem:
    """A spec's problem, converted in-process, sizes checked first (the service's configured limits)."""
    inline.check_spec(spec, limits)
    return inline.problem_from_spec(spec, limits)


def _store(st: ServiceState) -> FrontierStore:
    return FrontierStore(st.repo)


def plan_points(problem: Problem, points: int) -> tuple[dict[str, Any], list[tuple[float, Problem, Plan, float]]]:
    """The setup document and, per point, (factor, problem, revision-1 plan, proven bound there)."""
    from pipeplan.planner.baselines import best_heuristic
    from pipeplan.planner.bounds import lower_bound
    from pipeplan.planner.frontier import choose_factors, peer_points, rekey, scaled, setup, unlimited
    from pipeplan.planner.solver.memory_bound import memory_lower_bound

    free_problem = unlimited(problem)
    peers = peer_points(problem)
    top = best_heuristic(free_problem)
    s = setup(problem, top, lower_bound(free_problem), peers)
    probes: dict[float, Plan] = {}

    def probe(f: float) -> float:
        sub = scaled(problem, s.free, f)
        probes[f] = best_heuristic(sub, problem_key=sub.key())
        return probes[f].makespan_ms

    factors = choose_factors(s, points, probe)
    out: list[tuple[float, Problem, Plan, float]] = []
    for f in factors:
        sub = scaled(problem, s.free, f)
        key = sub.key()
        offers = [probes.get(f)] + [p for _, _, p, _ in out] + [p.plan for p in s.peers if p.factor <= f]
        if f >= s.factor_max:
            offers.append(s.top)
        fits = [r for c in offers if c is not None and (r := rekey(sub, c, key)) is not None]
        best = min(fits, key=lambda p: p.makespan_ms) if fits else best_heuristic(sub, problem_key=key)
        out.append((f, sub, best, max(lower_bound(sub), memory_lower_bound(sub))))
    doc = {"problem_key": problem.key(), "free_mib": s.free, "static_mib": [d.static_mib for d in problem.devices],
           "factor_min": s.factor_min, "factor_max": s.factor_max, "unlimited_makespan_ms": s.top.makespan_ms,
           "peers": [p.to_dict() for p in s.peers], "points": [{"factor": f, "bound_ms": b} for f, _, _, b in out]}
    return doc, out


@router.post("/frontiers", status_code=200, summary="Request a time-memory frontier (one refine job per point)",
             responses={201: {"description": "New frontier: points stored, their jobs queued"},
                        422: {"description": "Invalid input"}},
             dependencies=[Depends(require_write)])
def create_frontier(body: FrontierRequest, request: Request) -> Any:
    from fastapi.responses import JSONResponse

    st = state_of(request)
    s = st.settings
    budget = refine_budget(st, body.time_budget_s)
    try:
        problem = body.problem if body.problem is not None else _problem_from_spec(body.spec, s.limits)
    except MemoryInfeasibleError as exc:
        raise inline.infeasible(exc) from None
    inline.check_problem(problem, s.limits)
    key = frontier_key(problem.key(), body.points)
    store = _store(st)
    created = False
    with st.lock_for(key):
        if not store.exists(key):
            setup_doc, points = plan_points(problem, body.points)
            point_keys = []
            for f, sub, plan, _ in points:
                pkey = sub.key()
                _, new, job = st.repo.store_first(sub, plan, budget, key=pkey)
                if new:
                    st.events.publish_revision(pkey, 1)
                    if job.state == QUEUED:
                        enqueue(st, pkey, job)
                else:
                    store.offer(pkey, plan, sub)  # a cached point still gets its neighbours' plans
                point_keys.append((f, pkey))
            created = store.create(key, problem.key(), setup_doc, point_keys)
    doc = store.curve(key)
    return JSONResponse({"frontier_key": key, "created": created, "frontier": doc, "links": frontier_links(key)},
                        status_code=201 if created else 200)


def _curve(st: ServiceState, key: str) -> dict[str, Any]:
    if not KEY_RE.fullmatch(key):
        raise ApiError(404, "not_found", "frontier keys are 64 lowercase hex characters (SHA-256)")
    doc = _store(st).curve(key)
    if doc is None:
        raise ApiError(404, "not_found", f"no frontier {key}")
    return doc


@router.get("/frontiers/{key}", summary="The curve: each point's best stored plan now (pipeplan.frontier/v1)",
            dependencies=[Depends(require_read)])
def get_frontier(key: str, request: Request) -> Any:
    doc = _curve(state_of(request), key)
    return {"frontier_key": key, **doc, "links": frontier_links(key)}


def _point_answer(key: str, point: dict[str, Any]) -> dict[str, Any]:
    return {"frontier_key": key, "point": point, "plan": f"/v1/plans/{point['problem_key']}"}


@router.get("/frontiers/{key}/least-memory", summary="The least memory per GPU that reaches target_ms",
            dependencies=[Depends(require_read)])
def least_memory(key: str, request: Request, target_ms: float = Query(..., gt=0)) -> Any:
    from pipeplan.planner.frontier import view_of

    view = view_of(_curve(state_of(request), key))
    hit = view.least_memory(target_ms)
    if hit is None:
        best = min(view.points, key=lambda p: p.makespan_ms)
        raise ApiError(404, "not_found", f"target_ms: no point reaches {target_ms:g} ms; the fastest is"
                       f" {best.makespan_ms:.2f} ms at {best.budget_mib / GIB:.2f} GiB per GPU",
                       {"fastest": best.doc})
    return _point_answer(key, hit.doc)


@router.get("/frontiers/{key}/fastest", summary="The fastest plan within budget_gib per GPU",
            dependencies=[Depends(require_read)])
def fastest(key: str, request: Request, budget_gib: float = Query(..., gt=0)) -> Any:
    from pipeplan.planner.frontier import view_of

    view = view_of(_curve(state_of(request), key))
    hit = view.fastest(budget_gib * GIB)
    if hit is None:
        least = min(view.points, key=lambda p: p.budget_mib)
        raise ApiError(404, "not_found", f"budget_gib: {budget_gib:g} GiB per GPU is below the least any schedule"
                       f" needs ({least.budget_mib / GIB:.2f} GiB)", {"least": least.doc})
    return _point_answer(key, hit.doc)


async def _known_frontier(key: str, request: Request) -> str:
    """Dependency: 404 before the stream starts (raised inside the generator it breaks the response)."""
    await run_in_threadpool(_curve, state_of(request), key)
    return key


@router.get("/frontiers/{key}/events", response_class=EventSourceResponse,
            summary="Server-sent events: one `curve` event (the whole document) whenever a point improves",
            dependencies=[Depends(require_read), Depends(_known_frontier), Depends(stream_admitted)])
async def frontier_events(key: str, request: Request):
    st = state_of(request)
    doc = await run_in_threadpool(_curve, st, key)
    keys = {p["problem_key"] for p in doc["points"]}

    def signature(d: dict[str, Any]) -> tuple:
        return tuple((p["revision"], p.get("job_state")) for p in d["points"])

    with st.events.subscribe(ALL) as sub:
        sent = signature(doc)
        yield ServerSentEvent(raw_data=json.dumps(doc), event="curve")
        while True:
            message = await sub.get(timeout=st.settings.sse_poll_s)
            if message is not None and message.get("key") not in keys:
                if await request.is_disconnected():
                    return
                continue
            await asyncio.sleep(0.05)  # coalesce a burst (a worker propagating to several points)
            doc = await run_in_threadpool(_curve, st, key)
            if signature(doc) != sent:
                sent = signature(doc)
                yield ServerSentEvent(raw_data=json.dumps(doc), event="curve")
            if await request.is_disconnected():
                return
