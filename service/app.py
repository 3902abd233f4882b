"""App factory: `create_app(settings)` builds the FastAPI app; all I/O starts in the lifespan.

Errors reach clients as JSON `{"error": code, "message": sentence, ...}`; never a stack trace.
The dashboard (service/dashboard/) serves the cache's pages beside the API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.gzip import GZipMiddleware

from pipeplan.settings import Settings, get_settings

from . import api, dashboard, frontier_api, openapi, trace_api
from .errors import CatchAllMiddleware, error_responses
from .bodies import BodyMiddleware
from .metrics import Metrics, MetricsMiddleware, StateCollector
from .state import ServiceState

log = logging.getLogger("pipeplan.service")

DESCRIPTION = """
Pipeline-parallel schedule plans as a service. POST a problem (`pipeplan.problem/v1`) or a model spec:
the best cached plan comes back at once, or, on a miss, the best heuristic plan computed inline
(revision 1) while a worker refines it. Follow better revisions with `If-None-Match` polling,
long-polling (`?min_revision=&wait=`) or server-sent events. Plans are `pipeplan.plan/v1` documents.
"""


class Readiness(BaseModel):
    status: str
    queue_kind: str
    database: str
    queue: str


def _validation_lines(exc: RequestValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc is ("body", character offset)
            at = err.get("loc", ("body", "?"))[-1]
            reason = (err.get("ctx") or {}).get("error") or "not valid JSON"
            lines.append(f"body: invalid JSON at character {at}: {reason}")
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        lines.append(f"{'.'.join(loc) or 'body'}: {msg}")
    return lines


def _db_unavailable(exc: Exception) -> bool:
    if isinstance(exc, (OperationalError, PoolTimeout)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()
    state = ServiceState(settings=settings, metrics=metrics)
    metrics.registry.register(StateCollector(state))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await state.start()
        except Exception as exc:
            log.error("pipeplan service cannot start: %s", exc)
            await state.stop()
            raise
        yield
        await state.stop()

    app = FastAPI(title="pipeplan", version="1", description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # served offline by service.openapi
    app.state.pipeplan = state
    app.include_router(api.router)
    app.include_router(frontier_api.router)  # /v1/frontiers (docs/frontier.md)
    app.include_router(trace_api.router)  # /v1/plans/{key}/traces (docs/trace.md)

    @app.exception_handler(api.ApiError)
    async def _api_error(request: Request, exc: api.ApiError):
        return JSONResponse(exc.body(), exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(api.NothingToStream)
    async def _nothing_to_stream(request: Request, exc: api.NothingToStream):
        return Response(status_code=204)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                413: "payload_too_large", 429: "too_many_requests", 503: "unavailable"}.get(exc.status_code, "error")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # Starlette lists only the first matching route's methods
            headers["Allow"] = openapi.allowed_methods(app, request.scope)
        return JSONResponse({"error": code, "message": str(exc.detail)}, exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        lines = _validation_lines(exc)
        return JSONResponse({"error": "invalid_request", "message": "; ".join(lines), "detail": lines}, 422)

    quiet_until: dict[str, float] = {}

    def _unavailable(what: str, exc: Exception) -> JSONResponse:
        now = time.monotonic()  # an outage answers thousands of requests: one log line per 5 s is enough
        if now >= quiet_until.get(what, 0.0):
            quiet_until[what] = now + 5.0
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("%s unavailable (503 with Retry-After; logged once per 5 s): %s", what, first)
        return JSONResponse({"error": "unavailable", "message": f"the {what} is unavailable; retry later"},
                            503, headers={"Retry-After": str(settings.retry_after_s)})

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    async def _database_error(request: Request, exc: Exception):
        if _db_unavailable(exc):  # expected: a response, not a traceback, and the connection stays open
            return _unavailable("database", exc)
        log.error("database error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"error": "internal_error", "message": "internal error (logged on the server)"}, 500)

    @app.exception_handler(RedisError)
    async def _queue_error(request: Request, exc: Exception):
        return _unavailable("queue", exc)

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process answers")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Readiness: database and queue reachable",
             description="Each check gives up after `db_answer_timeout_s` (+1 s): a frozen dependency fails"
             " the probe fast instead of hanging it.",
             responses={200: {"model": Readiness, "description": "Ready"}, **error_responses(503)})
    async def readyz() -> Response:
        checks: dict[str, str] = {}
        for name, fn in (("database", state.repo.ping), ("queue", state.queue.ping)):
            try:
                await asyncio.wait_for(run_in_threadpool(fn), settings.db_answer_timeout_s + 1.0)
                checks[name] = "ok"
            except Exception as exc:
                checks[name] = f"unavailable: {type(exc).__name__}"
        ok = all(v == "ok" for v in checks.values())
        if ok:
            return JSONResponse({"status": "ok", "queue_kind": state.queue.kind, **checks})
        down = ", ".join(k for k, v in checks.items() if v != "ok")
        return JSONResponse({"error": "unavailable", "message": f"not ready: {down} unavailable",
                             "status": "unavailable", "queue_kind": state.queue.kind, **checks},
                            503, headers={"Retry-After": str(settings.retry_after_s)})

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    dashboard.install(app)

    openapi.install(app)

    @app.get("/", include_in_schema=False)
    async def home() -> RedirectResponse:
        """Newcomers land on the dashboard."""
        return RedirectResponse("/dashboard/", status_code=307)

    # gzip for clients that ask (plans, pages); SSE and already-encoded exports pass through untouched.
    # Level 6: most of level 9's ratio on JSON at a fraction of the CPU; bodies over 128 KiB are
    # compressed in a worker thread, not on the event loop.
    app.add_middleware(GZipMiddleware, minimum_size=settings.gzip_min_bytes, compresslevel=6)
    app.add_middleware(BodyMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(CatchAllMiddleware, logger=log)  # last added: outermost, inside Starlette's own
    return app
