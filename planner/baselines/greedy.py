"""The memory-aware greedy scheduler: the list-scheduling engine on the real costs, told every device's
memory limit, run over the passes of `passes.PASSES` (warm-up caps, W policies and offload/recompute
treatments first, then the passes that vary one engine setting of the best attempts); the fastest
attempt that fits wins. The zero-bubble patterns are tried before any of them. When nothing fits,
the serialized schedule (which fits whenever the limits are at least bounds.min_memory) answers, so
greedy always returns a plan for a feasible budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..contract import Plan, Problem
from ..simulator import ScheduleError
from .attempts import Attempt, greedy_tries
from .classic import serialized_schedule
from .common import TIE_TOLERANCE, DoesNotFit, NotApplicable, Outcome, better, evaluate
from .engine import run_engine
from .passes import PASSES, Search, inline_runs
from .treatments import treatments
from .zero_bubble import (
    zb_fill_1p_schedule,
    zb_fill_2p_schedule,
    zb_memory_fit_schedule,
    zb_v_schedule,
)

__all__ = ["Attempt", "greedy_outcome", "greedy_plan", "greedy_tries", "inline_runs", "run_try", "treatments"]

PATTERNS = (("greedy(zb-fill 1p pattern)", zb_fill_1p_schedule),
            ("greedy(zb-fill 2p pattern)", zb_fill_2p_schedule),
            ("greedy(zb-v pattern)", zb_v_schedule),
            ("greedy(zb memory-fit pattern)", zb_memory_fit_schedule))

# The engine's own timing is never earlier than the ASAP re-timing of its orders, and up to a few
# percent later; an attempt is skipped only when its own timing is this much slower than the best.
OWN_TIMING_SLACK = 0.03


def greedy_plan(problem: Problem, problem_key: str | None = None) -> Plan:
    return greedy_outcome(problem).plan(problem_key)


def greedy_outcome(problem: Problem, inline: bool = True, keep_going: Callable[[], bool] = lambda: True,
                   skip: int = 0, tolerance: float = TIE_TOLERANCE,
                   on_better: Callable[[Outcome], None] | None = None) -> Outcome:
    """Fastest fitting attempt, else the serialized schedule; among attempts within `tolerance`
    (relative) of the fastest, the one that offloads fewer MiB, then recomputes less (common.better;
    each already pruned by common.evaluate).

    The zero-bubble patterns (the unit-cost ones re-timed, and ZB-H1 fitted to memory) come first:
    at 1F1B's memory they are often best. Then PASSES in order: `inline` runs only those that are not
    `solver_only`, within their inline budgets (the grid's always until one fits); the solver's run
    (inline=False) runs them all, `skip` leaving out the grid's first attempts, which the inline run
    already tried. `keep_going()` returning False ends the search with the best so far. `on_better`
    sees each outcome that becomes the best, the last of them the result (the solver streams them:
    its passes take tens of seconds); only the serialized fallback is not seen.
    """
    best: Outcome | None = None

    def take(outcome: Outcome | None) -> None:
        """Keep `outcome` if it is better, and tell `on_better`."""
        nonlocal best
        previous, best = best, better(best, outcome, tolerance)
        if on_better is not None and best is not previous:
            on_better(best)

    pattern_fits = False
    for label, build in PATTERNS:
        try:
            take(evaluate(problem, build(problem), label))
            pattern_fits = True
        except (NotApplicable, DoesNotFit, ScheduleError):
            continue
    search = Search(problem, treatments(problem, pattern_fits))

    def run(attempt: Attempt, late: list[tuple[float, Attempt]]) -> None:
        """Keep the attempt's outcome if it is better; note a late-forward attempt's makespan in
        `late` (inf: it blocked, or was skipped as slower)."""
        outcome = run_try(problem, attempt, slower_than=best)
        take(outcome)
        if outcome is not None:
            search.ranked.append((outcome.makespan, attempt))
        if attempt.variant.late:
            late.append((outcome.makespan if outcome is not None else math.inf, attempt))

    for step in PASSES:
        late: list[tuple[float, Attempt]] = []
        if not (step.solver_only and inline) and step.applies(search):
            attempts = step.attempts(search)
            budget = step.at_most(problem, inline)
            if step.until_one_fits:
                for runs, attempt in enumerate(attempts[skip:], start=skip):
                    if (runs >= budget or not keep_going()) and best is not None:
                        break
                    run(attempt, late)
            else:
                for attempt in attempts[:budget] if math.isfinite(budget) else attempts:
                    if not keep_going():
                        break
                    run(attempt, late)
        search.late = late
    if best is not None:
        return best
    return evaluate(problem, serialized_schedule(problem), "greedy(serialized)")


def run_try(problem: Problem, attempt: Attempt, slower_than: Outcome | None = None) -> Outcome | None:
    """One attempt, evaluated (pruned, memory checked): ASAP re-timing first, the engine's own timing
    if that breaks a limit. None when the engine blocks, nothing fits, or its own timing is clearly
    slower than `slower_than`."""
    # an op starting after the horizon ends after it too, so the engine may stop there
    # (against the best's makespan before its re-timing: this attempt's own timing is before one too)
    horizon = ((slower_than.before_retime_ms or slower_than.makespan) * (1 + OWN_TIMING_SLACK)
               if slower_than is not None else math.inf)
    schedule = run_engine(problem, attempt.config(problem), give_up_after=horizon)
    if schedule is None:
        return None
    own = schedule.engine_timing  # type: ignore[attr-defined]
    if own.makespan > horizon:
        return None
    for timing in (None, own):
        try:
            return evaluate(problem, schedule, attempt.label, timing)
        except (DoesNotFit, ScheduleError):
            continue
    return None
