"""/v1/plans/{key}/traces: post what a plan really did, get a plan calibrated to it (docs/trace.md).

The calibration loop: a training job posts a `pipeplan.trace/v1` document of one iteration of the
key's plan; the service checks it against the stored revision that ran (`planner.trace.check_trace`),
stores it, derives the calibrated problem from it and the key's recent traces
(`planner.fidelity.calibrated_problem`: measured durations, its own key, `metadata.calibrated_from`
naming this key) and submits that problem exactly as POST /v1/plans does (first plan now, refine job
queued), so the job's `OnlinePlan` can switch to it and follow its improvements.
"""

from __future__ import annotations

import hashlib
import logging

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.trace import Trace
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from . import api
from .admission import rate_limited
from .deps import StateDep
from .errors import MAX_REVISION, ApiError
from .security import require_read, require_write
from .state import ServiceState
from .trace_store import TraceInfo, TraceStore

log = logging.getLogger("pipeplan.api")
router = APIRouter(prefix="/v1", tags=["traces"])

# The calibrated problem takes the median of every op over this many newest traces of the key:
# enough iterations to outvote one disturbed run, few enough to follow hardware that changed.
CALIBRATION_TRACES = 16


class TraceView(BaseModel):
    """A stored trace: the revision that ran, predicted vs measured, and the calibrated key it yielded."""

    id: int
    problem_key: str
    revision: int = Field(description="The plan revision that ran.")
    iteration: int
    device_kind: str
    predicted_ms: float = Field(description="That revision's makespan (the prediction).")
    measured_ms: float = Field(description="The trace's measured makespan.")
    error_pct: float = Field(description="100 * (measured - predicted) / predicted.")
    calibrated_key: str | None = Field(description="The calibrated problem derived from this trace.")
    created_at: str | None
    links: dict[str, str]


class CalibratedView(BaseModel):
    """The calibrated problem's plan as the POST left it (its refine job goes on in a worker)."""

    problem_key: str
    revision: int
    makespan_ms: float = Field(description="Its best plan's makespan, predicted under the measured costs.")
    retimed_ms: float = Field(description="The plan that ran, timed under the measured costs (should be close to"
                              " measured_ms: how well the calibrated costs explain the run).")
    cached: bool = Field(description="True when this calibrated problem was already cached.")
    job: api.JobView | None
    links: dict[str, str]


class TracePosted(BaseModel):
    created: bool = Field(description="False when this very trace was posted before (stored once).")
    trace: TraceView
    calibrated: CalibratedView
    links: dict[str, str]


class TraceList(BaseModel):
    problem_key: str
    traces: list[TraceView]


def trace_links(key: str, trace_id: int, calibrated_key: str | None) -> dict[str, str]:
    out = {"self": f"/v1/plans/{key}/traces/{trace_id}", "plan": f"/v1/plans/{key}"}
    if calibrated_key:
        out.update({"calibrated": f"/v1/plans/{calibrated_key}",
                    "calibrated_problem": f"/v1/plans/{calibrated_key}/problem",
                    "calibrated_dashboard": f"/dashboard/plans/{calibrated_key}"})
    return out


def _view(info: TraceInfo) -> TraceView:
    d = info.to_dict()
    return TraceView(**d, links=trace_links(info.problem_key, info.id, info.calibrated_key))


def _invalid(lines: list[str]) -> ApiError:
    return ApiError(422, "invalid_request", "; ".join(lines), {"detail": lines})


def _prepare(st: ServiceState, key: str, trace: Trace,
             digest: str) -> tuple[Plan, Problem, TraceInfo | None]:
    """(the plan that ran, the calibrated problem, the stored trace when this trace was posted before:
    then the calibrated problem is the one it yielded then)."""
    from pipeplan.planner.fidelity import calibrated_problem
    from pipeplan.planner.trace import check_trace

    problem = st.repo.get_problem(key)
    if problem is None:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    if trace.problem_key != key:
        raise _invalid([f"problem_key: the trace is of {trace.problem_key[:16]}…, posted to {key[:16]}…"])
    plan_json = st.repo.revision_plan(key, trace.revision) if trace.revision <= MAX_REVISION else None
    if plan_json is None:
        raise _invalid([f"revision: key {key[:16]}… has no revision {trace.revision}"])
    plan = Plan.model_validate_json(plan_json)
    errors = check_trace(problem, plan, trace)
    if errors:  # "ops missing: …" and the like are about the devices' op lists: name the field
        raise _invalid([e if ":" in e.split(" ")[0] else f"devices.ops: {e}" for e in errors])
    store = TraceStore(st.repo)
    known = store.by_digest(key, digest)
    if known is not None:
        before = st.repo.get_problem(known.calibrated_key) if known.calibrated_key else None
        if before is None:
            raise ApiError(404, "not_found", f"the calibrated plan of this trace of {key[:16]}… is gone")
        return plan, before, known
    earlier = []
    for doc in store.documents(key, CALIBRATION_TRACES - 1):
        try:
            earlier.append(Trace.model_validate_json(doc))
        except ValueError:  # stored by a version that did not read documents back before storing
            log.warning("skipping an unreadable stored trace of %s", key[:12])
    calibrated = calibrated_problem(problem, [trace, *earlier])
    try:
        calibrated.check_limits(st.settings.limits)
    except ValueError as exc:
        raise ApiError(422, "too_large", f"calibrated problem.{exc}") from None
    return plan, calibrated, None


