"""The plan's two copy lanes (device->host, host->device), running beside compute in the plan's order.

A lane is told its ops' order for the iteration (the plan's d2h or h2d list on this rank); the
executor submits each copy when the plan lets it start, and the lane runs them strictly in that
order, one at a time, off the compute path:

- CPU: one worker thread per lane. A copy is a Python callable; the thread runs it when it is the
  next in order and has been submitted. Compute waits only where the caller waits on a copy's `done`.
- CUDA: the copies are issued on a dedicated stream per lane as soon as they are next in order (the
  caller's thread issues them; nothing blocks the host). Ordering on the GPU is the stream's FIFO
  order; the waits are CUDA events (see `client.torch_runtime`).

Both keep the per-lane order the plan gives, whatever order the copies are submitted in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Key = tuple[int, int]  # (stage, mb)


class CopyJob:
    """One copy: `run()` does it; `done` is set when it finished (or failed, with `error`)."""

    __slots__ = ("key", "run", "done", "error")

    def __init__(self, key: Key, run: Callable[[], Any]):
        self.key = key
        self.run = run
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout_s: float = 600.0) -> None:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"copy {self.key} did not finish within {timeout_s} s (is the plan's lane"
                               " order consistent with its compute order?)")
        if self.error is not None:
            raise RuntimeError(f"copy {self.key} failed") from self.error


class OrderedLane:
    """Runs submitted copies in a fixed order; `threaded=False` runs them in the submitting thread."""

    def __init__(self, name: str, *, threaded: bool):
        self.name = name
        self.threaded = threaded
        self._order: list[Key] = []
        self._next = 0
        self._jobs: dict[Key, CopyJob] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name=f"pipeplan-{name}", daemon=True)
            self._thread.start()

    def set_order(self, order: list[Key]) -> None:
        """The copies of the next iteration, in the plan's order on this lane."""
        with self._cv:
            if self._next < len(self._order) and any(k in self._jobs for k in self._order[self._next:]):
                raise RuntimeError(f"{self.name}: cannot change the order with copies pending")
            self._order, self._next, self._jobs = list(order), 0, {}

    def submit(self, job: CopyJob) -> CopyJob:
        with self._cv:
            if job.key not in self._order[self._next:]:
                raise RuntimeError(f"{self.name}: {job.key} is not a pending copy of this lane's order")
            self._jobs[job.key] = job
            self._cv.notify_all()
        if not self.threaded:
            self._issue_ready()
        return job

    def job(self, key: Key) -> CopyJob | None:
        with self._cv:
            return self._jobs.get(key)

    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait for every submitted copy (end of an iteration)."""
        with self._cv:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.wait(timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- running --------------------------------------------------------------------------------------
    def _head(self) -> CopyJob | None:
        if self._next < len(self._order):
            return self._jobs.get(self._order[self._next])
        return None

    def _issue_ready(self) -> None:
        while True:
            with self._cv:
                job = self._head()
                if job is None:
                    return
                self._next += 1
            _execute(job)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and self._head() is None:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._head()
                self._next += 1
            _execute(job)


def _execute(job: CopyJob) -> None:
    try:
        job.run()
    except BaseException as exc:  # surfaced to the compute thread by job.wait()
        job.error = exc
    finally:
        job.done.set()
