"""Large-neighbourhood search over the CP-SAT model, for problems too big to solve whole.

Each step frees a neighbourhood of the current solution — the ops of a band of devices over a time
window, or whole (stage, microbatch) pairs around a time window, a window of microbatches or a band
of devices — and keeps every other op's choice and per-lane order (their times still move).
CP-SAT re-optimizes that, hinted with the incumbent, for a few seconds; improvements stream through
the incumbent. The neighbourhood grows when steps are solved to optimality without gain and shrinks
when they time out. From LARGE_PAIRS pairs on (at P=32, M=128 presolve alone took ~5 s) a step is
instead a fixed-size time window over every device in the schedule's later half, without presolve.
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

# From this many pairs on, presolve costs more than a step is worth. At P=16, M=64 (1,024 pairs)
# a presolved step took about 12 s, so 60 s of Llama-3-70B on 16 GPUs at 72 GiB made 4 steps and
# reached 52,432 ms from the greedy's 52,521; late windows made 6 steps, all improving: 52,227. On
# 512 pairs (P=8, M=32 in V) late windows did not beat the presolved steps (Llama-3-8B V at half
# memory 6,477 against 6,486 ms, one-off against the benchmark table's figure).
LARGE_PAIRS = 1024
# From LARGE_PAIRS on, a step is a time window over every device, of about this many ops, in the
# later half of the schedule (where the makespan is decided; earlier ops keep their starts), with a
# longer budget: loading the model alone takes seconds there, and a step that times out before its
# first solution is wasted. Measured on het P=32, M=128, half memory, 3-ms copies: windows of
# ~1200 ops for 6 s took the greedy seed from 455.3 to 452.5 in 120 s; the small-problem
# neighbourhoods timed out at 3 s and shrank to nothing (no gain).
LARGE_WINDOW_OPS = 1200
LARGE_STEP_S = 6.0
# A step first builds, loads and presolves the whole model (every pair, most of them only held in
# their lane order); only then does it search. That overhead is measured (the time to the step's
# first solution, the hint) and a step gets at least OVERHEAD_FACTOR times it, up to MAX_STEP_FACTOR
# times its base budget (a step that finds not even the hint counts as all overhead). Measured on
# Llama-3-8B V at half memory (16 stages, M=32): presolve took 1.2-1.7 s of every 3-s step; from
# the greedy seed, 40 s of LNS reached 6643/6647 ms with 3-s steps, 6603/6591 with 6-s steps, 6614
# with 10-s steps (1.5-s steps without presolve: 6701). Since step models carry only the kept pairs'
# modes and start with tightened windows (cpsat_model), a DeepSeek-like V step searches from 0.3 s
# instead of 0.7 s, so the factor lengthens fewer steps: that row made 17 steps in 60 s, not 15.
OVERHEAD_FACTOR = 4.0
MAX_STEP_FACTOR = 4.0


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


def _late_window(starts: dict[Op, int], rng: random.Random) -> tuple[set[tuple[int, int]], set[Op], int]:
    """Ops starting in a random time window in the later half: (their pairs, the ops, window start)."""
    horizon = max(starts.values())
    width = max(1, horizon * LARGE_WINDOW_OPS // max(1, len(starts)))
    a = rng.randint(horizon // 2, max(horizon // 2, horizon - width))
    ops = {op for op, s in starts.items() if a <= s < a + width}
    return {(op.stage, op.mb) for op in ops}, ops, a


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
    # they timed out and the neighbourhood shrank; plain makespan steps did at least as well. For
    # the same reason steps leave out the iteration (the whole-problem model and the incumbent,
    # which ranks equal makespans by it, keep it).
    options = ModelOptions(tail=False)
    kinds = ["ops", "ops", "time", "microbatches", "devices"]
    large = pairs >= LARGE_PAIRS
    state, state_ms = None, float("inf")
    base_s = LARGE_STEP_S if large else step_s
    overhead = 0.0  # seconds before a step's search starts (latest measurement)
    while time.monotonic() < deadline - 0.2 and not (stop is not None and stop.is_set()):
        if inc.plan is None:
            break
        if state is None or inc.makespan < state_ms - 1e-9:  # someone else found better: adopt it
            state = inc.ticks if inc.ticks is not None else ticks_of_plan(problem, inc.plan, scale)
            state_ms = inc.makespan
        starts = state[0]
        free_ops = fix_before = None
        if large:
            free, free_ops, fix_before = _late_window(starts, rng)
        else:
            kind = rng.choice(kinds)
            if kind == "ops":
                free, free_ops = _op_window(problem, starts, rng, 3 * size)
            else:
                free = _neighbourhood(problem, starts, rng, size, kind)
            if size >= pairs:
                free, free_ops = None, None  # the whole problem fits in one step
        before = inc.makespan
        budget = min(step_budget(base_s, overhead), deadline - time.monotonic())
        if budget <= 0.1:
            break
        out = cpsat.run(problem, inc, scale, budget, stop, workers, seed + steps, deterministic,
                        options, free=free, method="cp-sat lns", base=state,
                        presolve=not large, free_ops=free_ops, fix_before=fix_before)
        steps += 1
        # (not from LARGE_PAIRS on, measured with its own budget; not when deterministic: a budget
        # from wall-clock time would make the steps depend on the machine's load)
        if not large and not deterministic and (out.first_s is not None or out.wall_s >= budget * 0.9):
            overhead = out.first_s if out.first_s is not None else out.wall_s
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


def step_budget(base_s: float, overhead_s: float) -> float:
    """Seconds for the next step: the base, or enough that the model's overhead is a small part."""
    return min(MAX_STEP_FACTOR * base_s, max(base_s, OVERHEAD_FACTOR * overhead_s))


def _end(problem: Problem, scale: Scale, starts: dict[Op, int]) -> int:
    return max(s + scale.t(duration(problem, op)) for op, s in starts.items()) - min(starts.values())
