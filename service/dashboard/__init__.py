"""The cache dashboard at /dashboard: server-rendered pages, HTML fragments for live updates, SSE.

Pages are plain `def` endpoints (blocking SQL runs in the thread pool). The browser keeps one
EventSource open; each event makes it re-fetch only the server-rendered fragment that changed (one
overview row, or the plan panels), so all rendering lives in the templates and `views`.

One module per page or concern: `overview`, `plan_page`, `frontier`, `configurations` (pages),
`events` (live updates), `baselines` (the comparison tables), `traces` (measured runs), `data` (what
pages show, cached), `views` (pure SVG and text renderers), `templating` (templates and static files)
and `deps` (what the pages read from the app, and the read-key gate). The app factory calls `install(app)`.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse

from . import configurations, events, frontier, overview, plan_page, templating
from .deps import KeyRequired
from .templating import context, templates

router = APIRouter()
for part in (templating, overview, plan_page, events, frontier, configurations):
    router.include_router(part.router)


def mount(app: FastAPI) -> None:
    """The key form: a gated page that got no valid key answers 401 with it."""

    @app.exception_handler(KeyRequired)
    async def _key_required(request: Request, exc: KeyRequired) -> HTMLResponse:
        response = templates.TemplateResponse(request, "dashboard/locked.html", context(request),
                                              status_code=401)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response


def install(app: FastAPI) -> None:
    """Every dashboard page, and the key form."""
    app.include_router(router)
    mount(app)
