"""Emulated time: ops that take the duration a problem gives them, so fidelity is testable on CPU.

With an `Emulation`, the executor pads every compute op (F, B, W, BW, RECOMPUTE) to the duration
`costs` gives it and every copy (OFFLOAD, RELOAD) to its duration on its copy lane: the real work
runs first (a small model, so gradients are still real and checked), then a timed wait, which
releases the GIL, fills the rest. Many ranks then execute a plan with known op costs on a machine
with few cores, because they mostly sleep. `costs` need not be the planned problem: giving a stage
longer costs than the plan assumed emulates a slow stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.contract import Problem
from planner.ops import Kind, Op, duration


@dataclass(frozen=True)
class Emulation:
    """Target durations from `costs` (a problem v1), multiplied by `scale`."""

    costs: Problem
    scale: float = 1.0

    def duration_ms(self, kind: Kind, stage: int) -> float:
        return duration(self.costs, Op(kind, stage, 0)) * self.scale

    def pad(self, kind: Kind, stage: int, started_s: float) -> None:
        """Sleep until `started_s` (time.perf_counter) plus the op's emulated duration."""
        remaining = started_s + self.duration_ms(kind, stage) / 1000.0 - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
