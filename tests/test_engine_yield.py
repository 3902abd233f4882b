"""Off the busiest device a W waits for a backward known to arrive before it would end
(EngineConfig.w_yields): a W started just before the backward delays that backward's whole chain."""

from __future__ import annotations

from core_schedules import make_problem
from pipeplan.planner.baselines.engine import EngineConfig, run_engine
from pipeplan.planner.baselines.greedy import Attempt, yielding_tries
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import Schedule, Timing


def middle_busiest() -> Problem:
    """P=3, M=8: device 1 (F 1.2, B 1, W 2) has the most work, device 0 (F 0.5) the least; W's are
    long enough for a backward to arrive while one runs."""
    problem = make_problem(3, 8, b=1.0, w=2.0)
    stages = list(problem.stages)
    stages[0] = stages[0].model_copy(update={"forward_ms": 0.5})
    stages[1] = stages[1].model_copy(update={"forward_ms": 1.2})
    return problem.model_copy(update={"stages": stages})


def engine_times(problem: Problem, **flags: bool) -> Timing:
    schedule = run_engine(problem, EngineConfig(split=True, **flags))
    assert isinstance(schedule, Schedule)
    return schedule.engine_timing  # type: ignore[attr-defined]


def backwards_behind_a_w(problem: Problem, timing: Timing, device: int) -> int:
    """How many W's on `device` started while the next backward of a stage there was known to arrive
    (its forward had started and the backward above it had started earlier) before the W's end."""
    t = timing.times
    m = problem.num_microbatches
    count = 0
    for op, (start, end) in t.items():
        if op.kind is not Kind.W or problem.stages[op.stage].device != device:
            continue
        for k in problem.stages_of(device):
            if k + 1 == problem.num_stages:
                continue
            waiting = [i for i in range(m) if t[Op(Kind.B, k, i)][0] > start]
            if not waiting:
                continue
            i = min(waiting)
            above = t[Op(Kind.B, k + 1, i)]
            arrival = max(above[1] + problem.link_ms(k + 1, k), t[Op(Kind.F, k, i)][1])
            known = above[0] < start - 1e-9 and t[Op(Kind.F, k, i)][0] <= start
            count += known and start + 1e-9 < arrival < end - 1e-9
    return count


def test_a_w_off_the_busiest_device_lets_an_arriving_backward_go_first():
    problem = middle_busiest()
    assert backwards_behind_a_w(problem, engine_times(problem), 0) > 0, "no longer shows the delay"
    assert backwards_behind_a_w(problem, engine_times(problem, w_yields=True), 0) == 0


def test_the_busiest_device_never_waits():
    """Device 1's idle would be the makespan's: it still starts a W a backward then waits for."""
    problem = middle_busiest()
    assert backwards_behind_a_w(problem, engine_times(problem, w_yields=True), 1) > 0


def test_yielding_tries_rerun_the_fastest_attempts():
    attempts = [Attempt("t", None, False, f"v{n}", EngineConfig(split=True)) for n in range(12)]
    ranked = [(float(100 - n), a) for n, a in enumerate(attempts)]
    tries = yielding_tries(ranked)
    assert [a.name for a in tries] == [f"v{n},W yields" for n in range(11, 3, -1)]
    assert all(a.config.w_yields for a in tries)
