"""Operations endpoints: liveness, readiness and Prometheus metrics (tag `ops`, never key-gated)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from .deps import StateDep
from .errors import error_responses

router = APIRouter(tags=["ops"])


class Readiness(BaseModel):
    status: str
    queue_kind: str
    database: str
    queue: str


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: database and queue reachable",
            description="Each check gives up after `db_answer_timeout_s` (+1 s): a frozen dependency fails"
            " the probe fast instead of hanging it.",
            responses={200: {"model": Readiness, "description": "Ready"}, **error_responses(503)})
async def readyz(st: StateDep) -> Response:
    checks: dict[str, str] = {}
    for name, fn in (("database", st.repo.ping), ("queue", st.queue.ping)):
        try:
            await asyncio.wait_for(run_in_threadpool(fn), st.settings.db_answer_timeout_s + 1.0)
            checks[name] = "ok"
        except Exception as exc:
            checks[name] = f"unavailable: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    if ok:
        return JSONResponse({"status": "ok", "queue_kind": st.queue.kind, **checks})
    down = ", ".join(k for k, v in checks.items() if v != "ok")
    return JSONResponse({"error": "unavailable", "message": f"not ready: {down} unavailable",
                         "status": "unavailable", "queue_kind": st.queue.kind, **checks},
                        503, headers={"Retry-After": str(st.settings.retry_after_s)})


@router.get("/metrics", summary="Prometheus metrics")
def prometheus(st: StateDep) -> Response:
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
