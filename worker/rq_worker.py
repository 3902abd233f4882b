"""`pipeplan worker`: an RQ worker with low TTLs and the SQL reconciler in its maintenance step.

RQ's defaults leave a killed worker's job "started" for minutes. We do not depend on
RQ noticing: jobs heartbeat in SQL, and every idle worker's maintenance tick (every
`maintenance_interval_s`) re-enqueues runs whose heartbeat went stale, so a SIGKILLed worker's job is
re-run by another worker within stale_after_s + maintenance_interval_s + dequeue time.

RQ's loop ends on any error, a lost Redis included, so `run_worker` starts it again until a stop is
asked for: SIGTERM or SIGINT end an idle worker at once (a busy one after its job, as RQ does; a
second signal kills the job, which is re-run from SQL). A solve left running when the loop broke is
waited for, and reaped, before new work is taken: one solve per worker, no defunct work horses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time

from pipeplan.service.queue import RQQueue
from pipeplan.service.reconcile import reconcile
from rq import Queue, Worker
from rq.exceptions import StopRequested

from pipeplan.settings import Settings

from . import tasks

log = logging.getLogger("pipeplan.worker")


class PipeplanWorker(Worker):
    reconcile_queue: RQQueue | None = None
    settings: Settings | None = None
    stop_requested = False  # RQ records a stop only when busy; idle, its loop just ends

    def handle_warm_shutdown_request(self) -> None:
        self.stop_requested = True
        super().handle_warm_shutdown_request()

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            n = reconcile(tasks._CONTEXT.repo, self.reconcile_queue, self.settings.stale_after_s,
                          max_attempts=self.settings.max_attempts)
            if n:
                log.warning("reconciler re-enqueued %d run(s)", n)
        except StopRequested:  # SIGTERM while idle: RQ's handler raises it wherever the worker is
            raise
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


def _alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (killed, not yet reaped by its parent: a container runtime, a
    shell) is dead, though signal 0 still reaches it; without /proc, signal 0 decides."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _clear_stale_name(connection, name: str) -> None:
    """A worker of this host killed without a goodbye leaves its name registered for worker_ttl + 60 s;
    when that worker's process is gone, record its death so the name can be taken at once."""
    key = Worker.redis_worker_namespace_prefix + name
    data = connection.hmget(key, ["hostname", "pid", "death"])
    hostname, pid, death = (v.decode() if isinstance(v, bytes) else v for v in data)
    if hostname is None or death or hostname != socket.gethostname() or not pid or not pid.isdigit():
        return
    if _alive(int(pid)):
        return  # a real second worker with this name
    connection.hset(key, "death", "stale")
    log.info("worker name %s was held by dead pid %s; taken over", name, pid)


def _stop_on_signals() -> None:
    """Outside RQ's loop (waiting for Redis or for a solve, between restarts) SIGTERM and SIGINT end
    the worker at once; RQ's own handlers, which talk to Redis, are replaced until its loop restarts."""
    def stop(signum, frame) -> None:
        log.info("worker stopping on %s", signal.Signals(signum).name)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _wait_for_horse(worker: Worker) -> None:
    """A work horse left running when RQ's loop broke (Redis went away mid-job) keeps solving: its
    state is in SQL. Wait for it before taking new work (one solve per worker) and reap it (no
    defunct process). A stop meanwhile kills it, as RQ's cold shutdown does; SQL re-runs its job."""
    pid = worker.horse_pid
    if not pid:
        return
    log.warning("waiting for the running solve (work horse %d) to end before taking new work", pid)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    except SystemExit:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the horse leads its own process group (RQ's setpgrp)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise


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
    restarted: str | None = None  # the name this process's previous loop registered
    while True:
        _stop_on_signals()
        worker = None
        try:
            wait_for_redis(q.connection, settings.redis_url)
            if restarted:  # ours, whatever is left of it (a work horse may have written it after the loss)
                q.connection.hset(Worker.redis_worker_namespace_prefix + restarted, "death", "restarted")
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
            _stop_on_signals()
            # RQ's loop quits (and returns) on any error, a lost Redis included: only a stop request
            # or a burst run ends this worker; anything else is waited out and the loop starts again
            if burst or worker.stop_requested:
                return
            log.warning("worker %s quit its loop without a stop request; restarting it", worker.name)
        except _redis_errors() as exc:
            # RQ gives up on the first failed Redis call; a running horse keeps solving (its state is
            # in SQL). Wait for it, wait Redis out, and start again under the same name.
            _stop_on_signals()
            log.warning("lost Redis (%s); reconnecting", _first_line(exc))
        if worker is not None:
            restarted = worker.name
            _wait_for_horse(worker)
        time.sleep(1.0)
