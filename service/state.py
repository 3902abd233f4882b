"""Everything one API process holds: engine, repository, queue, events, plan cache, reconciler.

Built by the app factory, started in its lifespan (never at import); stored as `app.state.pipeplan`.
Routes receive it as `deps.StateDep`; the dashboard reads the same object (repo for reads, hub for
live updates).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from cachetools import TTLCache
from starlette.concurrency import run_in_threadpool

from pipeplan.settings import Settings

from .admission import Admission
from .db import DbTimeouts, make_engine
from .events import ALL, EventBus, Hub, LocalPublisher, RedisListener, RedisPublisher
from .flight import single_flight
from .metrics import Metrics, StateCollector
from .queue import JobQueue, LocalQueue, RQQueue
from .reconcile import reconcile
from .repository import BestPlan, Repository
from .schema import ensure_schema

log = logging.getLogger("pipeplan.service")


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    hub: Hub = field(default_factory=Hub)
    repo: Repository = None  # type: ignore[assignment]
    queue: JobQueue = None  # type: ignore[assignment]
    events: EventBus = None  # type: ignore[assignment]
    listener: RedisListener | None = None
    _cache: TTLCache = field(init=False)  # key -> BestPlan, bounded by plan bytes (__post_init__)
    spec_keys: dict[str, str] = field(default_factory=dict)  # spec hash -> problem key (API memo)
    admission: Admission = None  # type: ignore[assignment]
    _inflight: dict[str, asyncio.Future] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _locks: list[threading.Lock] = field(default_factory=lambda: [threading.Lock() for _ in range(64)])

    @classmethod
    def build(cls, settings: Settings) -> ServiceState:
        """The state of one app, its gauges registered; nothing is connected before `lifespan`."""
        state = cls(settings=settings, metrics=Metrics())
        state.metrics.registry.register(StateCollector(state))
        return state

    def __post_init__(self) -> None:
        # bounded by the bytes of the plans it holds, not by their number: a P=64 M=512 plan is ~9 MB
        self._cache = TTLCache(maxsize=max(1, int(self.settings.plan_cache_mib * 2**20)),
                               ttl=self.settings.plan_cache_ttl_s, getsizeof=lambda best: len(best.plan_json) + 512)

    # -- lifecycle ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan: everything starts before the first request and stops after the last;
        a start that fails stops what it had started and fails the app."""
        try:
            await self.start()
        except Exception as exc:
            log.error("pipeplan service cannot start: %s", exc)
            await self.stop()
            raise
        yield
        await self.stop()

    async def start(self) -> None:
        s = self.settings
        self.engine = make_engine(s.resolved_database_url, s.db_pool_size, DbTimeouts.from_settings(s))
        await run_in_threadpool(ensure_schema, self.engine, s.should_auto_migrate)
        self.repo = Repository(self.engine)
        self.hub.bind(asyncio.get_running_loop())
        self.hub.add_listener(self._invalidate)
        if s.redis_url:
            self.queue = RQQueue(s.redis_url, s.queue_name, s.job_timeout_margin_s)
            self.events = EventBus(self.hub, RedisPublisher(s.redis_url, s.events_channel))
            self.listener = RedisListener(s.redis_url, s.events_channel, self.hub)
            self.listener.start()
        else:
            from pipeplan.worker.tasks import WorkerContext, run_job

            publisher = LocalPublisher(self.hub)
            ctx = WorkerContext(self.repo, publisher, s, name="embedded")
            self.queue = LocalQueue(lambda key, run_id: run_job(ctx, key, run_id), s.embedded_workers)
            ctx.shutdown = self.queue.shutdown
            self.events = EventBus(self.hub, publisher)
        self.admission = Admission(s)
        self._tasks.append(asyncio.get_running_loop().create_task(self._reconcile_loop()))
        from .inline import warm_up

        threading.Thread(target=warm_up, name="forkserver-warm-up", daemon=True).start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self.listener:
            await self.listener.stop()
        if self.queue:
            await run_in_threadpool(self.queue.close)
        if getattr(self, "engine", None) is not None:
            self.engine.dispose()

    async def _reconcile_loop(self) -> None:
        first = True
        while True:
            try:
                grace = 0.0 if first and self.queue.kind == "local" else 3.0
                await run_in_threadpool(reconcile, self.repo, self.queue, self.settings.stale_after_s, grace,
                                        self.settings.max_attempts)
            except Exception as exc:
                log.warning("reconcile failed: %s", exc)
            first = False
            await asyncio.sleep(self.settings.reconcile_interval_s)

    # -- plan cache -----------------------------------------------------------------------------------
    def _invalidate(self, message: dict) -> None:
        if message.get("type") == "revision":
            key = message.get("key", ALL)
            cached = self._cache.get(key)
            if cached and cached.revision < int(message.get("revision", 0)):
                self._cache.pop(key, None)

    async def best(self, key: str, fresh: bool = False) -> BestPlan | None:
        """The best plan of `key`, from a short-lived in-process cache invalidated by events."""
        cached = None if fresh else self._cache.get(key)
        if cached is not None:
            return cached

        async def query() -> BestPlan | None:
            best = await run_in_threadpool(self.repo.best, key)
            if best is not None and self._cache.getsizeof(best) <= self._cache.maxsize:
                self._cache[key] = best
            return best

        return await single_flight(self._inflight, key, query)  # concurrent misses share one query

    def lock_for(self, key: str) -> threading.Lock:
        return self._locks[hash(key) % len(self._locks)]
