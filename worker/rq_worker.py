"""`pipeplan worker`: an RQ worker with low TTLs and the SQL reconciler in its maintenance step.

RQ's defaults leave a killed worker's job "started" for minutes (DESIGN.md §6). We do not depend on
RQ noticing: jobs heartbeat in SQL, and every idle worker's maintenance tick (every
`maintenance_interval_s`) re-enqueues runs whose heartbeat went stale, so a SIGKILLed worker's job is
re-run by another worker within stale_after_s + maintenance_interval_s + dequeue time.
"""

from __future__ import annotations

import logging
import socket

from rq import Queue, Worker

from pipeplan.settings import Settings
from service.queue import RQQueue
from service.reconcile import reconcile

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


def run_worker(settings: Settings, burst: bool = False, name: str | None = None) -> None:
    from service.db import make_engine
    from service.schema import ensure_schema

    if not settings.redis_url:
        raise SystemExit("error: set PIPEPLAN_REDIS_URL (and PIPEPLAN_DATABASE_URL) to run a worker")
    ensure_schema(make_engine(settings.resolved_database_url, 1), settings.should_auto_migrate)
    ctx = tasks.configure(settings)
    try:  # import once in the parent, not in every forked horse
        import planner.solver  # noqa: F401
    except ImportError as exc:
        log.warning("planner.solver not importable yet: %s", exc)

    q = RQQueue(settings.redis_url, settings.queue_name, settings.job_timeout_margin_s)
    PipeplanWorker.reconcile_queue = q
    PipeplanWorker.settings = settings
    worker = PipeplanWorker(
        [Queue(settings.queue_name, connection=q.connection)], connection=q.connection, name=name,
        worker_ttl=settings.worker_ttl_s, maintenance_interval=settings.maintenance_interval_s,
        job_monitoring_interval=settings.job_monitoring_interval_s,
    )
    ctx.name = f"{worker.name}@{socket.gethostname()}"
    log.info("worker %s on queue %s (db %s)", worker.name, settings.queue_name,
             ctx.repo.engine.url.render_as_string(hide_password=True))
    worker.work(burst=burst, logging_level="INFO", with_scheduler=False)
