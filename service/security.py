"""API-key checks: writes need a key when keys are configured; reads only when read_requires_key."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


def presented_key(request: Request) -> str | None:
    """The key the request presents: `Authorization: Bearer <key>`, else `X-API-Key`."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def key_ok(presented: str | None, keys: list[str]) -> bool:
    """Whether `presented` is one of `keys`, in constant time."""
    if presented is None:
        return False
    ok = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


def verified_key(request: Request) -> str | None:
    """The presented key when it is one of the configured keys (None without configured keys)."""
    keys = request.app.state.pipeplan.settings.api_keys
    presented = presented_key(request)
    return presented if keys and key_ok(presented, keys) else None


def _check(request: Request) -> None:
    if request.app.state.pipeplan.settings.api_keys and verified_key(request) is None:
        raise HTTPException(401, "a valid API key is required (Authorization: Bearer <key> or X-API-Key)",
                            headers={"WWW-Authenticate": "Bearer"})


# async: no I/O here, and a sync dependency would cost a thread-pool hop on every request
async def require_write(request: Request) -> None:
    _check(request)


async def require_read(request: Request) -> None:
    if request.app.state.pipeplan.settings.read_requires_key:
        _check(request)
