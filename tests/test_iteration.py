"""The whole iteration: each stage's gradient reduction after its last weight gradient on the device's
reduce lane, then the device's optimizer step; timed by the simulator, checked by the validator,
reported by every plan made from a spec (a peer's too)."""

from __future__ import annotations

import json
import random

import pytest
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Device, Problem, Stage, Workload
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.iteration import iteration_end, tail_floor
from pipeplan.planner.solver.api import solve
from pipeplan.planner.solver.cpsat_model import CpsatModel
from pipeplan.planner.solver.scaling import scale_for
from pipeplan.planner.validator import validate_plan
from typer.testing import CliRunner

from pipeplan.cli import app


def two_stage(reduce: tuple[float, float] | None, optimizer: tuple[float, float] | None = None,
              workload: Workload | None = None) -> Problem:
    """2 devices, 1 stage each, 2 microbatches, F = B = W = 1, no link cost."""
    stages = [Stage(device=d, forward_ms=1, backward_input_ms=1, backward_weight_ms=1, activation_mib=1,
                    reduce_ms=None if reduce is None else reduce[d]) for d in range(2)]
    devices = [Device(optimizer_ms=None if optimizer is None else optimizer[d]) for d in range(2)]
    return Problem(num_devices=2, num_microbatches=2, stages=stages, devices=devices, workload=workload)


def test_without_reductions_the_iteration_is_the_pipeline():
    plan = run_baseline(two_stage(None), "1f1b")
    assert plan.iteration_ms == plan.makespan_ms
    assert plan.tokens_per_s_per_gpu is None and plan.mfu is None


def test_reduction_and_optimizer_follow_each_stage_and_device_by_hand():
    """Each device: its stage's reduction starts when the stage's last W/BW ends, its optimizer step
    when that reduction and the device's last op are done; the iteration is the latest step's end."""
    problem = two_stage((5.0, 1.0), (0.5, 0.25))
    plan = run_baseline(problem, "1f1b")
    ends = {}
    for dp in plan.devices:
        for op in dp.ops:
            if op.kind in ("W", "BW"):
                ends[op.stage] = max(ends.get(op.stage, 0.0), op.end_ms)
    done = [max(op.end_ms for op in dp.ops) for dp in sorted(plan.devices, key=lambda d: d.device)]
    expected = max(max(done[0], ends[0] + 5.0) + 0.5, max(done[1], ends[1] + 1.0) + 0.25)
    assert plan.iteration_ms == pytest.approx(expected)
    assert plan.iteration_ms > plan.makespan_ms  # stage 0 finishes last and reduces after it
    assert validate_plan(problem, plan) == []
    assert any("iteration_ms" in v for v in validate_plan(problem, plan.model_copy(update={"iteration_ms": 1.0})))


def test_the_reduce_lane_serialises_a_devices_stages_in_the_order_they_finish():
    problem = Problem(num_devices=1, num_microbatches=1, stages=[
        Stage(device=0, forward_ms=1, backward_input_ms=1, backward_weight_ms=1, activation_mib=1, reduce_ms=r)
        for r in (4.0, 4.0)], devices=[Device()])
    # stage 1 finishes its W at 3, stage 0 at 10: reductions 3->7 and 10->14, not 7->11 then 11->15
    assert iteration_end(problem, [10.0, 3.0], [10.0]) == 14.0
    # both ready at 3: one after the other on the one lane
    assert iteration_end(problem, [3.0, 3.0], [3.0]) == 11.0


def test_early_weight_gradients_hide_the_reduction():
    """The same pipeline, 1F1B (weight gradients with each backward) against GPipe (all backwards at
    the end): 1F1B finishes stage 0's last W no later, so its exposed tail is no longer."""
    problem = two_stage((3.0, 3.0))
    one = run_baseline(problem, "1f1b")
    tail_one = one.iteration_ms - one.makespan_ms
    gpipe = run_baseline(problem, "gpipe")
    assert tail_one <= gpipe.iteration_ms - gpipe.makespan_ms + 1e-9


def test_throughput_and_mfu_from_the_workload():
    workload = Workload(tokens=4096, gpus=16, model_flops=1e15, peak_tflops=1000)
    plan = run_baseline(two_stage((0.0, 0.0), workload=workload), "1f1b")
    seconds = plan.iteration_ms / 1e3
    assert plan.tokens_per_s_per_gpu == pytest.approx(4096 / seconds / 16)
    assert plan.mfu == pytest.approx(1e15 / seconds / 16 / 1e15)


def test_new_fields_enter_the_key_only_when_set():
    assert two_stage(None).key() == two_stage(None).model_copy().key()
    base = two_stage(None).canonical_json()
    assert "reduce_ms" not in base and "optimizer_ms" not in base and "workload" not in base
    assert two_stage((1.0, 1.0)).key() != two_stage(None).key()


