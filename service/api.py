"""The versioned JSON API (/v1): submit, fetch, follow, refine, cancel, list, export.

Blocking work (SQL, the inline heuristic) runs in plain `def` endpoints or the thread pool; the hot
GET path serves the stored plan bytes as they are, with an ETag per revision.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pipeplan.planner.bounds import MemoryInfeasibleError
from pipeplan.planner.contract import Problem
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from . import exports_cache, inline
from .admission import check_queue_share, rate_limited, stream_admitted
from .deps import StateDep
from .errors import MAX_OFFSET, MAX_REVISION, ApiError, NothingToStream, reject_nul
from .events import job_message
from .flight import single_flight
from .models import ACTIVE_STATES, CANCELLED, JOB_STATES, QUEUED
from .outcomes import OUTCOMES
from .repository import BestPlan, JobInfo
from .security import require_read, require_write
from .state import ServiceState

log = logging.getLogger("pipeplan.api")

KEY_RE = re.compile(r"^[0-9a-f]{64}$")

router = APIRouter(prefix="/v1", tags=["plans"])


# -- request / response models (they make the OpenAPI document readable) ------------------------------
class PlanRequest(BaseModel):
    """Exactly one of `problem` (problem v1) or `spec` (model + hardware description)."""

    model_config = ConfigDict(extra="forbid")

    problem: Problem | None = Field(None, description="A pipeplan.problem/v1 document.")
    spec: dict[str, Any] | None = Field(
        None, description='A model spec for the cost model; "partition": "auto" picks the stage split.')
    time_budget_s: float | None = Field(None, gt=0, strict=True,  # strict: `true` is not a budget of 1 s
                                        description="Refine budget (default from settings).")

    @model_validator(mode="after")
    def _one_of(self) -> PlanRequest:
        if (self.problem is None) == (self.spec is None):
            raise ValueError("give exactly one of problem or spec")
        return self


class RefineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    time_budget_s: float | None = Field(None, gt=0, strict=True)  # strict: `true` is not 1 s


JobState = Literal[JOB_STATES]  # type: ignore[valid-type]
Outcome = Literal[OUTCOMES]  # type: ignore[valid-type]


class JobView(BaseModel):
    """The key's refine job. `state` says where the run is; once it is over, `outcome` says how it
    ended, with the best plan's gap: a spent budget is never reported as optimal."""

    state: JobState = Field(description="queued, solving, done (ended on its own: see outcome), failed or"
                            " cancelled.")
    outcome: Outcome | None = Field(
        None, description="How the last run ended: optimal (proven: the makespan meets a proven bound),"
        " budget (the time budget ran out with a gap), stalled (the search gave up before the budget without"
        " proof), stopped (cancelled). Null while queued or solving, after a failure, or for runs finished"
        " before outcomes were recorded.")
    gap_pct: float | None = Field(None, description="Gap of the best plan to the proven lower bound, in percent,"
                                  " when the run ended.")
    searched_s: float | None = Field(None, description="Seconds the solver searched for this job (all attempts).")
    run_improvements: int | None = Field(None, description="Better revisions the last run stored.")
    outcome_text: str | None = Field(None, description='The outcome in words, as the CLI and dashboard print'
                                     ' it, e.g. "budget spent after 30 s, gap 4.1% to the proven bound".')
    budget_s: float
    used_s: float
    attempts: int
    runs: int
    improvements: int = Field(description="Better revisions stored by every run of this job.")
    cancel_requested: bool
    error: str | None = None
    queued_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None


class PlanEnvelope(BaseModel):
    problem_key: str
    revision: int
    cached: bool = Field(description="True when the plan came from the cache (no new computation).")
    plan: dict[str, Any] = Field(description="The best stored pipeplan.plan/v1 document.")
    job: JobView | None
    links: dict[str, str]


class JobEnvelope(BaseModel):
    problem_key: str
    queued: bool = Field(description="True when this call queued a new run.")
    job: JobView | None
    links: dict[str, str]


class RevisionInfo(BaseModel):
    revision: int
    makespan_ms: float
    lower_bound_ms: float
    solver_bound_ms: float | None = None
    status: str
    method: str = Field(description='Where the plan came from: a schedule ("zb-h1"), the solver, or "reuse of'
                        ' <key> rev <N> (<how>): <its method>" for a neighbour\'s plan (docs/reuse.md).')
    created_at: str | None
    neighbour_key: str | None = Field(None, description="A reused revision: the key of the neighbour whose plan"
                                      " it grew from.")
    neighbour_revision: int | None = Field(None, description="...and that plan's revision.")


