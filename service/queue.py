"""The job queue behind one interface: RQ on Redis (production) or an in-process thread pool (embedded).

The queue only carries "run `run_id` of key K"; what to do, and whether it is still wanted, lives
in SQL (see worker.tasks.run_job), so a queue that loses, duplicates or replays messages costs at
most a wasted dequeue, never a wrong plan.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

log = logging.getLogger("pipeplan.queue")

RQ_TASK = "pipeplan.worker.tasks.rq_refine"


class JobQueue(Protocol):
    kind: str

    def enqueue(self, key: str, run_id: str, budget_s: float) -> None: ...
    def exists(self, run_id: str) -> bool: ...
    def depth(self) -> int: ...
    def ping(self) -> None: ...
    def close(self) -> None: ...


class RQQueue:
    """Redis + RQ. Job id = run id, so a re-enqueue of the same run is a no-op overwrite."""

    kind = "redis"

    def __init__(self, redis_url: str, name: str, timeout_margin_s: float = 60.0):
        import redis
        from rq import Queue

        self.connection = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self.queue = Queue(name, connection=self.connection)
        self.margin = timeout_margin_s

    def enqueue(self, key: str, run_id: str, budget_s: float) -> None:
        self.queue.enqueue(
            RQ_TASK, key, run_id, job_id=run_id, job_timeout=int(budget_s + self.margin),
            result_ttl=600, failure_ttl=86400, description=f"refine {key[:12]}",
        )

    def exists(self, run_id: str) -> bool:
        from rq.exceptions import NoSuchJobError
        from rq.job import Job

        try:
            status = Job.fetch(run_id, connection=self.connection).get_status(refresh=False)
        except NoSuchJobError:
            return False
        return str(getattr(status, "value", status)) in ("queued", "started", "deferred", "scheduled")

    def depth(self) -> int:
        return self.queue.count

    def ping(self) -> None:
        self.connection.ping()

    def close(self) -> None:
        self.connection.close()


class LocalQueue:
    """Embedded mode: `workers` threads in this process run the same job function as RQ workers."""

    kind = "local"

    def __init__(self, runner: Callable[[str, str], object], workers: int = 1):
        self.runner = runner
        self.shutdown = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="pipeplan-job")
        self._known: dict[str, str] = {}  # run_id -> "queued" | "started"
        self._lock = threading.Lock()
        self.enabled = workers > 0

    def enqueue(self, key: str, run_id: str, budget_s: float) -> None:
        if not self.enabled or self.shutdown.is_set():
            return
        with self._lock:
            if run_id in self._known:
                return
            self._known[run_id] = "queued"
        self._pool.submit(self._run, key, run_id)

    def _run(self, key: str, run_id: str) -> None:
        with self._lock:
            self._known[run_id] = "started"
        try:
            if not self.shutdown.is_set():
                self.runner(key, run_id)
        except Exception:
            log.exception("embedded job %s failed", run_id)
        finally:
            with self._lock:
                self._known.pop(run_id, None)

    def exists(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._known

    def depth(self) -> int:
        with self._lock:
            return sum(1 for s in self._known.values() if s == "queued")

    def ping(self) -> None:
        if self.shutdown.is_set():
            raise RuntimeError("the embedded worker pool is shut down")

    def close(self) -> None:
        self.shutdown.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
