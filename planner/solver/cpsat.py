"""One CP-SAT run over the model (the whole problem, or a neighbourhood of the incumbent), streaming
every solution into the incumbent and stopping at the deadline or when asked."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from ..contract import Problem
from ..ops import duration
from .convert import plan_from_ticks, ticks_of_plan
from .cpsat_model import CpsatModel, ModelOptions
from .incumbent import Incumbent
from .scaling import Scale

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    status: str  # CP-SAT status name
    bound_ticks: float | None  # the makespan bound (ticks) the model's objective bound proves, when meaningful
    hint_ok: bool | None  # did the model accept the complete hint (checked only when asked)
    wall_s: float
    solution: tuple | None = None  # (starts, choices) of the last solution, in ticks
    # seconds from the call to the first solution (with a feasible hint: the hint itself, so about
    # what building, loading and presolving the model cost); None when none came
    first_s: float | None = None


class _Callback(cp_model.CpSolverSolutionCallback):
    def __init__(self, built: CpsatModel, inc: Incumbent, scale: Scale, method: str, prove: bool):
        super().__init__()
        self.built, self.inc, self.scale, self.method, self.prove = built, inc, scale, method, prove
        self.errors = 0
        self.target_ms = inc.floor_ms
        self.first_at: float | None = None

    def on_solution_callback(self) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        try:  # an exception escaping a solver callback can abort the process: keep it here
            starts, choices = self.built.read(self.value, self.boolean_value)
            bound = None
            if self.prove and self.scale.time_exact:
                bound = self.built.makespan_bound(self.best_objective_bound) / self.scale.time_scale
                self.inc.raise_bound(bound)
            plan = plan_from_ticks(self.built.p, starts, choices, self.scale, self.method, self.inc.key, bound)
            self.inc.offer(plan, (starts, choices))
            if self.inc.meets(self.target_ms):
                self.stop_search()  # the incumbent meets the lower bound: nothing left to find
        except Exception:
            self.errors += 1
            log.exception("CP-SAT solution callback failed")


def solver_params(solver: cp_model.CpSolver, seconds: float, workers: int, seed: int,
                  deterministic: bool) -> None:
    p = solver.parameters
    p.num_workers = max(1, workers)
    p.random_seed = seed
    p.max_time_in_seconds = max(0.05, seconds)
    if deterministic:
        p.num_workers = 1
        p.max_deterministic_time = max(0.05, seconds)
        p.max_time_in_seconds = max(0.05, seconds) * 4  # safety only; the deterministic limit rules


def horizon_and_hint(problem: Problem, inc: Incumbent, scale: Scale):
    """Integer starts of the incumbent (from its solver ticks when it has them) and the horizon."""
    if inc.ticks is not None:
        starts, choices = inc.ticks
    elif inc.plan is not None:
        starts, choices = ticks_of_plan(problem, inc.plan, scale)
    else:
        return None, None, sum_of_work(problem, scale)
    return starts, choices, None


def sum_of_work(problem: Problem, scale: Scale) -> int:
    total = 0
    for s in problem.stages:
        total += scale.t(s.forward_ms) + scale.t(s.backward_input_ms) + scale.t(s.backward_weight_ms)
        total += scale.t(s.recompute_ms or 0) + scale.t(s.offload_ms or 0) + scale.t(s.reload_ms or 0)
        total += 2 * scale.t(problem.p2p_ms)
    return total * problem.num_microbatches + 1


def run(problem: Problem, inc: Incumbent, scale: Scale, seconds: float, stop: threading.Event | None,
        workers: int, seed: int = 0, deterministic: bool = False, options: ModelOptions | None = None,
        free: set | None = None, method: str = "cp-sat", check_hint: bool = False,
        log_search: bool = False, base: tuple | None = None, presolve: bool = True,
        free_ops: set | None = None, fix_before: int | None = None) -> RunOutcome:
    """Build, hint, solve. `free` set: a large-neighbourhood step around `base` (ticks; default:
    the incumbent's)."""
    started = time.monotonic()
    options = options or ModelOptions()
    if base is not None:
        starts, choices, work = base[0], base[1], None
    else:
        starts, choices, work = horizon_and_hint(problem, inc, scale)
    if starts is not None:
        t0 = min(starts.values())
        starts = {op: s - t0 for op, s in starts.items()}
    lower = int(inc.floor_ms * scale.time_scale - 1e-6) if scale.time_exact else 0
    vals = None
    # a step's pairs outside `free` keep their modes: built without the others' variables
    kept = None
    if free is not None and choices:
        kept = {pair: ch for pair, ch in choices.items() if pair not in free}
    built = CpsatModel(problem, scale, _horizon(problem, scale, starts, work), lower, options, kept)
    if starts is not None:
        vals = built.assignment(starts, choices)
        if vals is not None:
            built.hint(vals)
        if free is not None:
            built.fix_outside(free, starts, free_ops, fix_before)
    built.tighten()
    hint_ok = None
    if check_hint and vals is not None:
        hint_ok = hint_is_feasible(built, seconds=min(10.0, seconds))
    solver = cp_model.CpSolver()
    remaining = max(0.05, seconds - (time.monotonic() - started))
    solver_params(solver, remaining, workers, seed, deterministic)
    solver.parameters.log_search_progress = log_search
    # Presolve of a P=32, M=128 model alone takes ~5 s here; hinted big runs skip it.
    solver.parameters.cp_model_presolve = presolve
    prove = free is None and not options.fifo
    callback = _Callback(built, inc, scale, method, prove)
    done = threading.Event()
    watcher = None
    if stop is not None:
        def watch() -> None:
            while not done.is_set():
                if stop.wait(0.1):
                    solver.stop_search()
                    return
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    try:
        status = solver.solve(built.model, callback)
    finally:
        done.set()
        if watcher is not None:
            watcher.join(timeout=1.0)
    bound = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and prove:
        bound = built.makespan_bound(solver.best_objective_bound)
        if scale.time_exact:
            inc.raise_bound(bound / scale.time_scale)
    solution = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        solution = built.read(solver.value, solver.boolean_value)
    first = callback.first_at - started if callback.first_at is not None else None
    return RunOutcome(solver.status_name(status), bound, hint_ok, time.monotonic() - started, solution, first)


def _horizon(problem: Problem, scale: Scale, starts, work) -> int:
    if starts is None:
        return work
    ends = 0
    for op, s in starts.items():
        ends = max(ends, s + scale.t(duration(problem, op)))
    return ends


def hint_is_feasible(built: CpsatModel, seconds: float = 10.0) -> bool:
    """Does the model accept its hint as a complete feasible solution? (fix every variable to it)"""
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 1
    status = solver.solve(built.model)
    return status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