class RevisionList(BaseModel):
    problem_key: str
    revisions: list[RevisionInfo]


class PlanSummary(BaseModel):
    problem_key: str
    model: str | None
    num_devices: int
    num_microbatches: int
    num_stages: int
    stages_per_device: int
    memory_limit_mib: float | None
    revision: int
    makespan_ms: float
    lower_bound_ms: float = Field(description="The best proven lower bound: the best plan's, or the tighter one a"
                                  " refine run proved without finding a shorter plan.")
    gap: float = Field(description="(makespan - lower_bound_ms) / makespan: the key's one gap (a fraction).")
    bubble_ratio: float
    status: str
    method: str
    first_makespan_ms: float
    speedup_over_first: float | None
    job_state: JobState | None
    job_outcome: Outcome | None = Field(None, description="How the last refine run ended (see JobView).")
    job_outcome_text: str | None = Field(None, description="That outcome in words, with the gap.")
    created_at: str | None
    updated_at: str | None


class PlanPage(BaseModel):
    items: list[PlanSummary]
    total: int
    offset: int
    limit: int


def links(key: str) -> dict[str, str]:
    base = f"/v1/plans/{key}"
    return {"self": base, "events": f"{base}/events", "revisions": f"{base}/revisions",
            "refine": f"{base}/refine", "cancel": f"{base}/cancel", "job": f"{base}/job",
            "problem": f"{base}/problem", "torch_csv": f"{base}/export/torch.csv",
            "chrome_trace": f"{base}/export/chrome-trace.json", "runtimes": f"{base}/export/runtimes.json",
            "torchtitan_args": f"{base}/export/torchtitan.args",
            "megatron_args": f"{base}/export/megatron.args"}


def job_view(job: JobInfo | None) -> JobView | None:
    if job is None:
        return None
    d = job.to_dict()
    return JobView(**{k: d[k] for k in JobView.model_fields})


def check_key(key: str) -> str:
    if not KEY_RE.match(key):
        raise ApiError(404, "not_found", "problem keys are 64 lowercase hex characters (SHA-256)")
    return key


def refine_budget(st: ServiceState, requested: float | None) -> float:
    """A refine job's budget: the request's, else the default; 422 beyond the limit."""
    s = st.settings
    budget = requested if requested is not None else s.default_time_budget_s
    if budget > s.max_time_budget_s:
        raise ApiError(422, "invalid_request",
                       f"time_budget_s: {budget} exceeds the limit {s.max_time_budget_s}")
    return budget


def enqueue(st: ServiceState, key: str, job: JobInfo) -> None:
    """Put the key's queued run on the queue; when that fails (Redis down) the reconciler enqueues it
    later from SQL. A run whose owner has no other run queued or solving goes to the front: one
    client's backlog never delays another client's next run (fair queuing, with the per-client cap
    of admission.check_queue_share)."""
    try:
        alone = job.owner is not None and st.repo.queued_work(job.owner)[0] <= 1
        st.queue.enqueue(key, job.run_id, job.budget_s, at_front=alone)
    except Exception as exc:
        log.warning("enqueue of %s failed (%s); the reconciler will retry", key[:12], exc)


# -- POST /v1/plans ---------------------------------------------------------------------------------
# Every size is checked before any expensive step; the first plan is computed in the thread pool
# only for small problems (bounded by size), else in a killable child process (service.inline).
def _submit_job(body: PlanRequest, st: ServiceState, budget: float, owner: str) -> dict[str, Any]:
    s = st.settings
    job: dict[str, Any] = {"limits": s.limits.model_dump(), "database_url": s.resolved_database_url,
                           "budget_s": budget, "owner": owner, "greedy_s": s.inline_greedy_s,
                           "greedy_max_s": s.inline_greedy_max_s, "reuse_s": s.inline_reuse_s}
    if body.spec is not None:
        job["spec"] = body.spec
    else:
        job["problem"] = body.problem.model_dump_json()
    return job


