"""App factory: `create_app(settings)` builds the FastAPI app; all I/O starts in the lifespan.

Errors reach clients as JSON `{"error": code, "message": sentence, ...}`; never a stack trace
(service.errors). The dashboard (service.dashboard) serves the cache's pages beside the API.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.middleware.gzip import GZipMiddleware

from pipeplan.settings import Settings, get_settings

from . import api, configure_api, dashboard, errors, frontier_api, openapi, ops, trace_api
from .bodies import BodyMiddleware
from .metrics import MetricsMiddleware
from .state import ServiceState

log = logging.getLogger("pipeplan.service")

DESCRIPTION = """
Pipeline-parallel schedule plans as a service. POST a problem (`pipeplan.problem/v1`) or a model spec:
the best cached plan comes back at once, or, on a miss, the best heuristic plan computed inline
(revision 1) while a worker refines it. Follow better revisions with `If-None-Match` polling,
long-polling (`?min_revision=&wait=`) or server-sent events. Plans are `pipeplan.plan/v1` documents.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    state = ServiceState.build(settings)
    app = FastAPI(title="pipeplan", version="1", description=DESCRIPTION, lifespan=state.lifespan,
                  docs_url=None, redoc_url=None)  # served offline by service.openapi
    app.state.pipeplan = state
    app.include_router(api.router)
    app.include_router(frontier_api.router)  # /v1/frontiers (docs/frontier.md)
    app.include_router(configure_api.router)  # /v1/configurations (docs/configure.md)
    app.include_router(trace_api.router)  # /v1/plans/{key}/traces (docs/trace.md)
    app.include_router(ops.router)  # /healthz, /readyz, /metrics
    errors.install(app, settings.retry_after_s)
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
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(errors.CatchAllMiddleware, logger=log)  # last added: outermost, inside Starlette's own
    return app
