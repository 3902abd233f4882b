"""`pipeplan worker`: an RQ worker with low TTLs and the SQL reconciler in its maintenance step.

RQ's defaults leave a killed worker's job "started" for minutes (DESIGN.md §6). We do not depend on
RQ noticing: jobs heartbeat in SQL, and every idle worker's maintenance tick (every
`maintenance_interval_s`) re-enqueues runs whose heartbeat went stale, so a SIGKILLed worker's job is
re-run by another worker within stale_after_s + maintenance_interval_s + dequeue time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

from pipeplan.service.queue import RQQueue
from pipeplan.service.reconcile import reconcile
from rq import Queue, Worker

from pipeplan.settings import Settings

from . import tasks

log = logging.getLogger("pipeplan.worker")


class PipeplanWorker(Worker):
    reconcile_queue: RQQueue | None = None
    settings: Settings | None = None

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            n = reconcile(tasks._CONTEXT.repo, self.reconcile_queue, self.settings.stale_after_s,
                          max_attempts=self.settings.max_attempts)
            if n:
                log.warning("reconciler re-enqueued %d run(s)", n)
        except Exception as exc:  # DB or Redis blinked: try again next tick
            log.warning("reconcile failed: %s", exc)


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _where(url: str) -> str:
    """The Redis URL without its credentials, for messages."""
    return url.split("@")[-1]


def wait_for_redis(connection, url: str, give_up_s: float | None = None) -> None:
    """Ping until Redis answers: exponential backoff (0.5 s .. 10 s, tenacity), one log line per outage."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_delay, stop_never, wait_exponential

    said = False

    def say(state) -> None:
        nonlocal said
        if not said:
            said = True
            log.warning("Redis at %s is unreachable (%s); retrying with backoff", _where(url),
                        _first_line(state.outcome.exception()))

    for attempt in Retrying(retry=retry_if_exception_type(_redis_errors()),
                            wait=wait_exponential(multiplier=0.5, max=10),
                            stop=stop_after_delay(give_up_s) if give_up_s else stop_never,
                            before_sleep=say, reraise=True):
        with attempt:
            connection.ping()
    if said:
        log.warning("Redis at %s is reachable again", _where(url))


def _clear_stale_name(connection, name: str) -> None:
    """A worker of this host killed without a goodbye leaves its name registered for worker_ttl + 60 s;
    when that worker's process is gone, record its death so a restart can take the name at once."""
    key = Worker.redis_worker_namespace_prefix + name
    data = connection.hmget(key, ["hostname", "pid", "death"])
    hostname, pid, death = (v.decode() if isinstance(v, bytes) else v for v in data)
    if hostname is None or death or hostname != socket.gethostname() or not pid:
        return
    try:
        os.kill(int(pid), 0)
        if int(pid) != os.getpid():
            return  # alive: a real second worker with this name
    except ProcessLookupError:
        pass
    except (PermissionError, ValueError):
        return
    connection.hset(key, "death", "stale")
    log.info("worker name %s was held by dead pid %s; taken over", name, pid)


def run_worker(settings: Settings, burst: bool = False, name: str | None = None) -> None:
    """Work the queue until stopped; a Redis outage of any length is waited out, not fatal."""
    from pipeplan.service.db import make_engine
    from pipeplan.service.schema import ensure_schema

    if not settings.redis_url:
        raise SystemExit("error: set PIPEPLAN_REDIS_URL (and PIPEPLAN_DATABASE_URL) to run a worker")
    q = RQQueue(settings.redis_url, settings.queue_name, settings.job_timeout_margin_s)
    try:
        q.connection.ping()
    except _redis_errors() as exc:
        raise SystemExit(f"error: cannot reach Redis at {_where(settings.redis_url)}:"
                         f" {_first_line(exc)}") from None
    ensure_schema(make_engine(settings.resolved_database_url, 1), settings.should_auto_migrate)
    ctx = tasks.configure(settings)
    try:  # import once in the parent, not in every forked horse
        import pipeplan.planner.solver  # noqa: F401
    except ImportError as exc:
        log.warning("planner.solver not importable yet: %s", exc)
    PipeplanWorker.reconcile_queue = q
    PipeplanWorker.settings = settings
    while True:
        try:
            wait_for_redis(q.connection, settings.redis_url)
            if name:
                _clear_stale_name(q.connection, name)
            worker = PipeplanWorker(
                [Queue(settings.queue_name, connection=q.connection)], connection=q.connection, name=name,
                worker_ttl=settings.worker_ttl_s, maintenance_interval=settings.maintenance_interval_s,
                job_monitoring_interval=settings.job_monitoring_interval_s,
            )
            ctx.name = f"{worker.name}@{socket.gethostname()}"
            log.info("worker %s on queue %s (db %s)", worker.name, settings.queue_name,
                     ctx.repo.engine.url.render_as_string(hide_password=True))
            worker.work(burst=burst, logging_level="INFO", with_scheduler=False)
            # RQ's loop quits (and returns) on any error, a lost Redis included: only a stop request
            # or a burst run ends this worker; anything else is waited out and the loop starts again
            if burst or getattr(worker, "_stop_requested", False):
                return
            log.warning("worker %s quit its loop without a stop request; restarting it", worker.name)
            time.sleep(1.0)
        except _redis_errors() as exc:
            # RQ gives up on the first failed Redis call; a running horse keeps solving (its state is
            # in SQL) and the reconciler re-runs it if it dies. Wait Redis out and start again.
            log.warning("lost Redis (%s); reconnecting", _first_line(exc))
            if name:
                with contextlib.suppress(Exception):
                    wait_for_redis(q.connection, settings.redis_url)
                    q.connection.hset(Worker.redis_worker_namespace_prefix + name, "death", "reconnected")
