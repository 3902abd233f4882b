"""torch's own runtime runs what we plan: exported CSVs on torch's stock `_PipelineScheduleRuntime`.

No pipeplan code runs on the ranks: each loads the exported CSV with torch's `_load_csv` and steps
real `PipelineStage`s (4 gloo ranks, float64 MLP blocks); gradients must equal a single-process
reference. Placements loop, interleaved and V, split and full backward, a CP-SAT plan whose last
stage runs its forwards out of order (torch keeps losses in that order, so the export renumbers
microbatches), and an offload/recompute plan exported as its compute order.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy", reason="gloo's shape inference needs numpy")

from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.exports import last_stage_forward_order, torch_csv, torch_schedule
from torch_ranks import planned, problem_for, reference_grads, spawn_torch_csv

pytestmark = pytest.mark.torch


def out_of_order_solver_plan() -> tuple[Problem, Plan]:
    """V placement, full backward, stages alternating 2.0/2.2 ms backwards: single-worker deterministic
    CP-SAT proves an optimum (59.4 ms) whose last stage runs forwards 0,3,7,6,2,1,5,4 (OR-Tools 9.15)."""
    from pipeplan.planner.solver.api import solve

    doc = problem_for(4, 8, chunks=2, placement="v", split=False).model_dump(mode="json")
    doc["options"].update(offload=False, recompute=False)
    for k, stage in enumerate(doc["stages"]):
        stage.update(forward_ms=1.0, backward_input_ms=2.0 + 0.2 * (k % 2), backward_weight_ms=0.0)
    problem = Problem.model_validate(doc)
    plan = solve(problem, 10.0, workers=1, deterministic=True).plan
    assert plan.method.startswith("cp-sat"), plan.method
    return problem, plan


@pytest.mark.integration
def test_torch_stock_runtime_trains_exactly_on_exported_plans(tmp_path):
    loop_split = problem_for(4, 8)
    loop_full = problem_for(4, 8, split=False)
    interleaved = problem_for(4, 8, chunks=2)
    v_split = problem_for(4, 8, chunks=2, placement="v")
    v_full, solver_plan = out_of_order_solver_plan()
    memory = problem_for(4, 4)
    memory_plan = planned(memory, offload={(0, 0), (1, 2)}, recompute={(2, 1), (3, 3)})
    jobs = [(loop_split, run_baseline(loop_split, "zb-h1")), (loop_full, run_baseline(loop_full, "1f1b")),
            (interleaved, run_baseline(interleaved, "interleaved-1f1b")),
            (v_split, run_baseline(v_split, "zb-v")), (v_full, solver_plan), (memory, memory_plan)]
    kinds = [{p.kind for d in plan.devices for p in d.ops} for _, plan in jobs]
    assert {"B", "W"} <= kinds[0] and {"B", "W"} <= kinds[3] and "BW" in kinds[1] and "BW" in kinds[4]
    assert {"OFFLOAD", "RECOMPUTE"} <= kinds[5]
    # the solver plan is the case torch's runtime mis-runs as planned; the export puts it in order
    assert last_stage_forward_order(v_full, solver_plan) != list(range(8))
    exported = [torch_schedule(problem, plan) for problem, plan in jobs]
    assert exported[4].microbatch_order == last_stage_forward_order(v_full, solver_plan)
    assert [s.as_planned for s in exported] == [True] * 5 + [False]
    csvs = [(problem, s.csv(problem)) for (problem, _), s in zip(jobs, exported)]
    reports = spawn_torch_csv(csvs, str(tmp_path))
    for (problem, plan), report in zip(jobs, reports):
        reference = reference_grads(problem.num_stages, problem.num_microbatches)
        seen = set()
        for rank, rank_report in enumerate(report):
            for k, grads in rank_report["grads"].items():
                seen.add(int(k))
                for got, want in zip(grads, reference[int(k)]):
                    assert torch.allclose(torch.tensor(got, dtype=want.dtype), want, atol=1e-9, rtol=0), \
                        (plan.method, rank, k)
        assert seen == set(range(problem.num_stages))


def test_torch_stock_runtime_needs_the_renumbering(tmp_path):
    """One rank, two stages, in process: the plan's own out-of-order CSV trains wrong in torch's stock
    runtime (losses paired with the wrong microbatches); the exported one trains exactly."""
    import torch.distributed as dist
    from pipeplan.planner.exports import relabel_microbatches
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch_ranks import batch, free_port, grads_of, make_layers, mse

    problem = problem_for(1, 4, chunks=2, split=False)
    plan = relabel_microbatches(problem, run_baseline(problem, "gpipe"), [0, 2, 1, 3])
    assert last_stage_forward_order(problem, plan) == [0, 2, 1, 3]
    reference = reference_grads(2, 4)

    def error(csv_text: str) -> float:
        layers = make_layers(2)
        stages = [PipelineStage(layers[k], k, 2, torch.device("cpu")) for k in range(2)]
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=4, loss_fn=mse)
        path = tmp_path / "schedule.csv"
        path.write_text(csv_text)
        schedule._load_csv(str(path))
        x, y = batch(4)
        schedule.step(x, target=y)
        return max((g - r).abs().max().item() for layer, want in zip(layers, reference)
                   for g, r in zip(grads_of(layer), want))

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert error(torch_csv(problem, plan)) > 1e-3
        assert error(torch_schedule(problem, plan).csv(problem)) < 1e-12
    finally:
        dist.destroy_process_group()
        torch.set_default_dtype(previous)
