"""Plan events: "key K has revision N" (and job state changes), fanned out to SSE and long-polls.

Producers (workers, the API) call `publish(key, message)`; consumers in the API process
`subscribe(key)` (or "*" for every key, as the dashboard overview does). With Redis configured the
message travels over Redis pub/sub, so a worker on another machine reaches every API process; without
it the in-process hub delivers directly. Pub/sub is at-most-once: consumers also re-check the database
now and then, so a lost message delays an update but never loses it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

from .outcomes import describe

log = logging.getLogger("pipeplan.events")

ALL = "*"


def revision_message(key: str, revision: int) -> dict[str, Any]:
    return {"type": "revision", "key": key, "revision": revision}


def job_message(key: str, state: str, outcome: str | None = None, gap_pct: float | None = None,
                searched_s: float | None = None, run_improvements: int | None = None) -> dict[str, Any]:
    """A job state change; a finished run also says how it ended (service.outcomes), so SSE clients
    need no second request to tell "optimal" from "budget spent"."""
    message: dict[str, Any] = {"type": "job", "key": key, "state": state}
    if outcome is not None:
        message.update(outcome=outcome, gap_pct=gap_pct, searched_s=searched_s,
                       run_improvements=run_improvements,
                       outcome_text=describe(outcome, gap_pct, searched_s, run_improvements))
    return message


class Publisher(Protocol):
    def publish(self, key: str, message: dict[str, Any]) -> None: ...


class Subscription:
    """An asyncio queue of messages for one key (or ALL); drop-oldest when a consumer falls behind."""

    def __init__(self, key: str, maxsize: int = 256):
        self.key = key
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize)

    def _put(self, message: dict[str, Any]) -> None:
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(message)

    async def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


class Hub:
    """In-process fan-out to asyncio subscribers. `deliver` may be called from any thread."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = defaultdict(set)
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.delivered = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Synchronous callback run on the event loop for every message (cache invalidation)."""
        self._listeners.append(fn)

    def deliver(self, message: dict[str, Any]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._deliver(message)
        else:
            loop.call_soon_threadsafe(self._deliver, message)

    def _deliver(self, message: dict[str, Any]) -> None:
        self.delivered += 1
        for fn in self._listeners:
            try:
                fn(message)
            except Exception:  # a broken listener must not stop delivery
                log.exception("event listener failed")
        with self._lock:
            targets = list(self._subs.get(message.get("key", ""), ())) + list(self._subs.get(ALL, ()))
        for sub in targets:
            sub._put(message)

    @contextmanager
    def subscribe(self, key: str) -> Iterator[Subscription]:
        sub = Subscription(key)
        with self._lock:
            self._subs[key].add(sub)
        try:
            yield sub
        finally:
            with self._lock:
                self._subs[key].discard(sub)
                if not self._subs[key]:
                    del self._subs[key]

    def subscriber_count(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._subs.values())


class LocalPublisher:
    """Embedded mode: publish straight into this process's hub."""

    def __init__(self, hub: Hub):
        self.hub = hub

    def publish(self, key: str, message: dict[str, Any]) -> None:
        self.hub.deliver(message)


class RedisPublisher:
    """Workers (any machine) and API processes publish on one Redis channel."""

    def __init__(self, redis_url: str, channel: str):
        import redis

        self.channel = channel
        self.client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)

    def publish(self, key: str, message: dict[str, Any]) -> None:
        try:
            self.client.publish(self.channel, json.dumps(message))
        except Exception as exc:  # the SQL row is the truth; a lost event only delays a consumer
            log.warning("could not publish %s for %s: %s", message.get("type"), key[:12], exc)


class RedisListener:
    """Feeds the hub from the Redis channel, reconnecting with backoff after Redis goes away."""

    def __init__(self, redis_url: str, channel: str, hub: Hub):
        self.redis_url, self.channel, self.hub = redis_url, channel, hub
        self._task: asyncio.Task | None = None
        self.connected = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pipeplan-redis-listener")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        import redis.asyncio as aioredis

        backoff = 0.2
        while True:
            client = aioredis.Redis.from_url(self.redis_url)
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                self.connected, backoff = True, 0.2
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        self.hub.deliver(json.loads(msg["data"]))
                    except (ValueError, TypeError):
                        log.warning("ignoring malformed event %r", msg.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected = False
                log.warning("redis event listener: %s; reconnecting in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                self.connected = False
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except Exception:
                    pass


class EventBus:
    """What the API and the dashboard use: publish(key, message) and `with subscribe(key) as sub`."""

    def __init__(self, hub: Hub, publisher: Publisher):
        self.hub, self.publisher = hub, publisher

    def publish(self, key: str, message: dict[str, Any]) -> None:
        self.publisher.publish(key, message)

    def publish_revision(self, key: str, revision: int) -> None:
        self.publish(key, revision_message(key, revision))

    def subscribe(self, key: str):
        return self.hub.subscribe(key)
