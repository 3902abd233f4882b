"""Large-neighbourhood search over the CP-SAT model, for problems too big to solve whole.

Each step frees a neighbourhood of the current solution — the ops of a band of devices over a time
window, or whole (stage, microbatch) pairs around a time window, a window of microbatches or a band
of devices — and keeps every other op's choice and per-lane order (their times still move). CP-SAT re-optimizes that, hinted with the incumbent, for
a few seconds (without presolve above PRESOLVE_PAIRS pairs: at P=32, M=128 presolve alone took ~5 s);
improvements stream through the incumbent. The neighbourhood grows when steps are
solved to optimality without gain and shrinks when they time out.
"""

from __future__ import annotations

import random
import threading
import time

from ..contract import Problem
from ..ops import Op, duration
from . import cpsat
from .convert import ticks_of_plan
from .cpsat_model import ModelOptions
from .incumbent import Incumbent
from .scaling import Scale

PRESOLVE_PAIRS = 1024  # above this many pairs, presolve costs more than a step is worth


def _op_window(problem: Problem, starts: dict[Op, int], rng: random.Random, size: int
               ) -> tuple[set[tuple[int, int]], set[Op]]:
    """A band of consecutive devices over a time window: about `size` ops there are freed (their
    pairs' offload/recompute choices too); everything else keeps its lane order."""
    P = problem.num_devices
    band = rng.choice([b for b in (1, 2, 3, 4, 6, 8) if b <= P] or [1])
    d0 = rng.randrange(0, P - band + 1)
    devices = set(range(d0, d0 + band))
    ordered = sorted((s, op) for op, s in starts.items() if problem.stages[op.stage].device in devices)
    if not ordered:
        return set(), set()
    n = min(len(ordered), max(4, size))
    a = rng.randrange(0, len(ordered) - n + 1)
    ops = {op for _, op in ordered[a:a + n]}
    return {(op.stage, op.mb) for op in ops}, ops


def _neighbourhood(problem: Problem, starts: dict[Op, int], rng: random.Random, size: int,
                   kind: str) -> set[tuple[int, int]]:
    S, M, P = problem.num_stages, problem.num_microbatches, problem.num_devices
    if kind == "microbatches":
        width = max(1, min(M, size // S))
        i0 = rng.randrange(0, M - width + 1)
        return {(k, i) for k in range(S) for i in range(i0, i0 + width)}
    ordered = sorted(starts.items(), key=lambda x: x[1])
    if kind == "devices":
        band = max(1, min(P, rng.choice([2, 3, 4])))
        d0 = rng.randrange(0, P - band + 1)
        devices = set(range(d0, d0 + band))
        ordered = [(op, s) for op, s in ordered if problem.stages[op.stage].device in devices]
    if not ordered:
        return set()
    start_at = rng.randrange(0, len(ordered))
    free: set[tuple[int, int]] = set()
    for op, _ in ordered[start_at:] + ordered[:start_at]:
        free.add((op.stage, op.mb))
        if len(free) >= size:
            break
    return free


def run(problem: Problem, inc: Incumbent, scale: Scale, deadline: float, stop: threading.Event | None,
        workers: int, seed: int, deterministic: bool, notes: list[str],
        step_s: float = 3.0) -> float | None:
    """Improve the incumbent until the deadline; LNS proves nothing, so it returns no bound."""
    rng = random.Random(seed)
    pairs = problem.num_stages * problem.num_microbatches
    size = max(8, min(pairs, 48))
    steps = gains = 0
    # Measured here: a secondary "start early" objective kept steps from proving optimality, so
    # they timed out and the neighbourhood shrank; plain makespan steps did at least as well.
    options = ModelOptions()
    kinds = ["ops", "ops", "time", "microbatches", "devices"]
    state, state_ms = None, float("inf")
    while time.monotonic() < deadline - 0.2 and not (stop is not None and stop.is_set()):
        if inc.plan is None:
            break
        if state is None or inc.makespan < state_ms - 1e-9:  # someone else found better: adopt it
            state = inc.ticks if inc.ticks is not None else ticks_of_plan(problem, inc.plan, scale)
            state_ms = inc.makespan
        starts = state[0]
        kind = rng.choice(kinds)
        free_ops = None
        if kind == "ops":
            free, free_ops = _op_window(problem, starts, rng, 3 * size, )
        else:
            free = _neighbourhood(problem, starts, rng, size, kind)
        fix_before = None
        if size >= pairs:
            free, free_ops = None, None  # the whole problem fits in one step
        elif pairs > PRESOLVE_PAIRS and free:
            window = free_ops if free_ops is not None else [op for op in starts if (op.stage, op.mb) in free]
            fix_before = min(starts[op] for op in window)
        before = inc.makespan
        budget = min(step_s, deadline - time.monotonic())
        if budget <= 0.1:
            break
        out = cpsat.run(problem, inc, scale, budget, stop, workers, seed + steps, deterministic,
                        options, free=free, method="cp-sat lns", base=state,
                        presolve=pairs <= PRESOLVE_PAIRS, free_ops=free_ops, fix_before=fix_before)
        steps += 1
        if out.solution is not None and _end(problem, scale, out.solution[0]) <= _end(problem, scale, starts):
            state = out.solution  # same or shorter makespan, more compressed: the next base
            state_ms = min(state_ms, inc.makespan)
        if inc.makespan < before - 1e-9:
            gains += 1
        elif out.status == "OPTIMAL":
            size = min(pairs, int(size * 1.25) + 1)
        elif out.wall_s >= budget * 0.9:
            size = max(8, int(size * 0.8))
        if free is None and out.status == "OPTIMAL":
            break
    notes.append(f"lns: {steps} steps, {gains} improving, final neighbourhood {size} pairs")
    return None



def _end(problem: Problem, scale: Scale, starts: dict[Op, int]) -> int:
    return max(s + scale.t(duration(problem, op)) for op, s in starts.items()) - min(starts.values())
