"""The one error shape every 4xx/5xx of the API carries, and helpers to raise and document it.

Clients parse `{"error": code, "message": sentence, ...}` whatever went wrong, so the OpenAPI
document describes exactly that body (ErrorBody) for every status a route can answer, and the
expected failures (database or queue unavailable, overload) are plain responses with Retry-After,
never tracebacks.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field


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
            from fastapi.responses import JSONResponse

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