@router.post("/plans", response_model=PlanEnvelope, status_code=200,
             summary="Submit a problem or model spec; get the best plan now",
             responses={201: {"model": PlanEnvelope, "description": "Cache miss: first plan computed and stored"},
                        422: {"description": "Invalid input or infeasible memory budget"}},
             dependencies=[Depends(require_write), Depends(rate_limited)])
async def submit(body: PlanRequest, request: Request, st: StateDep) -> Response:
    s = st.settings
    budget = refine_budget(st, body.time_budget_s)
    key: str | None = None
    memo = None
    if body.spec is not None:
        inline.check_spec(body.spec, s.limits)  # microseconds, before anything is built
        memo = inline.spec_memo(body.spec)
        key = st.spec_keys.get(memo)
    else:
        inline.check_problem(body.problem, s.limits)
        key = body.problem.key()
    if key is not None:
        best = await st.best(key, fresh=True)
        if best is not None:
            return await run_in_threadpool(_envelope, st, key, best, True)
    owner = await run_in_threadpool(check_queue_share, request, budget)  # before any work is done
    async with st.admission.heavy_slot():
        if body.problem is not None and inline.ops_of(body.problem) <= s.inline_thread_max_ops:
            key, created, reused = await run_in_threadpool(_first_in_thread, st, body.problem, key, budget, owner)
        else:
            try:
                result = await inline.run_in_child(_submit_job(body, st, budget, owner), s.inline_timeout_s,
                                                   request.is_disconnected, s.retry_after_s)
            except inline.Gone:
                return Response(status_code=499)  # nobody is listening; the work was stopped
            key, created, reused = result["key"], result["created"], result.get("reused", False)
    if memo is not None:
        if len(st.spec_keys) >= 4096:
            st.spec_keys.clear()
        st.spec_keys[memo] = key
    return await run_in_threadpool(_after_first, st, key, created, reused)


def _first_in_thread(st: ServiceState, problem: Problem, key: str, budget: float,
                     owner: str) -> tuple[str, bool, bool]:
    """A small problem's revision 1 (milliseconds, a reuse of its neighbours' plans within
    inline_reuse_s); callers in this process wait for one computation."""
    s = st.settings
    with st.lock_for(key):
        if st.repo.best_revision(key) is not None:
            return key, False, False
        try:
            created, reused = inline.store_revision_one(st.repo, problem, key, budget, owner, s.inline_greedy_s,
                                                        s.inline_greedy_max_s, s.inline_reuse_s)
        except MemoryInfeasibleError as exc:
            raise inline.infeasible(exc) from None
        return key, created, reused


def _after_first(st: ServiceState, key: str, created: bool, reused: bool = False) -> Response:
    """Publish and enqueue a new key's refine job (hinted, like every run, with the best stored plan:
    a reused revision 1 when it was faster); the envelope of its best plan (201 if new)."""
    job = st.repo.job(key)
    if created:
        st.metrics.cold_posts.inc()
        if reused:
            st.metrics.reused_first_plans.inc()
        st.events.publish_revision(key, 1)
        if job is not None and job.state == QUEUED:
            enqueue(st, key, job)
    best = st.repo.best(key)
    return _envelope(st, key, best, cached=not created, job=job, status_code=201 if created else 200)


def _envelope(st: ServiceState, key: str, best: BestPlan, cached: bool, job: JobInfo | None = None,
              status_code: int = 200) -> Response:
    """A PlanEnvelope with the stored plan JSON spliced in as stored: parsing and re-serializing a
    plan costs seconds at the largest sizes (27 MB) and cannot change it."""
    job = job or st.repo.job(key)
    view = job_view(job)
    body = "".join((
        '{"problem_key":', json.dumps(key), ',"revision":', str(best.revision),
        ',"cached":', json.dumps(cached), ',"plan":', best.plan_json,
        ',"job":', view.model_dump_json() if view is not None else "null",
        ',"links":', json.dumps(links(key)), "}"))
    return Response(body, status_code=status_code, media_type="application/json")


# -- GET /v1/plans/{key} ----------------------------------------------------------------------------
def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    if header.strip() == "*":
        return True
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return etag in tags


def _plan_response(best: BestPlan, if_none_match: str | None) -> Response:
    headers = {"ETag": best.etag, "Cache-Control": "no-cache", "X-Pipeplan-Revision": str(best.revision)}
    if _etag_matches(if_none_match, best.etag):
        return Response(status_code=304, headers=headers)
    return Response(best.plan_json, media_type="application/json", headers=headers)


