"""What can go wrong talking to the plan service, split by what the caller should do about it.

`PlanRequestError` (4xx): the request itself is wrong; retrying will not help; `reasons` carries the
server's "field: reason" lines. `ServiceUnavailable`: the service could not be reached or answered
5xx/429 even after the retries; a training job keeps its current plan and tries again later.
"""

from __future__ import annotations

from typing import Any


class PlanClientError(Exception):
    """Base class of every error the client raises."""


class PlanRequestError(PlanClientError):
    """The service rejected the request (4xx). `reasons` are the server's own messages."""

    def __init__(self, status: int, reasons: list[str], body: Any = None):
        self.status = status
        self.reasons = reasons
        self.body = body
        super().__init__(f"HTTP {status}: " + "; ".join(reasons or ["(no reason given)"]))


class PlanNotFound(PlanRequestError):
    """No plan is stored under that key (404)."""


class ServiceUnavailable(PlanClientError):
    """The service is unreachable, timed out, or answered 5xx/429 (retryable)."""

    def __init__(self, reason: str, retry_after_s: float | None = None, status: int | None = None):
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.status = status
        super().__init__(reason if retry_after_s is None else f"{reason} (retry after {retry_after_s:g} s)")


class WaitTimeout(PlanClientError, TimeoutError):
    """`wait()` ran out of time before the wanted revision appeared."""


def reasons_of(body: Any) -> list[str]:
    """Readable reasons from an error body, whatever shape the server chose.

    Understands FastAPI's `{"detail": [{"loc": [...], "msg": ...}]}`, `{"detail": "text"}`,
    `{"errors": ["field: reason", ...]}` and a bare string, and keeps the minimum memory per device
    of an infeasible budget when the body names it.
    """
    if body is None:
        return []
    if isinstance(body, str):
        return [body]
    if isinstance(body, list):
        return [line for item in body for line in reasons_of(item)]
    if not isinstance(body, dict):
        return [str(body)]
    if "loc" in body and "msg" in body:
        where = ".".join(str(p) for p in body["loc"] if p not in ("body",))
        return [f"{where}: {body['msg']}" if where else str(body["msg"])]
    out: list[str] = []
    for field in ("errors", "detail", "message", "error"):
        if field in body:
            out += reasons_of(body[field])
            break
    for extra in ("needed_mib", "min_memory_mib", "memory_limit_mib"):
        if extra in body:
            out.append(f"{extra}: {body[extra]}")
    return out or [str(body)]
