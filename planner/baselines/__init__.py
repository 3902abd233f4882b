"""Every classic pipeline schedule as a validated plan, and the best of them for a problem.

`run_baseline(problem, name)` builds one schedule by name; `best_heuristic(problem)` is the fastest
applicable one that fits the memory limits (the service's revision 1 and the solver's hint);
`compare(problem)` lists them all. Each baseline only decides op orders, gates and offload/recompute
sets; planner.simulator times them and planner.validator accepts them before anything is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..bounds import check_memory_feasible, lower_bound
from ..contract import Plan, Problem
from ..ops import Op
from ..validator import InvalidPlanError
from .classic import gpipe_orders, interleaved_schedule, one_f_one_b_orders, serialized_schedule
from .common import DoesNotFit, NotApplicable, Outcome, evaluate, is_large, schedule_of
from .greedy import greedy_outcome
from .offload import adaoffload_outcome, pipeoffload_outcome
from .torch_peers import TORCH_PEERS
from .zero_bubble import zb_h1_orders, zb_h2_orders, zb_v_schedule

# The published schedules under their real names, our heuristics, then torch's own generators re-timed
# by our simulator (peers for comparison; best_heuristic leaves them out, see HEURISTIC_NAMES).
NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "greedy", "pipeoffload",
         "adaoffload", *TORCH_PEERS]
HEURISTIC_NAMES = [name for name in NAMES if name not in TORCH_PEERS]

__all__ = [
    "HEURISTIC_NAMES",
    "NAMES",
    "BaselineResult",
    "DoesNotFit",
    "NotApplicable",
    "baseline_outcome",
    "best_heuristic",
    "compare",
    "is_large",
    "run_baseline",
]


def _gpipe(problem: Problem) -> Outcome:
    return evaluate(problem, schedule_of(problem, gpipe_orders(problem)), "gpipe")


def _one_f_one_b(problem: Problem) -> Outcome:
    return evaluate(problem, schedule_of(problem, one_f_one_b_orders(problem)), "1f1b")


def _interleaved(problem: Problem) -> Outcome:
    schedule, extra = interleaved_schedule(problem)
    label = "interleaved-1f1b" + (f" (+{extra} warm-up)" if extra else "")
    return evaluate(problem, schedule, label)


def _orders(name: str, build: Callable[[Problem], list[list[Op]]]) -> Callable[[Problem], Outcome]:
    def run(problem: Problem) -> Outcome:
        return evaluate(problem, schedule_of(problem, build(problem)), name)
    return run


_BUILDERS: dict[str, Callable[[Problem], Outcome]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved,
    "zb-h1": _orders("zb-h1", zb_h1_orders),
    "zb-h2": _orders("zb-h2", zb_h2_orders),
    "zb-v": lambda problem: evaluate(problem, zb_v_schedule(problem), "zb-v"),
    "greedy": greedy_outcome,
    "pipeoffload": pipeoffload_outcome,
    "adaoffload": adaoffload_outcome,
    **TORCH_PEERS,
}


def _outcome(problem: Problem, name: str) -> Outcome:
    try:
        build = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(NAMES)}") from None
    return build(problem)


def baseline_outcome(problem: Problem, name: str) -> Outcome:
    """Baseline `name` timed but not yet built into a validated plan: cheap to compare several and
    build only the kept one (the service's inline first plan). Raises as run_baseline."""
    return _outcome(problem, name)


def run_baseline(problem: Problem, name: str, problem_key: str | None = None) -> Plan:
    """The validated plan of baseline `name`.

    Raises NotApplicable (placement/options rule it out), DoesNotFit (its schedule exceeds a memory
    limit; the message names the device, what it needs and its limit) or ValueError (unknown name).
    """
    return _outcome(problem, name).plan(problem_key)


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
        except NotApplicable as exc:
            out.append(BaselineResult(name, None, str(exc)))
        except DoesNotFit as exc:
            out.append(BaselineResult(name, None, f"does not fit: {exc.summary(problem)}"))
    return out



def best_heuristic(problem: Problem, problem_key: str | None = None) -> Plan:
    """The fastest applicable baseline plan that fits the memory limits.

    Raises bounds.MemoryInfeasibleError when no schedule at all can fit; otherwise always returns a
    valid plan (the serialized schedule fits any budget at or above bounds.min_memory). Stops early
    at the lower bound; above LARGE_OPS it skips pipeoffload/adaoffload once greedy has a pipelined
    plan, so the service can call it inline.
    """
    check_memory_feasible(problem)
    key = problem_key or problem.key()
    found: list[Outcome] = []
    bound = lower_bound(problem)
    large = is_large(problem)
    for name in HEURISTIC_NAMES:
        if found and min(o.makespan for o in found) <= bound * (1 + 1e-9):
            break  # provably optimal already
        if large and name in ("pipeoffload", "adaoffload") and any(
                not o.method.endswith("(serialized)") for o in found):
            continue  # on large problems greedy's fitting plan stands; these would cost seconds
        try:
            found.append(_outcome(problem, name))
        except (NotApplicable, DoesNotFit):
            continue
    # fastest first; among equally fast ones the one that offloads (then recomputes) least, as better()
    found.sort(key=lambda o: (round(o.makespan, 9), o.transfer_cost))
    for outcome in found:
        try:
            return outcome.plan(key)
        except InvalidPlanError:  # never expected; the next best still gives the caller a plan
            continue
    return evaluate(problem, serialized_schedule(problem), "serialized").plan(key)
