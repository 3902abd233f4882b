"""The engine's reloads come back in turn (EngineConfig.reload_in_turn): a reload waits for the
backward of its stage's previous offloaded microbatch, or of the one its copy's span back when that
is later. With only some microbatches offloaded and copies longer than a microbatch's own work,
"the previous microbatch's backward" came too late to hide the copy."""

from __future__ import annotations

from core_schedules import problem_doc
from pipeplan.planner.baselines.engine import EngineConfig, run_engine
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind
from pipeplan.planner.simulator import Schedule


def slow_copies(offload_ms: float) -> Problem:
    """P=8, M=16, F=1, B=1.5, W=0.5 (3 ms a microbatch); offload and reload take `offload_ms`."""
    doc = problem_doc(p=8, m=16, offload=True, f=1.0, b=1.5, w=0.5, offload_ms=offload_ms,
                      reload_ms=offload_ms, offloadable_mib=100.0)
    return Problem.model_validate(doc)


def in_turn_gates(problem: Problem, every: int, first: int = 0) -> dict[int, int]:
    """Stage 0 offloads microbatches first, first + every, ...: {reloaded mb: mb of the stage-0
    backward its reload waits for} for the reloads gated on their own stage's backward."""
    def treat(k: int, i: int) -> str | None:
        return "offload" if k == 0 and i >= first and (i - first) % every == 0 else None

    cfg = EngineConfig(split=True, treat=treat, reload_in_turn=True)
    schedule = run_engine(problem, cfg)
    assert isinstance(schedule, Schedule)
    return {g.op.mb: g.after.mb for g in schedule.gates
            if g.op.kind is Kind.RELOAD and g.op.stage == 0 and not g.at_end
            and g.after.stage == 0 and g.after.kind is Kind.B}


def test_a_slow_copy_waits_only_its_span_back():
    # a 5-ms copy spans 2 microbatches of 3 ms: reload i waits for B(0, i - 2), not B(0, i - 1)
    gates = in_turn_gates(slow_copies(5.0), every=3)
    assert gates, "no reload was gated on its own stage's backward"
    assert all(after == mb - 2 for mb, after in gates.items()), gates


def test_a_long_copy_waits_for_the_previous_offloaded_microbatch():
    # a 10-ms copy spans 4 microbatches, more than the 3 between offloaded ones: B(0, i - 3)
    gates = in_turn_gates(slow_copies(10.0), every=3)
    assert gates
    assert all(after == mb - 3 for mb, after in gates.items()), gates


def test_a_copy_within_a_microbatch_waits_for_the_previous_backward():
    # 2-ms copies are shorter than a microbatch's 3 ms of work: one backward ahead, as before
    gates = in_turn_gates(slow_copies(2.0), every=3)
    assert gates
    assert all(after == mb - 1 for mb, after in gates.items()), gates


def test_the_first_offloaded_microbatch_waits_for_no_earlier_backward():
    # offloaded: 2, 5, 8, ...; a 10-ms copy spans 4 microbatches, which reach back before the first
    gates = in_turn_gates(slow_copies(10.0), every=3, first=2)
    assert 2 not in gates
    assert all(after == mb - 3 for mb, after in gates.items()), gates