@router.get("/plans/{key}", summary="The best plan (plan v1), with ETag and long-poll",
            responses={200: {"content": {"application/json": {}}, "description": "pipeplan.plan/v1"},
                       304: {"description": "Not modified (If-None-Match)"}, 404: {"description": "Unknown key"}},
            dependencies=[Depends(require_read)])
async def get_plan(
    key: str, st: StateDep,
    min_revision: int | None = Query(None, ge=1, le=MAX_REVISION, description="Wait until this revision exists..."),
    wait: float = Query(0.0, ge=0, description="...for at most this many seconds (capped by settings)."),
    if_none_match: str | None = Header(None),
) -> Response:
    check_key(key)
    best = await st.best(key)
    if best is None:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    if min_revision and best.revision < min_revision and wait > 0:
        deadline = time.monotonic() + min(wait, st.settings.long_poll_max_s)
        with st.admission.stream_slot(), st.events.subscribe(key) as sub:
            best = await st.best(key, fresh=True)
            while best.revision < min_revision:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await sub.get(timeout=min(left, st.settings.sse_poll_s))
                best = await st.best(key, fresh=True)
    return _plan_response(best, if_none_match)


@router.get("/plans/{key}/revisions/{revision}", summary="One stored revision (plan v1)",
            dependencies=[Depends(require_read)])
def get_revision(key: str, st: StateDep,
                 revision: int = Path(ge=1, le=MAX_REVISION, description="Revision number")) -> Response:
    check_key(key)
    plan = st.repo.revision_plan(key, revision)
    if plan is None:
        raise ApiError(404, "not_found", f"no revision {revision} for key {key}")
    return Response(plan, media_type="application/json")


@router.get("/plans/{key}/problem", summary="The normalized problem (problem v1) of a key",
            dependencies=[Depends(require_read)])
def get_problem(key: str, st: StateDep) -> Response:
    check_key(key)
    problem = st.repo.get_problem(key)
    if problem is None:
        raise ApiError(404, "not_found", f"no problem stored for key {key}")
    return Response(problem.model_dump_json(), media_type="application/json")


# -- SSE ------------------------------------------------------------------------------------------
async def known_key(key: str, st: StateDep) -> str:
    """Dependency: 404 before a stream starts (an error inside the generator would be too late)."""
    check_key(key)
    if await st.best(key) is None:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    return key


REVISION_ID = re.compile(r"^[0-9]{1,10}$")  # ASCII digits only (str.isdigit() also takes "²" and "٣")


def resume_after(last_event_id: str = Header(  # "" is no header (a str, not nullable: a header cannot be null)
                     "", description="Resume after this revision (the id of an earlier `revision` event).",
                     json_schema_extra={"pattern": "^[0-9]{0,10}$"}),
                 after: int | None = Query(None, ge=0, le=MAX_REVISION,
                                           description="Resume after this revision (as Last-Event-ID).")) -> int | None:
    """Where a stream resumes. A malformed Last-Event-ID is a 422 naming the header, as any invalid
    parameter, before the stream starts; it used to pass `isdigit()` and cut the stream after its 200."""
    text = last_event_id.strip(" \t")
    if not text:
        return after
    if not REVISION_ID.fullmatch(text):
        line = "Last-Event-ID: must be a revision number (at most 10 ASCII digits), as the stream's event ids are"
        raise ApiError(422, "invalid_request", line, {"detail": [line]})
    return min(int(text), MAX_REVISION)


async def _job(st: ServiceState, key: str) -> tuple[bool, JobInfo | None]:
    """(whether the key's job is queued or solving, the job); a key without a job has nothing running."""
    job = await run_in_threadpool(st.repo.job, key)
    return job is not None and job.state in ACTIVE_STATES, job


async def stream_start(key: str, st: StateDep, after: int | None = Depends(resume_after),
                       follow: bool = False) -> int | None:
    """Dependency: the resume point, or 204 when there is nothing left to send (see NothingToStream)."""
    if after is not None and not follow:
        best = await st.best(key)
        if best is not None and after >= best.revision and not (await _job(st, key))[0]:
            raise NothingToStream()
    return after


