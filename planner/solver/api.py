"""`solve`: seed with the best heuristic (and a stored plan), then improve under a time limit,
streaming every strictly better validated plan (TEAM.md interface)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ..bounds import ALL, QUICK, check_memory_feasible, known, lower_bound
from ..contract import Plan, Problem
from ..iteration import iteration_bound
from ..simulator import build_plan, schedule_from_plan, simulate
from ..validator import validate_plan
from .incumbent import Incumbent
from .scaling import scale_for

log = logging.getLogger(__name__)

ENGINES = ("auto", "cpsat", "lns", "milp")
# "auto" first gives the whole-problem CP-SAT model this share of the time (it proves optima and
# bounds on small problems), then large-neighbourhood search, which improves big problems faster
# (measured: see docs/optimizer.md). Above LNS_PAIRS (stage, microbatch) pairs the whole model is
# skipped: presolve alone eats the budget.
WHOLE_SHARE = 0.25
WHOLE_MAX_S = 10.0
LNS_PAIRS = 1024


@dataclass
class SolveResult:
    plan: Plan
    lower_bound_ms: float
    solver_bound_ms: float | None
    status: str  # "optimal" only when proven
    engine: str
    seed_method: str
    time_to_first_s: float
    elapsed_s: float
    improvements: int
    # Why the search ended, so callers never call a spent budget "converged": "optimal" (proven: the
    # makespan meets a proven bound or CP-SAT proved it), "budget" (the time limit ran out with a gap),
    # "stalled" (the engines gave up before the deadline without proof, e.g. no improving LNS window)
    # or "stopped" (the caller's stop event).
    outcome: str
    history: list[tuple[float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def makespan_ms(self) -> float:
        return self.plan.makespan_ms

    @property
    def gap(self) -> float:
        return self.plan.gap


def default_workers() -> int:
    """CP-SAT workers when the caller names none: one per core, at most 8 (more than the cores only
    slows CP-SAT down). The planner reads no app settings (imports point down): the worker and the
    CLI pass `Settings.solver_workers`, which is None, so this rule, unless set."""
    return max(1, min(8, os.cpu_count() or 1))


# Cheapest baselines first, so the first plan streams within a fraction of a second; greedy (usually
# the best) before the offload baselines. adaoffload takes 12 s at P=32, M=128 and is skipped on big
# problems once a pipelined plan exists; pipeoffload (2.4 s there) still runs as a seed: its fixed
# dense orders are a family greedy's list scheduling does not produce.
SEED_ORDER = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "greedy", "pipeoffload", "adaoffload",
              "gpipe")
SLOW_ON_LARGE = ("adaoffload",)


def _seed(problem: Problem, key: str, hint: Plan | None, inc: Incumbent, notes: list[str],
          stop: threading.Event | None, deadline: float = float("inf")) -> None:
    """Offer the hint and every baseline (planner.baselines) as it is built; the incumbent keeps the
    best. Equivalent to best_heuristic, but the first fitting plan is out at once. Once a plan exists,
    a stop or the deadline ends the seeding (a spent budget is a normal end: a 20-s refine of a big
    problem used to seed for 78 s)."""
    if hint is not None:
        h = _adapt_hint(problem, key, hint)
        if h is not None:
            inc.offer(h)
        else:
            notes.append("hint plan does not fit this problem; ignored")
    from ..baselines import HEURISTIC_NAMES, best_heuristic, is_large, run_baseline

    large = is_large(problem)
    # torch's generators are peers to compare with, not seeds: they give our own orders (zb-h1, zb-v)
    # and importing torch costs a fresh worker 3-4 s of its budget
    names = [n for n in SEED_ORDER if n in HEURISTIC_NAMES]
    names += [n for n in HEURISTIC_NAMES if n not in SEED_ORDER]
    if any(problem.limit_of(d) != float("inf") for d in range(problem.num_devices)):
        _offer_serialized(problem, key, inc)  # fits any feasible budget, in milliseconds
    for name in names:
        if inc.plan is not None:
            if time.monotonic() >= deadline:
                notes.append(f"seeding ended at the deadline before {name}")
                return
            if stop is not None and stop.is_set():
                return
        if large and name in SLOW_ON_LARGE and inc.plan is not None and "serialized" not in inc.plan.method:
            continue
        try:
            inc.offer(run_baseline(problem, name, key))
        except Exception as exc:  # noqa: BLE001 - NotApplicable, DoesNotFit, or a heuristic's bug
            log.debug("baseline %s gave no seed: %s", name, exc)
    if inc.plan is None:
        try:
            inc.offer(best_heuristic(problem, problem_key=key))  # its serialized fallback always fits
        except Exception as exc:
            log.exception("best_heuristic failed")
            notes.append(f"best_heuristic failed: {exc}")


def _widen_greedy(problem: Problem, key: str, inc: Incumbent, keep_going: Callable[[], bool],
                  notes: list[str]) -> None:
    """The seed's greedy tries only `inline_runs` variants (it must answer inline); the solver has
    the time for all of them (about 25 at ~0.6 s each at P=32, M=128). Measured there at half memory
    with 3-ms copies: 456.7 -> 453.5, about what the CP-SAT windows gain in two minutes; on
    Llama-2-13B over 16 GPUs at 24 GiB (13 inline runs of 36) the rest found 4856 against 5126."""
    from ..baselines.greedy import greedy_outcome, inline_runs

    try:
        # each new best as it is found (the extra passes take tens of seconds at P=16), the result the
        # last of them; the incumbent keeps one only if it is better, and validates it first
        greedy_outcome(problem, inline=False, keep_going=keep_going, skip=inline_runs(problem),
                       on_better=lambda better: inc.offer(better.plan(key, validate=False)))
    except Exception as exc:  # noqa: BLE001 - only an extra seed; the engines follow
        log.debug("widened greedy gave no plan: %s", exc)
        notes.append(f"widened greedy failed: {exc}")


def _offer_serialized(problem: Problem, key: str, inc: Incumbent) -> None:
    """best_heuristic's own fallback (one microbatch at a time), offered first under a memory limit:
    slow, but out at once while the other baselines are still being built."""
    try:
        from ..baselines.classic import serialized_schedule
        from ..baselines.common import finalize

        inc.offer(finalize(problem, serialized_schedule(problem), "serialized", key))
    except Exception as exc:  # noqa: BLE001 - only a head start; the baselines follow
        log.debug("serialized seed failed: %s", exc)


def _adapt_hint(problem: Problem, key: str, hint: Plan) -> Plan | None:
    """The hint itself when valid here, else its orders re-timed on this problem (a stored plan of a
    near-identical configuration)."""
    try:
        if hint.problem_key == key and not validate_plan(problem, hint, key):
            return hint
        schedule = schedule_from_plan(hint)
        plan = build_plan(problem, schedule, simulate(problem, schedule), f"hint ({hint.method})", key)
        return plan if not validate_plan(problem, plan, key) else None
    except Exception:  # noqa: BLE001 - a bad hint is ignored, never fatal
        return None


def solve(problem: Problem, time_limit_s: float, on_improvement: Callable[[Plan], None] | None = None,
          stop: threading.Event | None = None, hint: Plan | None = None, engine: str = "auto",
          workers: int | None = None, seed: int = 0, deterministic: bool = False,
          problem_key: str | None = None, bounds: Collection[str] = ALL) -> SolveResult:
    """Best plan found within `time_limit_s`. Raises MemoryInfeasibleError for impossible budgets.

    `bounds` names the planner.bounds arguments the solve may assume (as the model's floor, and to
    call a plan optimal); a test's oracle leaves out the ones it checks. Plans still carry the
    simulator's `lower_bound_ms`."""
    if engine not in ENGINES:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
    started = time.monotonic()
    deadline = started + max(0.0, time_limit_s)
    check_memory_feasible(problem)
    key = problem_key or problem.key()
    workers = max(1, workers or default_workers())
    notes: list[str] = []
    assumed = known(bounds)
    lb = lower_bound(problem, assumed & QUICK)
    memory_lb = lower_bound(problem, assumed - QUICK)  # the per-device programs
    inc = Incumbent(problem, key, on_improvement, started, floor_ms=max(lb, memory_lb))
    if memory_lb > lb:  # every plan, heuristic seeds included, carries the stronger bound
        inc.raise_bound(memory_lb)

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    def proven() -> bool:
        return inc.plan is not None and inc.meets(max(lb, memory_lb))

    def in_budget(margin_s: float = 0.0) -> bool:
        """Wall-clock time left. A deterministic solve ignores the wall clock (its CP-SAT budget is
        deterministic time), so what it finds does not depend on how loaded the machine is."""
        return deterministic or time.monotonic() < deadline - margin_s

    seeding_deadline = float("inf") if deterministic else deadline
    seeding = threading.Thread(target=_seed, args=(problem, key, hint, inc, notes, stop, seeding_deadline),
                               daemon=True)
    seeding.start()
    while seeding.is_alive():  # a big problem's baselines take seconds: keep honouring stop and the budget
        seeding.join(timeout=0.05)
        if stopped() and inc.plan is not None:
            notes.append("stopped while seeding")
            break
        if not in_budget() and inc.plan is not None:
            notes.append("budget spent while seeding")  # the thread ends before its next baseline
            break
    seed_method = inc.plan.method if inc.plan else "none"
    scale = scale_for(problem)
    pairs = problem.num_stages * problem.num_microbatches
    chosen = engine if engine != "auto" else ("auto" if pairs <= LNS_PAIRS else "lns")
    solver_bound: float | None = memory_lb if memory_lb > lb else None
    engine_proved = False
    if inc.plan is not None and not proven() and not stopped() and in_budget(1.0):
        # in a thread joined up to the deadline: one engine run, or validating its plan, can take
        # seconds on big problems, and a late offer is ignored once the incumbent is closed
        widen = threading.Thread(target=_widen_greedy, daemon=True, args=(
            problem, key, inc, lambda: not stopped() and in_budget(1.0), notes))
        widen.start()
        widen.join(timeout=None if deterministic else max(0.0, deadline - time.monotonic()))
    if not proven() and not stopped() and in_budget():
        budget_s = time_limit_s if deterministic else deadline - time.monotonic()
        bound, engine_proved = _run_engine(chosen, problem, inc, scale, budget_s, deadline, stop, workers,
                                           seed, deterministic, notes)
        if bound is not None:
            solver_bound = max(bound, solver_bound or 0.0)
    inc.close()
    if inc.plan is None:
        raise RuntimeError("no valid plan was found (no heuristic seed and the solver found none)")
    best = inc.plan
    bound = max(lb, solver_bound or 0.0)
    optimal = engine_proved or inc.meets(bound)
    update = {
        "status": "optimal" if optimal else "feasible",
        "solver_bound_ms": min(solver_bound, best.makespan_ms) if solver_bound is not None else best.solver_bound_ms,
    }
    if best.iteration_ms is not None:  # the iteration's bound from the best makespan bound the solve has
        update["iteration_bound_ms"] = min(max(best.iteration_bound_ms or 0.0, iteration_bound(problem, bound)),
                                           best.iteration_ms)
    final = best.model_copy(update=update)
    if optimal:
        outcome = "optimal"
    elif stopped():
        outcome = "stopped"
    else:  # engines that spent the budget return within ~0.2 s of the deadline (lns.run)
        outcome = "budget" if time.monotonic() >= deadline - 0.5 else "stalled"
    return SolveResult(plan=final, lower_bound_ms=lb, solver_bound_ms=solver_bound,
                       status=final.status, engine=chosen, seed_method=seed_method,
                       time_to_first_s=inc.first_at or 0.0, elapsed_s=time.monotonic() - started,
                       improvements=len(inc.history), history=list(inc.history), notes=notes,
                       outcome=outcome)


