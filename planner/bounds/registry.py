"""Every lower-bound argument under its name, and the bound they prove together.

An argument is a function from a problem to a makespan no valid plan beats (0.0 where it says
nothing). `lower_bound` takes the largest of the arguments asked for, `prove` also says which one
is tight. Adding an argument is one module with its function and one line in ARGUMENTS.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..contract import Problem
from .arrivals import arrival_bound
from .backward_stretches import backward_stretches_bound
from .cool_down import cool_down_bound
from .forward_count import forward_count_bound
from .memory_free import memory_free_bound
from .occupancy import occupancy_bound
from .one_at_a_time import one_at_a_time_bound
from .pairwise_exclusion import pairwise_exclusion_bound
from .stage_tail import stage_tail_bound
from .warmup import warmup_bound


@dataclass(frozen=True)
class Argument:
    """One proof. `quick`: closed form, so every plan carries it (Plan.lower_bound_ms, computed by
    the simulator for each plan); otherwise it solves a small program per device and is computed
    once per solve (the solvers' floor, reported as solver_bound_ms)."""

    name: str
    bound: Callable[[Problem], float]
    quick: bool
    summary: str


ARGUMENTS: tuple[Argument, ...] = (
    Argument("memory_free", memory_free_bound, True, "critical path and each device's work"),
    Argument("arrivals", arrival_bound, True, "forwards reach a device no faster than they are made"),
    Argument("warm_up", warmup_bound, True, "memory caps the forwards before a device's first backward"),
    Argument("one_at_a_time", one_at_a_time_bound, True, "a device that holds one activation at a time"),
    Argument("stage_tail", stage_tail_bound, True,
             "each stage's last backward: the work before it, its chain after"),
    Argument("forward_count", forward_count_bound, False, "forwards before the first free; the drain; W's"),
    Argument("occupancy", occupancy_bound, False, "memory x time is a budget (Little's law)"),
    Argument("pairwise_exclusion", pairwise_exclusion_bound, False, "residency that cannot coexist"),
    Argument("cool_down", cool_down_bound, False,
             "memory x time less what the warm-up and cool-down leave unused"),
    Argument("backward_stretches", backward_stretches_bound, False,
             "one activation at a time: every stretch but one after the first backward"),
)
BY_NAME = {a.name: a for a in ARGUMENTS}
ALL = frozenset(BY_NAME)
QUICK = frozenset(a.name for a in ARGUMENTS if a.quick)


@dataclass(frozen=True)
class Proof:
    """The bound (ms), the argument that gives it (None when none says anything) and every value."""

    ms: float
    tight: str | None
    values: dict[str, float]


def known(arguments: Collection[str]) -> frozenset[str]:
    """`arguments` as a set of names; ValueError naming the first that is not in ARGUMENTS."""
    unknown = sorted(set(arguments) - ALL)
    if unknown:
        raise ValueError(f"unknown bound argument {unknown[0]!r}; choose from {', '.join(BY_NAME)}")
    return frozenset(arguments)


def prove(problem: Problem, arguments: Collection[str] = QUICK) -> Proof:
    """The largest of `arguments` (names in ARGUMENTS) on `problem`; ties go to the first listed."""
    arguments = known(arguments)
    values = {a.name: a.bound(problem) for a in ARGUMENTS if a.name in arguments}
    ms = max(values.values(), default=0.0)
    tight = next((name for name, v in values.items() if v == ms), None) if ms > 0.0 else None
    return Proof(ms, tight, values)


def lower_bound(problem: Problem, arguments: Collection[str] = QUICK) -> float:
    """No valid plan of `problem` is faster (ms): the largest of `arguments`, by default the quick
    ones every plan carries; `ALL` adds the solvers' programs."""
    return prove(problem, arguments).ms
