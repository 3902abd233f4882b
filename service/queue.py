"""The job queue behind one interface: RQ on Redis (production) or an in-process thread pool (embedded).

The queue only carries "run `run_id` of key K"; what to do, and whether it is still wanted, lives
in SQL (see worker.tasks.run_job), so a queue that loses, duplicates or replays messages costs at
most a wasted dequeue, never a wrong plan.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Protocol

log = logging.getLogger("pipeplan.queue")

RQ_TASK = "pipeplan.worker.tasks.rq_refine"


class JobQueue(Protocol):
    kind: str

    def enqueue(self, key: str, run_id: str, budget_s: float, at_front: bool = False) -> None: ...
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

    def enqueue(self, key: str, run_id: str, budget_s: float, at_front: bool = False) -> None:
        self.queue.enqueue(
            RQ_TASK, key, run_id, job_id=run_id, job_timeout=int(budget_s + self.margin),
            result_ttl=600, failure_ttl=86400, description=f"refine {key[:12]}", at_front=at_front,
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
    """Embedded mode: `workers` threads in this process run the same job function as RQ workers,
    taking runs from one deque (its front for `at_front` runs, as RQ's LPUSH)."""

    kind = "local"

    def __init__(self, runner: Callable[[str, str], object], workers: int = 1):
        self.runner = runner
        self.shutdown = threading.Event()
        self._pending: deque[tuple[str, str]] = deque()
        self._known: dict[str, str] = {}  # run_id -> "queued" | "started"
        self._ready = threading.Condition()
        self.enabled = workers > 0
        self._threads = [threading.Thread(target=self._work, name=f"pipeplan-job_{i}", daemon=True)
                         for i in range(max(0, workers))]
        for thread in self._threads:
            thread.start()

    def enqueue(self, key: str, run_id: str, budget_s: float, at_front: bool = False) -> None:
        if not self.enabled or self.shutdown.is_set():
            return
        with self._ready:
            if run_id in self._known:
                return
            self._known[run_id] = "queued"
            (self._pending.appendleft if at_front else self._pending.append)((key, run_id))
            self._ready.notify()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self.shutdown.is_set():
                    self._ready.wait()
                if self.shutdown.is_set():
                    return
                key, run_id = self._pending.popleft()
                self._known[run_id] = "started"
            try:
                self.runner(key, run_id)
            except Exception:
                log.exception("embedded job %s failed", run_id)
            finally:
                with self._ready:
                    self._known.pop(run_id, None)

    def exists(self, run_id: str) -> bool:
        with self._ready:
            return run_id in self._known

    def depth(self) -> int:
        with self._ready:
            return len(self._pending)

    def ping(self) -> None:
        if self.shutdown.is_set():
            raise RuntimeError("the embedded worker pool is shut down")

    def close(self) -> None:
        """Stop taking runs; running ones see `shutdown` and hand theirs back (worker.tasks.release)."""
        with self._ready:
            self.shutdown.set()
            self._pending.clear()
            self._known = {r: s for r, s in self._known.items() if s == "started"}
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()