def _run_engine(engine: str, problem: Problem, inc: Incumbent, scale, remaining: float, deadline: float,
                stop: threading.Event | None, workers: int, seed: int, deterministic: bool,
                notes: list[str]) -> tuple[float | None, bool]:
    """Run `engine` for `remaining` s (CP-SAT) or until the deadline (LNS, MILP); return (solver
    bound in ms or None, proven optimal)."""
    if remaining <= 0.05:
        return None, False
    if engine in ("cpsat", "auto"):
        from . import cpsat

        whole = remaining if engine == "cpsat" else min(WHOLE_MAX_S, WHOLE_SHARE * remaining)
        out = cpsat.run(problem, inc, scale, whole, stop, workers, seed, deterministic)
        notes.append(f"cp-sat {out.status} in {out.wall_s:.1f}s")
        bound = out.bound_ticks / scale.time_scale if (out.bound_ticks is not None and scale.time_exact) else None
        proven = out.status == "OPTIMAL" and scale.time_exact
        if engine == "cpsat" or proven or (stop is not None and stop.is_set()):
            return bound, proven
        engine = "lns"
    else:
        bound = None
    if engine == "lns":
        from . import lns

        lns.run(problem, inc, scale, deadline, stop, workers, seed, deterministic, notes)
        return bound, False
    from . import milp

    return milp.run(problem, inc, deadline, stop, notes)