@router.get("/plans/{key}/events", response_class=EventSourceResponse,
            summary="Server-sent events: one `revision` event per new revision (id = revision), `end` when the job is over",
            description="Resume with `Last-Event-ID: N` (or `?after=N`): revisions after N are replayed"
            " first. Without either, the stream starts with the current best revision. Event data is the"
            " plan v1 document; brief mode (`?summary=true`) sends key, revision, makespan, bound, status and"
            " method with `plan`, the URL of that revision's plan, instead. `job` events (no id) report refine"
            " job state changes: `{\"state\"}`, and when a run ends also `outcome`, `gap_pct`, `searched_s`,"
            " `run_improvements` and `outcome_text` (see the job object). Once the job is over and every revision"
            " is sent, an `end` event (the job's state and outcome, the best revision and its URL) closes the"
            " stream; a resume that has every revision of a finished job gets 204 (an EventSource stops"
            " reconnecting). `?follow=true` keeps the stream open for later refine runs instead.",
            responses={204: {"description": "The job is over and the client has every revision"}},
            dependencies=[Depends(require_read), Depends(known_key), Depends(stream_admitted)])
async def events(key: str, request: Request, st: StateDep, summary: bool = False, follow: bool = False,
                 start_after: int | None = Depends(stream_start)):
    def full(revision: int, plan_json: str) -> ServerSentEvent:
        return ServerSentEvent(raw_data=plan_json, event="revision", id=str(revision))

    def brief(doc: dict[str, Any]) -> ServerSentEvent:
        doc = {"problem_key": key, **{k: doc[k] for k in ("revision", "makespan_ms", "lower_bound_ms", "status",
                                                          "method")},
               "plan": f"/v1/plans/{key}/revisions/{doc['revision']}"}
        return ServerSentEvent(raw_data=json.dumps(doc), event="revision", id=str(doc["revision"]))

    def end(job: JobInfo | None, revision: int) -> ServerSentEvent:
        view = job_view(job)
        said = {f: getattr(view, f) if view else None for f in ("state", "outcome", "outcome_text", "gap_pct")}
        return ServerSentEvent(event="end", data={"problem_key": key, "revision": revision, **said,
                                                  "plan": f"/v1/plans/{key}"})

    async def catch_up(sent: int):
        """Revisions after `sent`: the shared best-plan cache when only the next one is new (the common
        case, one query for all subscribers), else SQL in pages."""
        best = await st.best(key)
        if best.revision <= sent:
            return
        if best.revision == sent + 1:
            yield best.revision, (best.summary() if summary else best.plan_json)
            return
        while True:
            if summary:
                batch = [(r["revision"], r) for r in await run_in_threadpool(st.repo.revisions, key, sent)]
            else:
                batch = await run_in_threadpool(st.repo.revision_plans, key, sent)
            for revision, body in batch:
                if revision > sent:
                    sent = revision
                    yield revision, body
            if summary or len(batch) < 100:
                return

    with st.events.subscribe(key) as sub:  # subscribe first: nothing missed; the slot: stream_admitted
        if start_after is None:
            best = await st.best(key, fresh=True)
            sent = best.revision
            yield brief(best.summary()) if summary else full(best.revision, best.plan_json)
        else:
            sent = start_after
        check_job = not follow  # at the start, after a job event, and when quiet (events may be lost)
        over, job = False, None
        while True:
            async for revision, body in catch_up(sent):
                sent = revision
                yield brief(body) if summary else full(revision, body)
            if over:
                yield end(job, sent)
                return
            if check_job:
                running, job = await _job(st, key)
                if not running:  # one more catch-up: a last revision stored just before the job ended
                    over = True
                    await st.best(key, fresh=True)
                    continue
            message = await sub.get(timeout=st.settings.sse_poll_s)
            if message is None:  # quiet: re-read SQL in case a pub/sub message was lost
                await st.best(key, fresh=True)
            check_job = not follow and (message is None or message.get("type") == "job")
            while message is not None and message.get("type") == "job":
                yield ServerSentEvent(data={k: v for k, v in message.items() if k not in ("type", "key")},
                                      event="job")
                message = sub.queue.get_nowait() if not sub.queue.empty() else None
            if await request.is_disconnected():
                return


# -- revisions / refine / cancel / job --------------------------------------------------------------
@router.get("/plans/{key}/revisions", response_model=RevisionList, summary="Revision history (no bodies)",
            dependencies=[Depends(require_read)])
