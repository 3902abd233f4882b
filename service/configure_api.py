"""/v1/configurations: search the parallel layouts of a model on a cluster, read the ranking, follow it.

POST runs the search (planner.configure) in a killable child process with a time box, holding the
frontier's admission slot (the same kind of heavy, bounded work). Every scored candidate is stored as
an ordinary cached plan under its own problem key; the best `configure_refine_top` get one ordinary
refine job each on the shared queue, so several workers share one search, and GET (or the SSE stream)
ranks the candidates again by their best plans as the jobs improve them. An impossible request
answers 422 naming the field (the global batch with the nearest valid ones, or the GPUs with the
least memory per GPU), never a 500 or a timeout of the search.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from pipeplan.planner.configure_space import ConfigureRequest
from pydantic import ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from . import inline
from .admission import check_queue_share, rate_limited, stream_admitted
from .api import KEY_RE, enqueue, refine_budget
from .configure_store import ConfigurationStore, configuration_key, run_search
from .deps import StateDep
from .document_stream import document_events
from .errors import ApiError
from .models import QUEUED
from .security import require_read, require_write
from .state import ServiceState

router = APIRouter(prefix="/v1", tags=["configurations"])


class ConfigurationRequest(ConfigureRequest):
    """A configuration search: the spec (model, hardware, precision, sequence, framework settings;
    its layout fields are what the search replaces), the cluster and batch, optional constraints."""

    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] = Field(description="A model spec (pipeplan.spec/v1).")
    time_budget_s: float | None = Field(None, gt=0, description="Refine budget of each refined candidate.")


def links(key: str) -> dict[str, str]:
    return {"self": f"/v1/configurations/{key}", "events": f"/v1/configurations/{key}/events",
            "dashboard": f"/dashboard/configurations/{key}"}


def _store(st: ServiceState) -> ConfigurationStore:
    return ConfigurationStore.of(st.repo)


def _queue(st: ServiceState, keys: list[str]) -> None:
    """Publish each refined candidate's revision 1 and enqueue its refine job."""
    for k in keys:
        st.events.publish_revision(k, 1)
        job = st.repo.job(k)
        if job is not None and job.state == QUEUED:
            enqueue(st, k, job)


def _ranking(st: ServiceState, key: str) -> dict[str, Any]:
    if not KEY_RE.fullmatch(key):
        raise ApiError(404, "not_found", "configuration keys are 64 lowercase hex characters (SHA-256)")
    doc = _store(st).ranking(key)
    if doc is None:
        raise ApiError(404, "not_found", f"no configuration search {key}")
    return doc


def _answer(st: ServiceState, key: str, created: bool) -> Response:
    return JSONResponse({"configuration_key": key, "created": created, "configurations": _ranking(st, key),
                         "links": links(key)}, status_code=201 if created else 200)


@router.post("/configurations", status_code=200,
             summary="Search the parallel layouts of a model on a cluster (one refine job per top candidate)",
             responses={201: {"description": "New search: candidates stored, the top ones' jobs queued"},
                        422: {"description": "Invalid input, or an impossible request (the field is named)"},
                        429: {"description": "Rate limited; retry after Retry-After seconds"},
                        503: {"description": "Busy or past the time box; retry after Retry-After seconds"}},
             dependencies=[Depends(require_write), Depends(rate_limited)])
async def create_configurations(body: ConfigurationRequest, request: Request, st: StateDep) -> Response:
    s = st.settings
    budget = refine_budget(st, body.time_budget_s)
    inline.check_spec(body.spec, s.limits)  # microseconds; the search runs in the child
    search = body.model_dump(mode="json", exclude={"spec", "time_budget_s"})
    key = configuration_key(body.spec, search)
    if await run_in_threadpool(_store(st).exists, key):
        return await run_in_threadpool(_answer, st, key, False)
    owner = await run_in_threadpool(check_queue_share, request, budget)
    job = {"key": key, "spec": body.spec, "request": search, "limits": s.limits.model_dump(),
           "database_url": s.resolved_database_url, "budget_s": budget, "owner": owner,
           "refine_top": min(body.top, s.configure_refine_top), "max_scheduled": 200}
    async with st.admission.frontier_slot():
        try:
            result = await inline.run_in_child(job, s.configure_timeout_s, request.is_disconnected,
                                               s.retry_after_s, entry=run_search, what="the configuration search")
        except inline.Gone:
            return Response(status_code=499)  # nobody is listening; the work was stopped
    await run_in_threadpool(_queue, st, result["new"])
    return await run_in_threadpool(_answer, st, result["key"], result["created"])


@router.get("/configurations/{key}", summary="The ranking now: each candidate's best stored plan"
            " (pipeplan.configurations/v1)", dependencies=[Depends(require_read)])
async def get_configurations(key: str, st: StateDep) -> Any:
    doc = await run_in_threadpool(_ranking, st, key)
    return {"configuration_key": key, "links": links(key), **doc}


async def _known(key: str, st: StateDep) -> str:
    """Dependency: 404 before the stream starts (raised inside the generator it breaks the response)."""
    await run_in_threadpool(_ranking, st, key)
    return key


def _signature(doc: dict[str, Any]) -> tuple:
    return tuple((e["problem_key"], e.get("revision"), e.get("job_state")) for e in doc["scored"])


@router.get("/configurations/{key}/events", response_class=EventSourceResponse,
            summary="Server-sent events: one `ranking` event (the whole document) whenever a candidate improves",
            dependencies=[Depends(require_read), Depends(_known), Depends(stream_admitted)])
async def configuration_events(key: str, request: Request, st: StateDep):
    async for event in document_events(request, st, lambda: _ranking(st, key),
                                       lambda doc: (e["problem_key"] for e in doc["scored"]), _signature, "ranking"):
        yield event
