"""The inline first plan under a memory limit no classic schedule fits: a memory-aware greedy plan,
never the serialized schedule, even when the greedy's improvement box is already spent."""

from __future__ import annotations

from pipeplan.planner.contract import Device, Options, Problem, Stage
from pipeplan.planner.validator import assert_valid
from pipeplan.service import inline


def _tight(devices: int, microbatches: int) -> Problem:
    """Room for 8 activations per device: 1F1B (and ZB-H1) need `devices` on device 0."""
    stages = [Stage(device=d, forward_ms=1.0, backward_input_ms=1.2, backward_weight_ms=0.8,
                    activation_mib=512.0, weight_grad_mib=128.0) for d in range(devices)]
    return Problem(num_devices=devices, num_microbatches=microbatches, p2p_ms=0.05,
                   options=Options(split_backward=True), stages=stages,
                   devices=[Device(memory_limit_mib=8000.0 + 640.0 * 8, static_mib=8000.0)
                            for _ in range(devices)], metadata={"test": "inline-tight"})


def test_first_plan_is_memory_aware_when_the_greedy_box_is_spent():
    problem = _tight(16, 64)
    plan = inline.first_plan(problem, problem.key(), greedy_s=0.0, greedy_max_s=60.0)
    assert plan.method.startswith("greedy("), plan.method
    assert_valid(problem, plan)
    serialized = inline.first_plan(problem, problem.key(), greedy_s=0.0, greedy_max_s=0.0)
    assert serialized.method == "serialized" and plan.makespan_ms < serialized.makespan_ms / 2


def test_a_first_plan_at_the_makespan_bound_is_optimal_only_if_its_iteration_meets_its_bound():
    """Stage 1 reduces for 6 ms after its last W: the first plan meets the makespan's bound (7 ms)
    but its iteration (13 ms) does not meet the iteration's (7 ms), so it is not called optimal;
    without the reduction the same plan is."""
    def two_stages(reduce: float) -> Problem:
        stages = [Stage(device=d, forward_ms=1, backward_input_ms=1, backward_weight_ms=1, activation_mib=1,
                        reduce_ms=reduce if d == 1 else None) for d in range(2)]
        return Problem(num_devices=2, num_microbatches=2, stages=stages, devices=[Device(), Device()])

    tail, plain = two_stages(6.0), two_stages(0.0)
    with_tail = inline.first_plan(tail, tail.key())
    assert (with_tail.makespan_ms, with_tail.iteration_ms, with_tail.status) == (7.0, 13.0, "feasible")
    assert inline.first_plan(plain, plain.key()).status == "optimal"
