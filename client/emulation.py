"""Emulated time: ops that take the duration a problem gives them, so fidelity is testable on CPU.

With an `Emulation`, the executor pads every compute op (F, B, W, BW, RECOMPUTE) to the duration
`costs` gives it and every copy (OFFLOAD, RELOAD) to its duration on its copy lane: the real work
runs first (a small model, so gradients are still real and checked), then a timed wait, which
releases the GIL, fills the rest. Many ranks then execute a plan with known op costs on a machine
with few cores, because they mostly sleep. `costs` need not be the planned problem: giving a stage
longer costs than the plan assumed emulates a slow stage.

The wait targets the op's absolute end (its start plus its duration), so the real work's own time is
absorbed, and it ends on time rather than late: a plain `time.sleep` wakes up 50-100 µs after its
deadline on Linux (the thread's default timer slack is 50 µs, plus the wake-up), which over the
~30 ops of a critical path is a systematic +0.4% on 20-ms ops. So the thread's timer slack is set
to 1 ns (Linux, best effort) and the wait sleeps until `SPIN_S` before the deadline, then yields
until it (`time.sleep(0)`, which releases the GIL for the copy-lane threads).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from dataclasses import dataclass

from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind, Op, duration

SPIN_S = 2e-4  # the last stretch of a wait, yielded rather than slept (longer than a wake-up's lateness)
_PR_SET_TIMERSLACK = 29
_thread = threading.local()


def _tighten_timer_slack() -> None:
    """Once per thread: wake-ups from sleep as close to their deadline as the kernel allows."""
    if getattr(_thread, "slack_set", False):
        return
    _thread.slack_set = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def wait_until(deadline_s: float) -> None:
    """Return at `deadline_s` (time.perf_counter), not noticeably after it."""
    _tighten_timer_slack()
    remaining = deadline_s - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline_s:
        time.sleep(0)


@dataclass(frozen=True)
class Emulation:
    """Target durations from `costs` (a problem v1), multiplied by `scale`."""

    costs: Problem
    scale: float = 1.0

    def duration_ms(self, kind: Kind, stage: int) -> float:
        return duration(self.costs, Op(kind, stage, 0)) * self.scale

    def pad(self, kind: Kind, stage: int, started_s: float) -> None:
        """Wait until `started_s` (time.perf_counter) plus the op's emulated duration."""
        wait_until(started_s + self.duration_ms(kind, stage) / 1000.0)
