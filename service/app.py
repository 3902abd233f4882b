"""App factory: `create_app(settings)` builds the FastAPI app; all I/O starts in the lifespan.

Errors reach clients as JSON `{"error": code, "message": sentence, ...}`; never a stack trace.
The dashboard (service/dashboard.py, a router) is included when present.
"""

from __future__ import annotations

import importlib
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeplan.settings import Settings, get_settings

from . import api
from .metrics import BodyLimitMiddleware, Metrics, MetricsMiddleware, StateCollector
from .state import ServiceState

log = logging.getLogger("pipeplan.service")

DESCRIPTION = """
Pipeline-parallel schedule plans as a service. POST a problem (`pipeplan.problem/v1`) or a model spec:
the best cached plan comes back at once, or, on a miss, the best heuristic plan computed inline
(revision 1) while a worker refines it. Follow better revisions with `If-None-Match` polling,
long-polling (`?min_revision=&wait=`) or server-sent events. Plans are `pipeplan.plan/v1` documents.
"""


def _validation_lines(exc: RequestValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
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

    app = FastAPI(title="pipeplan", version="1", description=DESCRIPTION, lifespan=lifespan)
    app.state.pipeplan = state
    app.include_router(api.router)

    @app.exception_handler(api.ApiError)
    async def _api_error(request: Request, exc: api.ApiError):
        return JSONResponse(exc.body(), exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        return JSONResponse({"error": code, "message": str(exc.detail)}, exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        lines = _validation_lines(exc)
        return JSONResponse({"error": "invalid_request", "message": "; ".join(lines), "detail": lines}, 422)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        if _db_unavailable(exc):
            log.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else exc)
            return JSONResponse({"error": "unavailable", "message": "the database is unavailable; retry later"},
                                503, headers={"Retry-After": str(settings.retry_after_s)})
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": "internal_error", "message": "internal error (logged on the server)"}, 500)

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process answers")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Readiness: database and queue reachable")
    async def readyz() -> Response:
        checks: dict[str, str] = {}
        for name, fn in (("database", state.repo.ping), ("queue", state.queue.ping)):
            try:
                await run_in_threadpool(fn)
                checks[name] = "ok"
            except Exception as exc:
                checks[name] = f"unavailable: {type(exc).__name__}"
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "queue_kind": state.queue.kind, **checks},
                            200 if ok else 503, headers=None if ok else {"Retry-After": str(settings.retry_after_s)})

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    try:  # the dashboard helper's router, when present
        dashboard = importlib.import_module("service.dashboard")
    except ModuleNotFoundError as exc:
        if exc.name != "service.dashboard":
            raise
    else:
        app.include_router(dashboard.router)
        mount = getattr(dashboard, "mount", None)
        if callable(mount):
            mount(app)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
