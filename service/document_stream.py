"""The event stream of a document made of cached plans (a frontier's curve, a configuration
search's ranking): the whole document first, then again whenever one of its plans changes what the
document shows. Its plans' revisions and job states arrive as plan events (service.events)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import Any

from fastapi import Request
from fastapi.sse import ServerSentEvent
from starlette.concurrency import run_in_threadpool

from .events import ALL
from .state import ServiceState

Document = dict[str, Any]


async def document_events(request: Request, st: ServiceState, read: Callable[[], Document],
                          members: Callable[[Document], Iterable[str]],
                          signature: Callable[[Document], Hashable], event: str) -> AsyncIterator[ServerSentEvent]:
    """`read()` the document; send it as `event`; re-read after any event of one of its `members`'
    problem keys and send it again when its `signature` changed (the other events only check that
    the client is still there)."""
    doc = await run_in_threadpool(read)
    keys = set(members(doc))
    with st.events.subscribe(ALL) as sub:
        sent = signature(doc)
        yield ServerSentEvent(raw_data=json.dumps(doc), event=event)
        while True:
            message = await sub.get(timeout=st.settings.sse_poll_s)
            if message is not None and message.get("key") not in keys:
                if await request.is_disconnected():
                    return
                continue
            await asyncio.sleep(0.05)  # coalesce a burst (a worker propagating to several plans)
            doc = await run_in_threadpool(read)
            if signature(doc) != sent:
                sent = signature(doc)
                yield ServerSentEvent(raw_data=json.dumps(doc), event=event)
            if await request.is_disconnected():
                return
