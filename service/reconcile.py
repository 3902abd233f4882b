"""Re-enqueue work the queue lost: runs whose worker died (stale heartbeat) and queued runs the
queue no longer knows (Redis flushed or restarted without persistence, API died before enqueueing).

SQL is the source of truth. Every pass is idempotent and safe to run from many processes at once:
`Repository.requeue` swaps the run id conditionally, so only one process re-enqueues a given run.
"""

from __future__ import annotations

import logging

from .models import QUEUED, SOLVING
from .queue import JobQueue
from .repository import Repository, stale_cutoffs

log = logging.getLogger("pipeplan.reconcile")


def reconcile(repo: Repository, queue: JobQueue, stale_after_s: float, queued_grace_s: float = 3.0,
              max_attempts: int = 3) -> int:
    stale_before, queued_before = stale_cutoffs(stale_after_s, queued_grace_s)
    count = 0
    for job in repo.unfinished(stale_before, queued_before):
        if job.state == QUEUED and queue.exists(job.run_id):
            continue
        if job.state == SOLVING and job.attempts >= max_attempts:  # it keeps taking its workers down
            if repo.give_up(job, f"gave up after {job.attempts} attempts: the worker died each time"):
                log.error("job of %s failed: its worker died %d times", job.key[:12], job.attempts)
            continue
        run_id = repo.requeue(job)
        if run_id is None:
            continue
        queue.enqueue(job.key, run_id, job.budget_s)
        count += 1
        log.warning("re-enqueued %s job of %s as %s (was %s)", job.state, job.key[:12], run_id, job.run_id)
    return count