@router.post("/plans/{key}/traces", response_model=TracePosted, status_code=200,
             summary="Post a measured iteration (pipeplan.trace/v1); get the plan calibrated to it",
             description="The trace must be of a stored revision of this key (every planned op once, on its"
             " device). The calibrated problem (measured durations, its own key, `metadata.calibrated_from`"
             " naming this key) is submitted like POST /v1/plans: its first plan now, a refine job queued."
             " Posting the same trace again stores nothing new and answers 200.",
             responses={201: {"description": "Trace stored; calibrated problem planned"}},
             dependencies=[Depends(require_write), Depends(rate_limited)])
async def post_trace(key: str, trace: Trace, request: Request, st: StateDep,
                     time_budget_s: float | None = Query(None, gt=0, description="Refine budget of the calibrated"
                                                         " problem (default from settings).")) -> Response:
    api.check_key(key)
    budget = api.refine_budget(st, time_budget_s)
    trace_json = trace.model_dump_json()
    digest = hashlib.sha256(trace_json.encode()).hexdigest()
    plan, calibrated, info = await run_in_threadpool(_prepare, st, key, trace, digest)
    created = info is None  # else posted before: answer with what it yielded then
    submitted = await api.submit(api.PlanRequest(problem=calibrated, time_budget_s=budget), request, st)
    if submitted.status_code not in (200, 201):
        return submitted  # the client left while the calibrated problem's first plan was computed
    envelope = api.PlanEnvelope.model_validate_json(submitted.body)
    if created:
        store = TraceStore(st.repo)
        info, created = await run_in_threadpool(
            lambda: store.add(key, trace.revision, digest, trace_json, iteration=trace.iteration,
                              device_kind=trace.device_kind, predicted_ms=plan.makespan_ms,
                              measured_ms=trace.makespan_ms, calibrated_key=envelope.problem_key))
    retimed = await run_in_threadpool(_retimed, calibrated, plan)
    ck = envelope.problem_key
    body = TracePosted(
        created=created, trace=_view(info),
        calibrated=CalibratedView(problem_key=ck, revision=envelope.revision,
                                  makespan_ms=envelope.plan["makespan_ms"], retimed_ms=retimed,
                                  cached=envelope.cached, job=envelope.job, links=api.links(ck)),
        links={"traces": f"/v1/plans/{key}/traces", **trace_links(key, info.id, ck)})
    if created:
        log.info("trace of %s r%d: predicted %.2f ms, measured %.2f ms (%+.1f%%) -> calibrated %s",
                 key[:12], trace.revision, plan.makespan_ms, trace.makespan_ms, info.error_pct, ck[:12])
    return JSONResponse(body.model_dump(mode="json"), status_code=201 if created else 200)


def _retimed(calibrated: Problem, plan: Plan) -> float:
    from pipeplan.planner.fidelity import retime

    return retime(calibrated, plan.model_copy(update={"problem_key": calibrated.key()}))


@router.get("/plans/{key}/traces", response_model=TraceList,
            summary="The key's measured runs, newest first: predicted vs measured and the calibrated key",
            dependencies=[Depends(require_read)])
def list_traces(key: str, st: StateDep, limit: int = Query(100, ge=1, le=1000)) -> TraceList:
    api.check_key(key)
    if st.repo.best_revision(key) is None:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    return TraceList(problem_key=key, traces=[_view(i) for i in TraceStore(st.repo).listing(key, limit)])


@router.get("/plans/{key}/traces/{trace_id}", summary="One stored trace document (pipeplan.trace/v1)",
            responses={200: {"content": {"application/json": {}}, "description": "pipeplan.trace/v1"}},
            dependencies=[Depends(require_read)])
def get_trace(key: str, st: StateDep, trace_id: int = Path(ge=1, le=2**31 - 1)) -> Response:
    api.check_key(key)
    doc = TraceStore(st.repo).document(key, trace_id)
    if doc is None:
        raise ApiError(404, "not_found", f"no trace {trace_id} of key {key}")
    return Response(doc, media_type="application/json")


__all__ = ["router", "CALIBRATION_TRACES"]
