"""Single flight: one run of an async job per key at a time in this process.

Concurrent callers of a key wait for the run under way and get its result (or its exception), so a
cache miss is filled once however many requests race to it: the best-plan query, an export build,
a dashboard baselines table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def single_flight(inflight: dict[str, asyncio.Future], key: str, work: Callable[[], Awaitable[T]]) -> T:
    """`await work()` unless a run of `key` is under way; then wait for that one (shielded: a waiter
    that is cancelled does not cancel the run)."""
    pending = inflight.get(key)
    if pending is not None:
        return await asyncio.shield(pending)
    future = inflight[key] = asyncio.get_running_loop().create_future()
    try:
        result = await work()
        future.set_result(result)
        return result
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
        raise
    finally:
        inflight.pop(key, None)
