"""What the dashboard needs from the app: the plan repository, the event hub, the settings, and the
read-key gate.

Each is read from `app.state.pipeplan` (the service's ServiceState), else from `app.state` itself, so
the pages also run in a bare app that holds only a repository and a hub (tests/dashboard_fixtures.py).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from fastapi import Depends, HTTPException, Request

from ..security import key_ok, presented_key
from . import data

KEY_COOKIE = "pipeplan_api_key"


class KeyRequired(Exception):
    """Reads are key-gated and the browser presented no valid key: show the key form instead."""


def require_read_key(request: Request) -> None:
    """Honour `read_requires_key`: a page load cannot send a header, so the key the user typed
    (stored in localStorage) also travels as a same-site cookie; API clients may send the header."""
    settings = state_attr(request, "settings")
    keys = list(getattr(settings, "api_keys", None) or [])
    if not keys or not getattr(settings, "read_requires_key", False):
        return
    presented = presented_key(request) or unquote(request.cookies.get(KEY_COOKIE) or "") or None
    if not key_ok(presented, keys):
        raise KeyRequired()


gated = [Depends(require_read_key)]


def state_attr(request: Request, *names: str) -> Any:
    """`app.state.pipeplan.<name>` (the service's ServiceState), else `app.state.<name>`."""
    for state in (getattr(request.app.state, "pipeplan", None), request.app.state):
        for name in names:
            value = getattr(state, name, None) if state is not None else None
            if value is not None:
                return value
    return None


def repo_of(request: Request):
    repo = state_attr(request, "repo")
    if repo is None:
        raise HTTPException(503, "the plan cache is not ready")
    return repo


def hub_of(request: Request):
    return state_attr(request, "hub")


def renders_of(request: Request) -> data.RenderCache:
    cache = getattr(request.app.state, "dashboard_renders", None)
    if cache is None:  # first use; a racing second one is merely discarded
        settings = state_attr(request, "settings")
        cache = request.app.state.dashboard_renders = data.RenderCache(
            max_mib=getattr(settings, "dashboard_render_cache_mib", 64.0))
    return cache


def default_budget(request: Request) -> float:
    settings = state_attr(request, "settings")
    return float(getattr(settings, "default_time_budget_s", 60.0) or 60.0)


def checked_key(key: str) -> str:
    """Keys are SHA-256 hex; anything else cannot be cached, so it is a 404 without a query."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise HTTPException(404, f"no cached plan with key {key[:80]}")
    return key
