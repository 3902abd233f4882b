"""A device may hold a forward back for an urgent arrival (EngineConfig.await_first_backward,
await_later_forward): a list scheduler otherwise starts the forward and the arrival waits for all of
it, which in the warm-up of a V delays the first microbatch's whole backward chain."""

from __future__ import annotations

from core_schedules import make_problem
from pipeplan.planner.baselines.engine import EngineConfig, run_engine
from pipeplan.planner.baselines.greedy import Attempt, awaiting_tries
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import Schedule, Timing


def v_problem() -> Problem:
    """V placement, P=4, M=16; B and W not multiples of F, so arrivals fall inside forwards."""
    return make_problem(4, 16, placement="v", chunks=2, p2p=0.1, b=1.3, w=0.7)


def engine_times(problem: Problem, **flags: bool) -> Timing:
    schedule = run_engine(problem, EngineConfig(split=True, prefer_late_forward=True, **flags))
    assert isinstance(schedule, Schedule)
    return schedule.engine_timing  # type: ignore[attr-defined]


def first_backward_delays(problem: Problem, timing: Timing) -> list[float]:
    """How late each stage's first backward starts after its inputs are there."""
    t = timing.times
    delays = []
    for k in range(problem.num_stages):
        ready = t[Op(Kind.F, k, 0)][1]
        if k + 1 < problem.num_stages:
            ready = max(ready, t[Op(Kind.B, k + 1, 0)][1] + problem.link_ms(k + 1, k))
        delays.append(t[Op(Kind.B, k, 0)][0] - ready)
    return delays


def later_forward_delays(problem: Problem, timing: Timing) -> list[float]:
    """How late each second-chunk forward starts after its input is there."""
    t = timing.times
    return [t[Op(Kind.F, k, i)][0] - t[Op(Kind.F, k - 1, i)][1] - problem.link_ms(k - 1, k)
            for k in range(problem.num_devices, problem.num_stages)
            for i in range(problem.num_microbatches)]


def test_the_first_backward_chain_runs_without_waiting():
    problem = v_problem()
    before = first_backward_delays(problem, engine_times(problem))
    assert max(before) > 0.1, "this problem no longer shows the delay the rule is for"
    after = first_backward_delays(problem, engine_times(problem, await_first_backward=True))
    assert max(after) < 1e-6, after


def test_later_chunk_forwards_wait_less():
    problem = v_problem()
    flags = {"await_first_backward": True}
    before = later_forward_delays(problem, engine_times(problem, **flags))
    after = later_forward_delays(problem, engine_times(problem, await_later_forward=True, **flags))
    assert sum(after) < sum(before), (sum(after), sum(before))


def test_the_second_pass_takes_the_two_best_treatments_fastest_first():
    cfg = EngineConfig(split=True, prefer_late_forward=True)
    late = [(12.0, Attempt("a", None, False, "v1", cfg)), (10.0, Attempt("b", None, False, "v1", cfg)),
            (11.0, Attempt("c", None, False, "v1", cfg)), (float("inf"), Attempt("b", None, False, "v2", cfg)),
            (9.5, Attempt("a", None, False, "v2", cfg))]
    tries = awaiting_tries(late)
    assert [(t.treat_name, t.name) for t in tries] == [
        ("a", "v2,await B"), ("a", "v2,await B+F"), ("b", "v1,await B"), ("b", "v1,await B+F"),
        ("a", "v1,await B"), ("a", "v1,await B+F"), ("b", "v2,await B"), ("b", "v2,await B+F")]
    assert all(t.config.await_first_backward for t in tries)
    assert [t.config.await_later_forward for t in tries[:2]] == [False, True]
