"""Plans executed by torch.distributed.pipelining on 4 gloo ranks (CPU), offload/recompute included.

Gradients are compared with a single-process run of the same model (float64, tolerance 1e-6), and
each rank's executed op sequence with the one the plan prescribes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_ranks import planned, problem_for, reference_grads, spawn, tight

from client.torch_runtime import side_op_positions
from planner.ops import Kind

pytestmark = pytest.mark.torch


def expected_log(plan, rank: int) -> list[str]:
    torch_ops, before, after = side_op_positions(plan, rank)
    out = []
    for op in torch_ops:
        out += [f"{k.value}({s},{i})" for k, s, i in before.get(op, [])]
        out.append(f"{op[0].value}({op[1]},{op[2]})")
        out += [f"{k.value}({s},{i})" for k, s, i in after.get(op, [])]
    return out


def pairs_on(plan, rank: int, kind: Kind) -> list[list[int]]:
    dp = next(d for d in plan.devices if d.device == rank)
    return sorted([p.stage, p.mb] for p in dp.ops if p.kind == kind.value)


def check_run(problem, plans, reports) -> None:
    reference = reference_grads(problem.num_stages, problem.num_microbatches)
    for rank, report in enumerate(reports):
        assert [s["revision"] for s in report["steps"]] == [p.revision for p in plans]
        for plan, step in zip(plans, report["steps"]):
            for k, grads in step["grads"].items():
                for got, want in zip(grads, reference[int(k)]):
                    assert torch.allclose(torch.tensor(got), want, atol=1e-6, rtol=0), (rank, k)
            assert [x[:2] for x in step["offloaded"]] == pairs_on(plan, rank, Kind.OFFLOAD)
            assert all(x[2] > 0 for x in step["offloaded"]), "an offload moved no bytes"
            # the device copies are really released (nothing else keeps the offloaded activations)
            assert [x[:2] for x in step["freed"] if x[2] > 0] == pairs_on(plan, rank, Kind.OFFLOAD)
            assert step["reloads"] == pairs_on(plan, rank, Kind.OFFLOAD)
            assert step["recomputes"] == pairs_on(plan, rank, Kind.RECOMPUTE)
            assert step["late"] == [], "a reload/recompute ran later than planned"
            assert step["log"] == expected_log(plan, rank)


def test_reload_is_placed_where_the_plan_starts_it():
    problem = problem_for(4, 4)
    plan = planned(problem, offload={(0, 0), (0, 2)}, recompute={(1, 0)})
    torch_ops, before, after = side_op_positions(plan, 0)
    assert after[(Kind.F, 0, 0)] == [(Kind.OFFLOAD, 0, 0)]
    # the plan gates RELOAD(0,2) on the start of the op before B(0,2), i.e. W(0,1)
    assert before[(Kind.W, 0, 1)] == [(Kind.RELOAD, 0, 2)]
    _, before1, _ = side_op_positions(plan, 1)
    assert before1[(Kind.B, 1, 0)] == [(Kind.RECOMPUTE, 1, 0)]
    assert len(torch_ops) == 3 * problem.num_microbatches


@pytest.mark.integration
def test_planned_offload_and_recompute_match_reference_across_swaps_and_placements(tmp_path):
    """One process start, four jobs: hand-made plans (loop placement with B/W split swapping between
    two plans; V placement, stage k and 7-k on one rank, with full backwards) and real baseline plans
    under tight memory limits (adaoffload on an interleaved placement, pipeoffload on zb-v)."""
    from planner.baselines import run_baseline

    loop = problem_for(4, 4)
    first = planned(loop, offload={(0, 0), (0, 2), (1, 1)}, recompute={(1, 0), (2, 3), (3, 1)})
    second = planned(loop, offload={(1, 2), (2, 0)}, recompute={(0, 1), (3, 3)})
    second = second.model_copy(update={"revision": 2})
    v = problem_for(4, 4, chunks=2, placement="v", split=False)
    v_plan = planned(v, offload={(0, 0), (7, 2), (4, 1)}, recompute={(1, 0), (6, 3), (3, 1)})
    interleaved = tight(problem_for(4, 4, chunks=2), 0.4, "interleaved-1f1b")
    v_tight = tight(problem_for(4, 4, chunks=2, placement="v"), 0.4, "zb-v")
    jobs = [(loop, [first, second]), (v, [v_plan]),
            (interleaved, [run_baseline(interleaved, "adaoffload")]),
            (v_tight, [run_baseline(v_tight, "pipeoffload")])]
    for problem, plans in jobs[2:]:
        assert any(p.kind == "OFFLOAD" for d in plans[0].devices for p in d.ops), plans[0].method
    reports = spawn(jobs, str(tmp_path))
    for (problem, plans), report in zip(jobs, reports):
        check_run(problem, plans, report)