def test_a_peer_plan_from_a_spec_reports_the_iteration(tmp_path):
    spec = {"model": {"layers": 8, "hidden": 1024, "heads": 8, "vocab": 32000, "seq_len": 2048},
            "hardware": "H100-80GB", "precision": "bf16", "parallel": {"tp": 2, "gpus": 32},
            "training": {"devices": 4, "microbatches": 8}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["baseline", "1f1b", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    problem = problem_from_document(spec)
    assert plan["iteration_ms"] > plan["makespan_ms"] > 0
    assert plan["tokens_per_s_per_gpu"] == pytest.approx(
        problem.workload.tokens / (plan["iteration_ms"] / 1e3) / 32)
    assert 0 < plan["mfu"] < 1


def loop_with_reductions(reduce: list[float], microbatches: int = 3) -> Problem:
    """2 devices, stages 0..3 looped over them (device 0 holds 0 and 2), F = B = W = 1."""
    stages = [Stage(device=k % 2, forward_ms=1, backward_input_ms=1, backward_weight_ms=1, activation_mib=1,
                    reduce_ms=reduce[k]) for k in range(4)]
    return Problem(num_devices=2, num_microbatches=microbatches, stages=stages,
                   devices=[Device(optimizer_ms=0.5), Device(optimizer_ms=0.5)])


def test_the_solver_hides_a_stages_reduction_behind_later_compute():
    """Makespan first, iteration second: stages 2 and 3 reduce for 6 ms each. The greedy seed already
    meets the makespan's bound (19 ms) but leaves both reductions after the pipeline (25.5 ms); CP-SAT
    finishes their weight gradients early, so they run beside stages 0 and 1's last work, and proves
    the result optimal. A solver that stopped at the makespan's bound returns the seed."""
    problem = loop_with_reductions([1.0, 1.0, 6.0, 6.0])
    seed = run_baseline(problem, "greedy")
    assert (seed.makespan_ms, seed.iteration_ms) == (19.0, 25.5)
    result = solve(problem, 20, engine="cpsat", workers=1, deterministic=True)
    assert result.plan.makespan_ms == pytest.approx(19.0)
    assert result.plan.iteration_ms == pytest.approx(21.5)
    assert result.status == "optimal" and validate_plan(problem, result.plan) == []


@pytest.mark.parametrize("seed", range(12))
def test_no_plan_beats_the_iteration_bound(seed):
    """iteration_bound (makespan bound + the least tail any plan has) under every peer's and the
    solver's plan of random looped problems with reductions and optimizer steps."""
    rng = random.Random(seed)
    problem = loop_with_reductions([rng.choice([0.0, 0.5, 3.0, 8.0]) for _ in range(4)], rng.randint(2, 4))
    plans = [run_baseline(problem, name) for name in ("gpipe", "interleaved-1f1b", "greedy")]
    plans.append(solve(problem, 3, engine="cpsat", workers=1, deterministic=True).plan)
    floor = tail_floor(problem)
    assert floor == min(min(problem.reduce_of(k) for k in (d, d + 2)) + 0.5 for d in range(2))
    for plan in plans:
        assert plan.iteration_bound_ms <= plan.iteration_ms + 1e-9
        assert plan.iteration_ms >= plan.makespan_ms + floor - 1e-9
        assert validate_plan(problem, plan) == []
    lying = plans[0].model_copy(update={"iteration_bound_ms": plans[0].iteration_ms + 1})
    assert any("iteration_bound_ms" in v for v in validate_plan(problem, lying))


def test_one_tick_of_makespan_outweighs_any_iteration():
    """The model's objective is makespan x weight + iteration with a weight above any iteration it
    allows, so the makespan comes first, and an objective bound divides back into a makespan bound."""
    problem = loop_with_reductions([1.0, 1.0, 6.0, 6.0])
    scale = scale_for(problem)
    built = CpsatModel(problem, scale, horizon=10_000)
    latest = 10_000 + sum(scale.t(problem.reduce_of(k)) for k in range(4)) + scale.t(0.5)
    assert built.weight > latest
    assert built.makespan_bound(built.weight * 19 + latest) == 19
    assert CpsatModel(two_stage(None), scale, horizon=100).weight == 1  # no tail: the makespan alone


def test_a_solved_plan_carries_the_iteration_bound_of_its_best_makespan_bound():
    """The solve's makespan bound lifts the plan's iteration bound too, never above its iteration:
    at 2 MiB per device CP-SAT proves a 21-ms makespan where the bounds alone say 19."""
    problem = loop_with_reductions([1.0, 1.0, 6.0, 6.0])
    problem = problem.model_copy(update={"devices": [d.model_copy(update={"memory_limit_mib": 2.0})
                                                     for d in problem.devices]})
    plan = solve(problem, 20, engine="cpsat", workers=1, deterministic=True).plan
    assert (plan.lower_bound_ms, plan.solver_bound_ms) == (19.0, 21.0)
    assert plan.iteration_bound_ms == pytest.approx(21.0 + tail_floor(problem))
    assert plan.iteration_bound_ms <= plan.iteration_ms
    assert validate_plan(problem, plan) == []
