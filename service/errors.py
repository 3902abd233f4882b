"""The one error shape every 4xx/5xx of the API carries: helpers to raise and document it, and the
handlers that answer every exception in it (`install(app)`, `CatchAllMiddleware`).

Clients parse `{"error": code, "message": sentence, ...}` whatever went wrong, so the OpenAPI
document describes exactly that body (ErrorBody) for every status a route can answer, and the
expected failures (database or queue unavailable, overload) are plain responses with Retry-After,
never tracebacks.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pipeplan.service")


class ErrorBody(BaseModel):
    """Every error response. Some codes add fields (e.g. `infeasible`: `min_memory_mib`)."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="Stable machine code: invalid_request, too_large, infeasible, unauthorized,"
                       " not_found, method_not_allowed, request_timeout, payload_too_large, too_many_requests, unavailable,"
                       " internal_error.")
    message: str = Field(description="One sentence for people; names the field and the reason.")
    detail: list[str] | None = Field(None, description="One line per invalid field (`field: reason`), on 422.")


class ApiError(HTTPException):
    """An error with a stable machine code and a sentence for people."""

    def __init__(self, status: int, code: str, message: str, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status, message, headers=headers)
        self.code, self.extra = code, extra or {}

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.detail, **self.extra}


class NothingToStream(Exception):
    """The key's job is over and the client has every revision: answered 204, which tells an
    EventSource to stop reconnecting (the HTML standard's way to end a stream for good)."""


def unavailable(message: str, retry_after_s: float) -> ApiError:
    """503: a dependency (database, queue) or capacity is missing for now; retry after the header."""
    return ApiError(503, "unavailable", message, headers={"Retry-After": str(max(1, round(retry_after_s)))})


def too_many(message: str, retry_after_s: float) -> ApiError:
    """429: this client (or everyone) asked for more than the configured limit; retry after the header."""
    return ApiError(429, "too_many_requests", message,
                    headers={"Retry-After": str(max(1, round(retry_after_s)))})


_DESCRIPTIONS = {
    400: "Bad request", 401: "A valid API key is required", 404: "Unknown key, revision or path",
    409: "Conflict", 413: "Request body too large", 422: "Invalid input (names the field and the reason)",
    429: "Too many requests; retry after Retry-After seconds",
    503: "Database, queue or capacity unavailable; retry after Retry-After seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries: ErrorBody for each status (Retry-After on 429/503)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": _DESCRIPTIONS.get(status, "Error")}
        if status in (429, 503):
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    return out


class CatchAllMiddleware:
    """Outermost app middleware: an unexpected exception becomes one logged traceback and a JSON 500.

    Starlette's own handler for `Exception` answers 500 but then re-raises, so the server logs the
    traceback a second time and drops the keep-alive connection; this answers and stops there."""

    def __init__(self, app: Any, logger: Any):
        self.app, self.log = app, logger

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            self.log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # too late for a status: end the response; the client sees a short body
                raise
            body = {"error": "internal_error", "message": "internal error (logged on the server)"}
            await JSONResponse(body, 500)(scope, receive, send)


# -- bounds of what the database can hold: beyond them a query fails, so the input gets a 422 first ---
MAX_REVISION = 2**31 - 1  # revisions are INTEGER columns (int4 on PostgreSQL)
MAX_OFFSET = 10**12  # OFFSET is a signed 64-bit integer in PostgreSQL and SQLite
MAX_PAGE = 10**9  # dashboard pages: a larger page is clamped (shown as the last page)


def reject_nul(field: str, value: str | None) -> str | None:
    """PostgreSQL text cannot hold NUL: a query parameter with one is invalid input, not a 500."""
    if value is not None and "\x00" in value:
        raise ApiError(422, "invalid_request", f"{field}: must not contain a NUL character",
                       {"detail": [f"{field}: must not contain a NUL character"]})
    return value


# -- every exception a route can raise, answered in the one shape ---------------------------------------
_HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               413: "payload_too_large", 429: "too_many_requests", 503: "unavailable"}


def install(app: FastAPI, retry_after_s: int) -> None:
    """Answer every expected failure as ErrorBody: our ApiErrors, Starlette's HTTP errors, invalid input
    (422, one line per field), and an unreachable database or queue (503 with Retry-After, logged at
    most once per 5 s). The unexpected rest is CatchAllMiddleware's."""
    quiet_until: dict[str, float] = {}

    def unreachable(what: str, exc: Exception) -> JSONResponse:
        now = time.monotonic()  # an outage answers thousands of requests: one log line per 5 s is enough
        if now >= quiet_until.get(what, 0.0):
            quiet_until[what] = now + 5.0
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("%s unavailable (503 with Retry-After; logged once per 5 s): %s", what, first)
        return JSONResponse({"error": "unavailable", "message": f"the {what} is unavailable; retry later"},
                            503, headers={"Retry-After": str(retry_after_s)})

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(NothingToStream)
    async def _nothing_to_stream(request: Request, exc: NothingToStream) -> Response:
        return Response(status_code=204)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # Starlette lists only the first matching route's methods
            headers["Allow"] = allowed_methods(app, request.scope)
        return JSONResponse({"error": _HTTP_CODES.get(exc.status_code, "error"), "message": str(exc.detail)},
                            exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        lines = validation_lines(exc)
        return JSONResponse({"error": "invalid_request", "message": "; ".join(lines), "detail": lines}, 422)

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    async def _database_error(request: Request, exc: Exception) -> JSONResponse:
        if _db_unavailable(exc):  # expected: a response, not a traceback, and the connection stays open
            return unreachable("database", exc)
        log.error("database error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"error": "internal_error", "message": "internal error (logged on the server)"}, 500)

    @app.exception_handler(RedisError)
    async def _queue_error(request: Request, exc: Exception) -> JSONResponse:
        return unreachable("queue", exc)


def validation_lines(exc: RequestValidationError) -> list[str]:
    """One `field: reason` line per invalid field (`body: invalid JSON at character N: ...` for bad JSON)."""
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


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> str:
    """The Allow header of a 405: every method the OpenAPI document gives this path."""
    path = scope.get("path", "")
    methods: set[str] = set()
    for template, ops in app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in ops}
    return ", ".join(sorted(methods))