def revisions(key: str, st: StateDep) -> RevisionList:
    check_key(key)
    revs = st.repo.revisions(key)
    if not revs:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    return RevisionList(problem_key=key, revisions=[RevisionInfo(**r) for r in revs])


@router.post("/plans/{key}/refine", response_model=JobEnvelope, status_code=202,
             summary="Refine further, warm-started from the best stored plan",
             dependencies=[Depends(require_write)])
def refine(key: str, request: Request, st: StateDep, body: RefineRequest | None = None) -> JobEnvelope:
    check_key(key)
    budget = refine_budget(st, body.time_budget_s if body else None)
    if st.repo.best_revision(key) is None:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    job = st.repo.job(key)
    if job is not None and job.state in ACTIVE_STATES:  # one run per key: nothing new is queued
        return JobEnvelope(problem_key=key, queued=False, job=job_view(job), links=links(key))
    job, queued = st.repo.request_refine(key, budget, owner=check_queue_share(request, budget))
    if queued and job is not None:
        enqueue(st, key, job)
        st.events.publish(key, job_message(key, QUEUED))
    return JobEnvelope(problem_key=key, queued=queued, job=job_view(job), links=links(key))


@router.post("/plans/{key}/cancel", response_model=JobEnvelope, status_code=202,
             summary="Cancel the refine job (a solving run stops within a second or two)",
             dependencies=[Depends(require_write)])
def cancel(key: str, st: StateDep) -> JobEnvelope:
    check_key(key)
    job = st.repo.request_cancel(key)
    if job is None:
        raise ApiError(404, "not_found", f"no job for key {key}")
    if job.state == CANCELLED:
        st.events.publish(key, job_message(key, CANCELLED))
    return JobEnvelope(problem_key=key, queued=False, job=job_view(job), links=links(key))


@router.get("/plans/{key}/job", response_model=JobView, summary="Refine job state",
            dependencies=[Depends(require_read)])
def job(key: str, st: StateDep) -> JobView:
    check_key(key)
    info = st.repo.job(key)
    if info is None:
        raise ApiError(404, "not_found", f"no job for key {key}")
    return job_view(info)


# -- listing ------------------------------------------------------------------------------------------
@router.get("/plans", response_model=PlanPage, summary="Paginated cache listing with summary fields",
            dependencies=[Depends(require_read)])
def list_plans(
    st: StateDep,
    offset: int = Query(0, ge=0, le=MAX_OFFSET), limit: int = Query(50, ge=1, le=500),
    sort: Literal["updated_at", "created_at", "makespan_ms", "num_devices", "num_microbatches", "revision",
                  "bubble_ratio", "gap", "speedup"] = "updated_at",
    order: Literal["asc", "desc"] = "desc",
    q: str | None = Query(None, max_length=100, description="Key prefix or model name substring"),
    job_state: JobState | None = None,
) -> PlanPage:
    reject_nul("q", q)
    items, total = st.repo.list_plans(offset, limit, sort, order == "desc", q, job_state)
    return PlanPage(items=[PlanSummary(**i) for i in items], total=total, offset=offset, limit=limit)


# -- exports ------------------------------------------------------------------------------------------
# Built once per revision in a child process and kept gzipped on disk (service.exports_cache).
_building: dict[str, asyncio.Future] = {}  # cache path -> the build in flight (single flight per file)


async def _export(st: ServiceState, key: str, revision: int | None, kind: str, if_none_match: str | None,
                  accept_encoding: str | None) -> Response:
    check_key(key)
    best = await st.best(key)
    if best is None:
        raise ApiError(404, "not_found", f"no plan cached for key {key}")
    revision = revision or best.revision
    media_type, suffix = exports_cache.KINDS[kind]
    etag = exports_cache.etag_of(key, revision, kind)
    headers = {"ETag": etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding",
               "X-Pipeplan-Revision": str(revision),
               "Content-Disposition": f'attachment; filename="{key[:12]}-r{revision}{suffix}"'}
    path = exports_cache.cache_path(st.settings.resolved_export_cache_dir, key, revision, kind)
    if revision <= best.revision and _etag_matches(if_none_match, etag.removeprefix("W/")):  # weak compare
        return Response(status_code=304, headers=headers)
    if path.exists():
        st.metrics.export_cache.labels(kind, "hit").inc()
    else:
        await _build_export(st, key, revision, kind, path)
    if "gzip" in (accept_encoding or "").lower():
        return FileResponse(path, media_type=media_type, headers={**headers, "Content-Encoding": "gzip"})
    return StreamingResponse(exports_cache.gunzip_chunks(path), media_type=media_type, headers=headers)


