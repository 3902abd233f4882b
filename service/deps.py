"""What a route needs from the app, as FastAPI dependencies.

`st: StateDep` in a route's signature is this process's ServiceState (built by the app factory,
started in its lifespan). It is an `async def`: resolving it costs no thread-pool hop.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .state import ServiceState


async def get_state(request: Request) -> ServiceState:
    return request.app.state.pipeplan


StateDep = Annotated[ServiceState, Depends(get_state)]
