"""Live updates (/dashboard/events): revision and job-state events as server-sent events; the page
re-fetches only the fragment an event names."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from ..admission import stream_admitted
from .deps import gated, hub_of, repo_of, state_attr
from .templating import PREFIX

KEEPALIVE_S = 15.0
RECHECK_S = 5.0  # pub/sub is at-most-once: SSE streams re-read the database this often
router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)


def _snapshot(repo, key: str) -> tuple[int | None, str | None]:
    job = repo.job(key)
    return repo.best_revision(key), (job.state if job else None)


@router.get("/events", response_class=EventSourceResponse, dependencies=[*gated, Depends(stream_admitted)])
async def events(request: Request, key: str | None = Query(None, max_length=64),
                 rev: int | None = Query(None, ge=0), state: str | None = Query(None, max_length=20)):
    """Revision and job-state events for one key, or for every key (the overview).

    Messages come from the service's event hub; a per-key stream also re-reads the database at once
    (against the `rev`/`state` the page was rendered with) and then every few seconds, because
    pub/sub may drop a message and a change that landed while the page loaded must still show.
    """
    repo = repo_of(request)
    hub = hub_of(request)
    settings = state_attr(request, "settings")
    keepalive_s = float(getattr(settings, "sse_keepalive_s", KEEPALIVE_S))
    recheck_s = float(getattr(settings, "sse_poll_s", RECHECK_S))
    yield ServerSentEvent(comment="connected", retry=2000)
    # What the page shows (rev, state): anything newer that landed while it loaded is sent at once.
    last = (rev, state or None) if key and rev is not None else (
        await run_in_threadpool(_snapshot, repo, key) if key else None)
    next_check = time.monotonic()
    quiet_since = time.monotonic()
    with _subscribe(hub, key or "*") as sub:
        while True:
            wait = keepalive_s if not key else max(0.05, min(keepalive_s, next_check - time.monotonic()))
            message = await _next(sub, wait)
            if message:
                quiet_since = time.monotonic()
                kind = message.get("type")
                yield ServerSentEvent(event=kind if kind in ("revision", "job") else "message", data=message)
                if key:  # the hub told us: do not announce the same change again from the re-check
                    last = await run_in_threadpool(_snapshot, repo, key)
                continue
            if key and time.monotonic() >= next_check:
                next_check = time.monotonic() + recheck_s
                now = await run_in_threadpool(_snapshot, repo, key)
                if now[0] != last[0]:
                    yield ServerSentEvent(event="revision", data={"type": "revision", "key": key,
                                                                  "revision": now[0]})
                if now[1] != last[1]:
                    yield ServerSentEvent(event="job", data={"type": "job", "key": key, "state": now[1]})
                if now != last:
                    last, quiet_since = now, time.monotonic()
            if time.monotonic() - quiet_since >= keepalive_s:
                quiet_since = time.monotonic()
                yield ServerSentEvent(comment="keepalive")


@contextmanager
def _subscribe(hub, key: str):
    """The hub's subscription, or None when the app has no hub (then only the re-check runs)."""
    if hub is None:
        yield None
    else:
        with hub.subscribe(key) as sub:
            yield sub


async def _next(sub, timeout: float) -> dict[str, Any] | None:
    if sub is None:
        await asyncio.sleep(timeout)
        return None
    return await sub.get(timeout)
