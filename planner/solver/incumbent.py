"""The best plan so far, shared by every engine of one solve: only strictly better, validated plans
get in, and the caller's callback can never break the solve."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..bounds import ALL, lower_bound
from ..contract import Plan, Problem
from ..iteration import meets_bounds
from ..transfers import prune_plan, transfer_cost
from ..validator import validate_plan

log = logging.getLogger(__name__)

EPS_MS = 1e-6


class Incumbent:
    def __init__(self, problem: Problem, key: str, on_improvement: Callable[[Plan], None] | None,
                 started: float | None = None, floor_ms: float | None = None):
        self.problem = problem
        self.key = key
        self.on_improvement = on_improvement
        self.started = time.monotonic() if started is None else started
        self.plan: Plan | None = None
        self.ticks = None  # (starts, choices) in the current engine's integer units, when known
        self.history: list[tuple[float, float]] = []  # (elapsed s, makespan ms)
        self.first_at: float | None = None
        self.callback_errors = 0
        self.rejected = 0
        self.solver_bound: float | None = None  # best proven bound of a whole-problem model (ms)
        self.closed = False
        self._lock = threading.RLock()
        self._floor_ms = floor_ms

    @property
    def floor_ms(self) -> float:
        """Every bound the solvers may assume (every planner.bounds argument): given by solve(), which
        has computed both parts, or computed on first use. Once per solve: its integer programs and
        LPs take up to ~0.1 s at P=16, and every LNS step reads it."""
        if self._floor_ms is None:
            self._floor_ms = lower_bound(self.problem, ALL)
        return self._floor_ms

    @property
    def makespan(self) -> float:
        return self.plan.makespan_ms if self.plan else float("inf")

    def meets(self, makespan_bound: float) -> bool:
        """Is the incumbent proven optimal by `makespan_bound` (planner.iteration.meets_bounds)?"""
        return self.plan is not None and meets_bounds(self.problem, self.plan, makespan_bound, EPS_MS)

    def raise_bound(self, bound_ms: float) -> None:
        with self._lock:
            self.solver_bound = max(self.solver_bound or 0.0, bound_ms)

    def close(self) -> None:
        """After the solve returns, late offers (a seeding thread still running) are ignored."""
        with self._lock:
            self.closed = True

    def offer(self, plan: Plan | None, ticks=None) -> bool:
        """Take `plan` if it is valid and better; tell the caller. Never raises.

        Better is lexicographic: a shorter makespan by EPS_MS, else as short and a shorter iteration
        (the gradient reductions and optimizer steps after the pipeline, planner.iteration), else
        both as short and offloading fewer MiB, then recomputing less (a host copy is never free:
        docs/transfers.md). A plan that offloads or recomputes is first stripped of the treatments
        its memory does not need (transfers.prune_plan, times kept, so the makespan is unchanged;
        then `ticks` no longer match and are dropped).
        The callback runs under the lock so that the caller sees plans in improving order even when a
        seeding thread and a solver offer at once."""
        if plan is None:
            return False
        with self._lock:
            if self.closed or plan.makespan_ms >= self.makespan + EPS_MS:
                return False
            try:
                thin = prune_plan(self.problem, plan)
            except Exception:  # a malformed plan: offered as it is, and validation rejects it
                log.exception("pruning a plan's transfers failed")
                thin = plan
            if thin is not plan:
                plan, ticks = thin, None
            if plan.makespan_ms >= self.makespan - EPS_MS and not _shorter_tail(plan, self.plan):
                return False
            if self.solver_bound is not None and (plan.solver_bound_ms or 0.0) < self.solver_bound:
                plan = plan.model_copy(update={"solver_bound_ms": min(self.solver_bound, plan.makespan_ms)})
            violations = validate_plan(self.problem, plan, self.key)
            if violations:
                self.rejected += 1
                log.warning("solver plan rejected: %s", violations[:3])
                return False
            self.plan = plan
            self.ticks = ticks
            elapsed = time.monotonic() - self.started
            self.history.append((elapsed, plan.makespan_ms))
            if self.first_at is None:
                self.first_at = elapsed
            if self.on_improvement is not None:
                try:
                    self.on_improvement(plan)
                except Exception:
                    self.callback_errors += 1
                    log.exception("on_improvement callback raised; solving continues")
        return True


def _shorter_tail(plan: Plan, than: Plan | None) -> bool:
    """Of two plans of one makespan: a shorter iteration, else as short and fewer transfers."""
    if than is None:
        return True
    if abs(plan.end_ms - than.end_ms) > EPS_MS:
        return plan.end_ms < than.end_ms
    return transfer_cost(plan) < transfer_cost(than)
