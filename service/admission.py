"""Admission control: how much one API process takes on at once, and what it says beyond that.

Five gates, all sized in the settings object: heavy POSTs (a first plan computed) share a few slots
and wait at most `admission_wait_s` for one (then 503 with Retry-After), and a frontier request first
takes one of its own few; SSE streams and long-polls are counted against `max_streams` (503 beyond,
instead of letting 13,000 idle streams slow every GET); writes may be rate limited per identity (429);
and one identity may have at most `max_queued_solve_s` of solving queued or running (429), so one
client's backlog cannot fill the workers' next hours.

An identity is what the server verified: a configured API key (its digest), else the client address.
A key the server does not know is no identity: without configured keys, a fresh random `X-API-Key`
per request used to buy a fresh rate-limit quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Iterator

from fastapi import Request

from pipeplan.settings import Settings

from .errors import too_many, unavailable
from .security import verified_key


class Admission:
    """The per-process gates. Built in the app's lifespan (the semaphore needs the running loop)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.heavy = asyncio.Semaphore(settings.max_expensive_requests)
        self.heavy_running = 0
        self.frontiers = 0  # frontier requests computing (frontier_slot)
        self.streams = 0
        self._buckets: dict[str, tuple[float, float]] = {}  # identity -> (tokens, last refill)

    @contextlib.asynccontextmanager
    async def heavy_slot(self) -> AsyncIterator[None]:
        """One of `max_expensive_requests` slots, waited for at most `admission_wait_s`."""
        try:
            if self.heavy.locked():  # wait_for with a 0-s timeout would refuse even a free slot
                await asyncio.wait_for(self.heavy.acquire(), timeout=self.settings.admission_wait_s)
            else:
                await self.heavy.acquire()
        except TimeoutError:
            raise unavailable(
                f"the server is computing {self.settings.max_expensive_requests} first plans already;"
                " retry later", self.settings.retry_after_s) from None
        self.heavy_running += 1
        try:
            yield
        finally:
            self.heavy_running -= 1
            self.heavy.release()

    @contextlib.asynccontextmanager
    async def frontier_slot(self) -> AsyncIterator[None]:
        """One of `max_frontier_requests`, refused at once beyond them (each holds its slot for up to
        `frontier_timeout_s`, so waiting would rarely help), then a heavy slot shared with first plans:
        frontiers hold at most `max_frontier_requests` of those."""
        if self.frontiers >= self.settings.max_frontier_requests:
            raise unavailable(f"the server is computing {self.frontiers} frontier(s) already; retry later",
                              self.settings.retry_after_s)
        self.frontiers += 1
        try:
            async with self.heavy_slot():
                yield
        finally:
            self.frontiers -= 1

    @contextlib.contextmanager
    def stream_slot(self) -> Iterator[None]:
        """One of `max_streams` slots, held for the block (an SSE stream, a long-poll), or 503 with
        Retry-After. Check and count happen together (no await between them), so concurrent requests
        cannot both take the last slot."""
        if self.streams >= self.settings.max_streams:
            raise unavailable(f"{self.streams} event streams are open on this server (the limit); retry later",
                              self.settings.retry_after_s)
        self.streams += 1
        try:
            yield
        finally:
            self.streams -= 1

    def check_rate(self, identity: str) -> None:
        """Token bucket per identity: `write_rate_per_min` tokens a minute, bursts up to that many."""
        rate = self.settings.write_rate_per_min
        if rate <= 0:
            return
        now = time.monotonic()
        tokens, last = self._buckets.get(identity, (rate, now))
        tokens = min(rate, tokens + (now - last) * rate / 60.0)
        if tokens < 1.0:
            self._buckets[identity] = (tokens, now)
            raise too_many(f"more than {rate:g} writes per minute from this client; retry later",
                           (1.0 - tokens) * 60.0 / rate)
        if len(self._buckets) > 100_000:  # forget idle clients rather than grow without end
            self._buckets.clear()
        self._buckets[identity] = (tokens - 1.0, now)


def identity_of(request: Request) -> str:
    """The verified API key (its digest) when keys are configured, else the client address."""
    key = verified_key(request)
    if key is not None:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return "addr:" + (request.client.host if request.client else "unknown")


def check_queue_share(request: Request, budget_s: float) -> str:
    """429 unless the caller's queued and running solve-seconds plus `budget_s` stay within
    `max_queued_solve_s`; returns the caller's identity, the new run's owner."""
    identity = identity_of(request)
    st = request.app.state.pipeplan
    cap = st.settings.max_queued_solve_s
    if cap > 0:
        runs, queued_s = st.repo.queued_work(identity)
        if queued_s + budget_s > cap:
            raise too_many(f"time_budget_s: this client has {runs} run(s) with {queued_s:.0f} s of solving queued or"
                           f" running; {budget_s:g} s more would pass the limit of {cap:g} s per client. Retry"
                           " when some has finished, or ask for less", queued_s + budget_s - cap)
    return identity


async def rate_limited(request: Request) -> None:
    """Dependency for write routes: the per-key rate limit (a no-op when write_rate_per_min is 0)."""
    request.app.state.pipeplan.admission.check_rate(identity_of(request))


async def stream_admitted(request: Request) -> AsyncIterator[None]:
    """Dependency (with yield) for SSE routes: one of `max_streams` slots for the stream's whole life.

    A yield dependency is torn down after the response is sent, i.e. after the event generator has
    ended (client gone, or server shutdown), so the count covers every byte of the stream. Counting
    inside the generator instead left a window between the check and the count, and a stream whose
    generator was not started yet was not counted at all. Apps without admission (dashboard-only
    test apps) are not limited.
    """
    admission = getattr(getattr(request.app.state, "pipeplan", None), "admission", None)
    if admission is None:
        yield
        return
    with admission.stream_slot():
        yield