async def _build_export(st: ServiceState, key: str, revision: int, kind: str, path) -> None:
    """One build per file at a time in this process, in a time-boxed child holding a heavy slot. A
    finished export serves every later client, so a build goes on when its client leaves."""
    async def build() -> None:
        async with st.admission.heavy_slot():
            job = {"key": key, "revision": revision, "kind": kind, "path": str(path),
                   "database_url": st.settings.resolved_database_url}
            await inline.run_in_child(job, st.settings.inline_timeout_s, None, st.settings.retry_after_s,
                                      entry=exports_cache.build, what=f"the {kind} export")
        st.metrics.export_cache.labels(kind, "build").inc()

    await single_flight(_building, str(path), build)


_EXPORT_RESPONSES = {304: {"description": "Not modified (If-None-Match)"},
                     404: {"description": "Unknown key or revision"}}


_REFUSABLE_RESPONSES = {**_EXPORT_RESPONSES,
                        409: {"description": "The plan cannot be expressed in that format; the message says why"}}
_CACHED = ("Built once per revision and cached; ETag per revision (If-None-Match: 304), gzip with"
           " `Accept-Encoding: gzip`.")


@router.get("/plans/{key}/export/torch.csv", summary="torch.distributed.pipelining schedule CSV",
            description="The CSV torch's stock `_PipelineScheduleRuntime` (and torchtitan) runs: microbatches"
            " renumbered so the last stage's forwards run in order, compute order only; 409 when the plan"
            " needs offload or recompute to fit (runtimes.json says who runs it). " + _CACHED,
            response_class=Response, responses=_REFUSABLE_RESPONSES, dependencies=[Depends(require_read)])
async def export_torch_csv(key: str, st: StateDep,
                           revision: int | None = Query(None, ge=1, le=MAX_REVISION),
                           if_none_match: str | None = Header(None),
                           accept_encoding: str | None = Header(None)) -> Response:
    return await _export(st, key, revision, "torch.csv", if_none_match, accept_encoding)


@router.get("/plans/{key}/export/chrome-trace.json", summary="Chrome / Perfetto trace of the plan",
            description=_CACHED,
            responses=_EXPORT_RESPONSES, dependencies=[Depends(require_read)])
async def export_chrome_trace(key: str, st: StateDep,
                              revision: int | None = Query(None, ge=1, le=MAX_REVISION),
                              if_none_match: str | None = Header(None),
                              accept_encoding: str | None = Header(None)) -> Response:
    return await _export(st, key, revision, "chrome-trace.json", if_none_match, accept_encoding)


def _text_export(kind: str, summary: str, description: str, refusable: bool = True) -> None:
    """A GET route for one more export kind (same caching, ETag and gzip as above)."""
    async def export(key: str, st: StateDep, revision: int | None = Query(None, ge=1, le=MAX_REVISION),
                     if_none_match: str | None = Header(None),
                     accept_encoding: str | None = Header(None)) -> Response:
        return await _export(st, key, revision, kind, if_none_match, accept_encoding)

    router.get(f"/plans/{{key}}/export/{kind}", summary=summary, description=description + " " + _CACHED,
               response_class=Response, responses=_REFUSABLE_RESPONSES if refusable else _EXPORT_RESPONSES,
               dependencies=[Depends(require_read)], name=f"export_{kind.replace('.', '_')}")(export)


_text_export("runtimes.json", "Which runtimes run the plan as planned",
             "`pipeplan.runtimes/v1`: pipeplan's runtime, torch's, torchtitan and Megatron-LM, each with"
             " whether it runs the plan as planned and why not.", refusable=False)
_text_export("torchtitan.args", "torchtitan 0.3 command-line overrides",
             "The `--parallelism.*` and `--training.*` overrides that agree with torch.csv (saved as"
             " schedule.csv in the job's working directory), one per line; 409 when torchtitan cannot express"
             " the plan.")
_text_export("megatron.args", "Megatron-LM arguments",
             "Pipeline size, layout (partition and virtual stages), batch and recompute arguments, one per"
             " line, shell-quoted; 409 when Megatron-LM cannot place the plan.")


__all__ = ["ApiError", "router"]
