"""Every classic pipeline schedule as a validated plan, and the best of them for a problem.

`run_baseline(problem, name)` builds one schedule by name; `best_heuristic(problem)` is the fastest
applicable one that fits the memory limits (the service's revision 1 and the solver's hint);
`compare(problem)` lists them all. Each baseline only decides op orders, gates and offload/recompute
sets; planner.simulator times them and planner.validator accepts them before anything is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..bounds import check_memory_feasible
from ..contract import Plan, Problem
from .classic import gpipe_orders, interleaved_schedule, one_f_one_b_orders, serialized_schedule
from .common import DoesNotFit, NotApplicable, finalize, schedule_of
from .greedy import greedy_plan
from .offload import adaoffload_plan, pipeoffload_plan
from .zero_bubble import zb_h1_schedule, zb_h2_schedule, zb_v_schedule

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "greedy", "pipeoffload",
         "adaoffload"]

__all__ = ["NAMES", "NotApplicable", "DoesNotFit", "BaselineResult", "run_baseline", "best_heuristic",
           "compare"]


def _gpipe(problem: Problem, key: str | None) -> Plan:
    return finalize(problem, schedule_of(problem, gpipe_orders(problem)), "gpipe", key)


def _one_f_one_b(problem: Problem, key: str | None) -> Plan:
    return finalize(problem, schedule_of(problem, one_f_one_b_orders(problem)), "1f1b", key)


def _interleaved(problem: Problem, key: str | None) -> Plan:
    schedule, extra = interleaved_schedule(problem)
    label = "interleaved-1f1b" + (f" (+{extra} warm-up)" if extra else "")
    return finalize(problem, schedule, label, key)


def _fixed(name: str, build: Callable[[Problem], object]) -> Callable[[Problem, str | None], Plan]:
    def run(problem: Problem, key: str | None) -> Plan:
        return finalize(problem, build(problem), name, key)
    return run


_BUILDERS: dict[str, Callable[[Problem, str | None], Plan]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved,
    "zb-h1": _fixed("zb-h1", zb_h1_schedule),
    "zb-h2": _fixed("zb-h2", zb_h2_schedule),
    "zb-v": _fixed("zb-v", zb_v_schedule),
    "greedy": greedy_plan,
    "pipeoffload": pipeoffload_plan,
    "adaoffload": adaoffload_plan,
}


def run_baseline(problem: Problem, name: str, problem_key: str | None = None) -> Plan:
    """The validated plan of baseline `name`.

    Raises NotApplicable (placement/options rule it out), DoesNotFit (its schedule exceeds a memory
    limit; the message names the device, what it needs and its limit) or ValueError (unknown name).
    """
    try:
        build = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(NAMES)}") from None
    return build(problem, problem_key)


class BaselineResult(NamedTuple):
    """One row of compare(): the plan, or why there is none (`reason`)."""

    name: str
    plan: Plan | None
    reason: str | None


def compare(problem: Problem, problem_key: str | None = None) -> list[BaselineResult]:
    """Every baseline's plan or the reason it has none, in NAMES order."""
    key = problem_key or problem.key()
    out = []
    for name in NAMES:
        try:
            out.append(BaselineResult(name, run_baseline(problem, name, key), None))
        except (NotApplicable, DoesNotFit) as exc:
            out.append(BaselineResult(name, None, str(exc)))
    return out


def best_heuristic(problem: Problem, problem_key: str | None = None) -> Plan:
    """The fastest applicable baseline plan that fits the memory limits.

    Raises bounds.MemoryInfeasibleError when no schedule at all can fit; otherwise always returns a
    valid plan (the serialized schedule fits any budget at or above bounds.min_memory).
    """
    check_memory_feasible(problem)
    key = problem_key or problem.key()
    best: Plan | None = None
    for name in NAMES:
        try:
            plan = run_baseline(problem, name, key)
        except (NotApplicable, DoesNotFit):
            continue
        if best is None or plan.makespan_ms < best.makespan_ms - 1e-9:
            best = plan
    if best is None:
        best = finalize(problem, serialized_schedule(problem), "serialized", key)
    return best
