"""Adaptive pipelines: choose the partition, the placement and the schedule together (issue 7).

Why: a uniform split of a heterogeneous model (a 256k-vocabulary head, MoE or Mamba blocks, MTP heads)
leaves one device the bottleneck, and no schedule can remove that bubble. Following AdaPtis
(co-optimising partition, placement and schedule under a performance model), the search here is:

1. for each placement (loop with 1 or 2 stages per device, V with 2) build partitions: Megatron's
   uniform one, the time-balanced one (exact min-max DP over per-layer F+B+W, embedding and heads
   counted) and a memory-aware bottleneck split (binary search on the largest stage time, a greedy
   feasibility check that also keeps each device's estimated static + in-flight activation memory
   under its limit);
2. evaluate each with the fast heuristics (planner.baselines) and the simulator: predicted iteration
   time and peak memory per device, every limit respected (a schedule that does not fit is rejected);
3. keep a shortlist and improve the best partitions by local moves of layer boundaries around the
   bottleneck device, each move re-evaluated by the simulator (first improvement, time-boxed);
4. run the optimizer (planner.solver.solve, hinted with the heuristic plan) on the best few.

The result is an ordinary problem v1 (layer ranges in metadata["partition"]) and a validated plan v1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .bounds import MemoryInfeasibleError, check_memory_feasible
from .contract import Plan, Problem
from .costmodel import LayerCost, build_problem, layer_costs
from .ops import COMPUTE_KINDS, Kind
from .partition import Proxy, partitions_for, uniform_partition
from .spec import Spec

# Schedules tried per placement (the heuristics say NotApplicable for the others anyway; listing
# them saves the time of asking). Cheapest first.
SCHEDULES = {
    "loop1": ["1f1b", "zb-h1", "zb-h2", "greedy", "adaoffload", "pipeoffload"],
    "loop": ["interleaved-1f1b", "greedy", "adaoffload", "pipeoffload"],
    "v": ["zb-v", "greedy", "adaoffload", "pipeoffload"],
}
CONFIGS = (("loop", 1), ("loop", 2), ("v", 2))


@dataclass
class Candidate:
    """One (placement, chunks, partition, schedule) point the search evaluated."""

    placement: str
    chunks: int
    strategy: str
    partition: list[list[int]]
    schedule: str | None = None
    makespan_ms: float | None = None
    peak_memory_mib: list[float] | None = None
    note: str = ""
    problem: Problem | None = field(default=None, repr=False)
    plan: Plan | None = field(default=None, repr=False)
    schedules_tried: dict[str, float | str] = field(default_factory=dict, repr=False)

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def label(self) -> str:
        return f"{self.placement}x{self.chunks} {self.strategy}"

    def row(self) -> dict[str, Any]:
        limits = [d.memory_limit_mib for d in self.problem.devices] if self.problem else []
        return {
            "placement": self.placement, "chunks": self.chunks, "partition": self.strategy,
            "schedule": self.schedule, "makespan_ms": self.makespan_ms,
            "peak_memory_mib": max(self.peak_memory_mib) if self.peak_memory_mib else None,
            "memory_limit_mib": min((x for x in limits if x is not None), default=None),
            "layers_per_stage": [b - a for a, b in self.partition], "note": self.note,
        }


@dataclass
class AdaptiveResult:
    problem: Problem
    plan: Plan
    best: Candidate
    candidates: list[Candidate]
    elapsed_s: float
    solver_runs: list[dict[str, Any]] = field(default_factory=list)

    def table(self) -> str:
        return format_table(self.candidates, self.best)


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
def _baselines():
    from . import baselines  # the baselines helper's package; imported late (optional at import time)

    return baselines


def evaluate(spec: Spec, costs: list[LayerCost], placement: str, chunks: int, strategy: str,
             partition: list[list[int]], schedules: list[str] | None = None,
             fast: bool = False) -> Candidate:
    """Build the problem of one candidate and time it with the heuristics; keep the fastest plan
    that fits every device's memory limit. `fast` leaves out the greedy list scheduler (it tries
    several variants and costs 5-10x the others) unless nothing else fits."""
    b = _baselines()
    cand = Candidate(placement, chunks, strategy, [list(r) for r in partition])
    problem = build_problem(spec, cand.partition, placement, chunks, costs)
    cand.problem = problem
    try:
        check_memory_feasible(problem)
    except MemoryInfeasibleError as exc:
        cand.note = "memory: " + str(exc).split(": ", 1)[-1][:120]
        return cand
    names = schedules or SCHEDULES["loop1" if chunks == 1 else placement]
    fallback: list[str] = []
    if fast and not schedules:
        fallback = [n for n in names if n == "greedy"]
        names = [n for n in names if n != "greedy"]
    key = problem.key()
    short: list[str] = []
    for name in _then(names, fallback, cand):
        try:
            plan = b.run_baseline(problem, name, problem_key=key)
        except b.NotApplicable:
            continue
        except b.DoesNotFit as exc:
            cand.schedules_tried[name] = "does not fit"
            short.append(f"{name} needs {max(exc.needed_mib):.0f} MiB")
            continue
        cand.schedules_tried[name] = plan.makespan_ms
        if cand.plan is None or plan.makespan_ms < cand.plan.makespan_ms - 1e-9:
            cand.plan, cand.schedule = plan, name
    if cand.plan is None and not schedules:
        # none of the usual schedules fits, yet the budget is feasible (checked above): the baselines'
        # best_heuristic always finds a plan then (down to the serialized schedule)
        try:
            cand.plan = b.best_heuristic(problem, problem_key=key)
            cand.schedule = next((n for n in sorted(b.NAMES, key=len, reverse=True)
                                  if cand.plan.method.startswith(n)), cand.plan.method.split(" ")[0])
        except MemoryInfeasibleError:
            pass
    if cand.plan is not None:
        cand.makespan_ms = cand.plan.makespan_ms
        cand.peak_memory_mib = list(cand.plan.peak_memory_mib)
    else:
        cand.note = "no schedule fits: " + "; ".join(short[:2]) if short else "no applicable schedule"
    return cand


def _then(names: list[str], fallback: list[str], cand: Candidate):
    """`names`, then `fallback` only if none of them produced a plan."""
    yield from names
    if cand.plan is None:
        yield from fallback


def _device_busy(problem: Problem, plan: Plan) -> list[float]:
    busy = [0.0] * problem.num_devices
    for dp in plan.devices:
        busy[dp.device] = sum(op.end_ms - op.start_ms for op in dp.ops if Kind(op.kind) in COMPUTE_KINDS)
    return busy


def _moves(cand: Candidate) -> list[list[list[int]]]:
    """Boundary moves that shrink the stages of the busiest device, heaviest stage first, then the
    moves of every other boundary (the critical path is not always the busiest device)."""
    problem, plan, ranges = cand.problem, cand.plan, cand.partition
    busy = _device_busy(problem, plan)
    hot = max(range(len(busy)), key=busy.__getitem__)
    weight = lambda k: (problem.stages[k].forward_ms + problem.stages[k].backward_input_ms
                        + problem.stages[k].backward_weight_ms)
    hot_stages = sorted(problem.stages_of(hot), key=weight, reverse=True)
    order = hot_stages + sorted((k for k in range(len(ranges)) if k not in hot_stages), key=weight, reverse=True)
    out: list[list[list[int]]] = []
    for k in order:
        a, b = ranges[k]
        if b - a < 2:
            continue
        if k > 0:  # give the first layer to the previous stage
            new = [list(r) for r in ranges]
            new[k - 1][1] += 1
            new[k][0] += 1
            out.append(new)
        if k + 1 < len(ranges):  # give the last layer to the next stage
            new = [list(r) for r in ranges]
            new[k][1] -= 1
            new[k + 1][0] -= 1
            out.append(new)
    return out


def local_search(spec: Spec, costs: list[LayerCost], start: Candidate, deadline: float,
                 on_candidate: Callable[[Candidate], None] | None = None) -> tuple[Candidate, list[Candidate]]:
    """First-improvement hill climbing on layer boundaries, each move timed by the candidate's own
    schedule through the simulator; stops at a local optimum or the deadline."""
    best, tried = start, []
    seen = {tuple(map(tuple, start.partition))}
    names = [start.schedule] if start.schedule in _baselines().NAMES else None
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for ranges in _moves(best):
            if time.monotonic() >= deadline:
                break
            key = tuple(map(tuple, ranges))
            if key in seen:
                continue
            seen.add(key)
            cand = evaluate(spec, costs, best.placement, best.chunks, "local", ranges, names)
            tried.append(cand)
            if on_candidate:
                on_candidate(cand)
            if cand.fits and cand.makespan_ms < best.makespan_ms - 1e-6:
                best, improved = cand, True
                break
    if best is not start:
        # the moved partition may now suit another schedule better
        full = evaluate(spec, costs, best.placement, best.chunks, "local", best.partition)
        if full.fits and full.makespan_ms <= best.makespan_ms:
            best = full
        tried.append(full)
        if on_candidate:
            on_candidate(full)
    return best, tried


# --------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------
def _as_spec(spec: Spec | dict) -> Spec:
    return spec if isinstance(spec, Spec) else Spec.model_validate(spec)


def _configs(spec: Spec) -> list[tuple[str, int]]:
    n = len(spec.model.layer_groups())
    return [(pl, c) for pl, c in CONFIGS if n >= spec.training.devices * c]


def search(spec: Spec | dict, budget_s: float = 5.0,
           on_candidate: Callable[[Candidate], None] | None = None, reference: bool = True,
           min_evaluations: int = 3, fast: bool = False) -> list[Candidate]:
    """Every candidate evaluated, best first.

    1. Build the partitions of every placement and rank them by the analytic `Proxy` (cheap);
    2. time them with the heuristics in that order (at least `min_evaluations`, then while 60% of
       the budget lasts); with `reference`, Megatron's default (uniform, loop x 2, interleaved 1F1B)
       is always timed too, so the result is never slower than it;
    3. local moves of layer boundaries, timed by the simulator, from the best candidate of up to two
       placements until the budget ends."""
    spec = _as_spec(spec)
    start = time.monotonic()
    deadline = start + budget_s
    costs = layer_costs(spec)
    evaluated: list[Candidate] = []

    def record(cand: Candidate) -> None:
        evaluated.append(cand)
        if on_candidate:
            on_candidate(cand)

    configs = _configs(spec)
    if reference and ("loop", 2) in configs:
        ranges = uniform_partition([c.type for c in costs], 2 * spec.training.devices)
        record(evaluate(spec, costs, "loop", 2, "uniform", ranges, ["interleaved-1f1b"]))
    pool = []
    for placement, chunks in configs:
        proxy = Proxy(spec, costs, placement, chunks)
        for strategy, ranges in partitions_for(spec, costs, placement, chunks).items():
            if strategy == "uniform":
                continue  # a reference, not a contender (timed above when asked)
            pool.append((proxy.score(ranges), placement, chunks, strategy, ranges))
    pool.sort(key=lambda x: x[0])
    for done, (_, placement, chunks, strategy, ranges) in enumerate(pool):
        if done >= min_evaluations and time.monotonic() > start + 0.6 * budget_s:
            break
        record(evaluate(spec, costs, placement, chunks, strategy, ranges, fast=fast))
    fitting = sorted((c for c in evaluated if c.fits and c.strategy != "uniform"),
                     key=lambda c: c.makespan_ms)
    starts, seen_configs = [], set()
    for cand in fitting:
        if (cand.placement, cand.chunks) not in seen_configs:
            seen_configs.add((cand.placement, cand.chunks))
            starts.append(cand)
    starts = starts[:2]
    for i, cand in enumerate(starts):
        share = (deadline - time.monotonic()) / (len(starts) - i)
        if share <= 0.05:
            break
        local_search(spec, costs, cand, time.monotonic() + share, record)
    unique, seen = [], set()
    for cand in sorted(evaluated, key=lambda c: (not c.fits, c.makespan_ms if c.fits else math.inf)):
        key = (cand.placement, cand.chunks, tuple(map(tuple, cand.partition)), cand.schedule)
        if key not in seen:  # local search may reach one partition by several paths
            seen.add(key)
            unique.append(cand)
    return unique


def _raise_infeasible(spec: Spec, candidates: list[Candidate]) -> None:
    """No candidate fits: raise MemoryInfeasibleError with the least memory any candidate needs."""
    best_needed = None
    for cand in candidates:
        if cand.problem is None:
            continue
        from .bounds import min_memory

        needed = min_memory(cand.problem)
        if best_needed is None or max(needed) < max(best_needed[0]):
            best_needed = (needed, [cand.problem.limit_of(d) for d in range(cand.problem.num_devices)])
    if best_needed is None:
        raise ValueError("adaptive: no candidate could be built")
    needed, limits = best_needed
    if all(n <= lim for n, lim in zip(needed, limits)):  # cannot happen: best_heuristic always fits then
        raise ValueError("adaptive: no schedule found for any candidate although memory suffices")
    raise MemoryInfeasibleError(needed, limits)


def _finalize(problem: Problem, cand: Candidate) -> Problem:
    meta = dict(problem.metadata)
    meta["partition_strategy"] = "auto"
    return problem.model_copy(update={"metadata": meta})


def adaptive_problem(spec: Spec | dict, budget_s: float = 2.0) -> Problem:
    """The problem of the best candidate found by the heuristic search (no optimizer): fast enough to
    answer a request inline. Raises MemoryInfeasibleError when nothing fits."""
    spec = _as_spec(spec)
    candidates = search(spec, budget_s, reference=False, min_evaluations=2, fast=True)
    if not candidates or not candidates[0].fits:
        _raise_infeasible(spec, candidates)
    return _finalize(candidates[0].problem, candidates[0])


def plan_adaptive(spec: Spec | dict, time_limit_s: float = 10.0, solve_top: int = 2,
                  on_candidate: Callable[[Candidate], None] | None = None, engine: str = "auto",
                  workers: int | None = None, stop=None) -> AdaptiveResult:
    """Search (about 40% of the time limit), then the optimizer on the `solve_top` best distinct
    placements (the rest). Returns the best problem v1 + validated plan v1 and every candidate."""
    spec = _as_spec(spec)
    start = time.monotonic()
    candidates = search(spec, 0.4 * time_limit_s, on_candidate)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        _raise_infeasible(spec, candidates)
    best = fitting[0]
    problem = _finalize(best.problem, best)
    best_plan = _rekey(best.plan, problem)
    runs: list[dict[str, Any]] = []
    # the optimizer's shortlist: the best of each placement first (diversity), then the next best
    shortlist, seen = [], set()
    for cand in fitting:
        if (cand.placement, cand.chunks) not in seen:
            seen.add((cand.placement, cand.chunks))
            shortlist.append(cand)
    shortlist = (shortlist + [c for c in fitting if c not in shortlist])[:solve_top]
    try:
        from .solver import solve
    except ImportError:  # optimizer not installed: the heuristic result stands
        solve = None
    remaining = time_limit_s - (time.monotonic() - start)
    if solve is not None and shortlist and remaining > 0.5:
        for i, cand in enumerate(shortlist):
            share = (time_limit_s - (time.monotonic() - start)) / (len(shortlist) - i)
            if share < 0.3 or (stop is not None and stop.is_set()):
                break
            cand_problem = _finalize(cand.problem, cand)
            hint = _rekey(cand.plan, cand_problem)
            result = solve(cand_problem, time_limit_s=share, hint=hint, engine=engine, workers=workers,
                           stop=stop, problem_key=cand_problem.key())
            runs.append({"candidate": cand.label, "schedule": cand.schedule, "heuristic_ms": cand.makespan_ms,
                         "solver_ms": result.plan.makespan_ms, "status": result.status,
                         "engine": result.engine, "seconds": round(share, 2)})
            if result.plan.makespan_ms < best_plan.makespan_ms - 1e-9:
                best, problem, best_plan = cand, cand_problem, result.plan
                best_plan = best_plan.model_copy(update={"method": f"adaptive: {cand.label}; {best_plan.method}"})
    if not best_plan.method.startswith("adaptive"):
        best_plan = best_plan.model_copy(update={"method": f"adaptive: {best.label}; {best_plan.method}"})
    from .validator import assert_valid

    assert_valid(problem, best_plan)
    return AdaptiveResult(problem=problem, plan=best_plan, best=best, candidates=candidates,
                          elapsed_s=time.monotonic() - start, solver_runs=runs)


def _rekey(plan: Plan, problem: Problem) -> Plan:
    return plan.model_copy(update={"problem_key": problem.key()})


def format_table(candidates: list[Candidate], best: Candidate | None = None) -> str:
    """A plain-text table of the candidates (best first): what `pipeplan plan` prints on stderr."""
    header = (f"{'placement':<9} {'partition':<14} {'schedule':<17} {'time ms':>10} {'peak MiB':>9} "
              f"{'limit MiB':>9}  layers/stage")
    lines = [header]
    for cand in candidates:
        r = cand.row()
        mark = "*" if cand is best else " "
        ms = f"{r['makespan_ms']:.2f}" if r["makespan_ms"] is not None else "-"
        peak = f"{r['peak_memory_mib']:.0f}" if r["peak_memory_mib"] is not None else "-"
        lim = f"{r['memory_limit_mib']:.0f}" if r["memory_limit_mib"] is not None else "inf"
        lps = ",".join(map(str, r["layers_per_stage"]))
        note = f"  ({r['note']})" if r["note"] else ""
        lines.append(f"{mark}{cand.placement + 'x' + str(cand.chunks):<8} {cand.strategy:<14} "
                     f"{(r['schedule'] or '-'):<17} {ms:>10} {peak:>9} {lim:>9}  {lps}{note}")
    return "\n".join(lines)
