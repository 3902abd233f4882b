"""`pipeplan solve`: writes a valid plan, reports progress on stderr, says how the search ended
("optimal (proven)" only with a proof, else the spent budget and the gap), exits 2 on infeasible budgets."""

from __future__ import annotations

import json
import re

from core_schedules import problem_doc
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.validator import validate_plan
from typer.testing import CliRunner

from pipeplan.cli import app


def test_solve_writes_a_valid_plan_and_reports_progress(tmp_path):
    doc = problem_doc(p=3, m=6, limit=300.0, weight_grad_mib=100.0, b=1.2, w=0.8, p2p=0.05)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "p.json"), "--time-limit", "1.5",
                                      "--deterministic", "--out", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert "best" in result.stderr and "gap" in result.stderr and "bound" in result.stderr
    plan = Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert validate_plan(Problem.model_validate(doc), plan) == []


def test_solve_exits_2_with_the_least_memory_on_an_infeasible_budget(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(problem_doc(p=2, m=4, limit=50.0)))
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "p.json"), "--time-limit", "5"])
    assert result.exit_code == 2
    assert "devices 0-1 need at least 100.0 MiB" in result.stderr and "100.0 MiB per GPU" in result.stderr
    assert not (tmp_path / "plan.json").exists()


def final_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_solve_says_optimal_only_when_proven(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(problem_doc(p=2, m=4)))  # 1F1B meets the lower bound
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "p.json"), "--time-limit", "5", "--workers", "1",
                                      "--out", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert "optimal (proven)" in final_line(result), result.stderr


def test_solve_with_a_gap_says_the_budget_was_spent_and_the_gap(tmp_path):
    """P=8, M=32 at half memory with 3-ms copies (bench/quality.py het-p8-m32-half-slow): one second
    cannot close its gap, and the last line must say so instead of sounding finished."""
    doc = problem_doc(p=8, m=32, p2p=0.05, b=1.2, w=0.8, weight_grad_mib=100.0, offload=True, offload_ms=3.0,
                      offloadable_mib=100.0, limit=1400.0, static=1000.0)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "p.json"), "--time-limit", "1", "--workers", "1",
                                      "--out", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    line = final_line(result)
    found = re.search(r"budget spent after [0-9.]+ s, gap ([0-9.]+)% to the proven bound;", line)
    assert found and float(found.group(1)) > 0, line
    assert "optimal" not in line
    plan = Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert plan.status == "feasible" and plan.gap > 0


def test_solve_reports_the_iteration_and_its_bound_when_something_follows_the_pipeline(tmp_path):
    """Stages 2 and 3 of a 2-device loop reduce for 6 ms after their last W: the final line gives the
    iteration beside the makespan, each with its proven bound; without a tail it says nothing more."""
    from pipeplan.planner.contract import Device, Stage

    def loop(reduce: list[float], optimizer: float) -> Problem:
        return Problem(num_devices=2, num_microbatches=3, devices=[Device(optimizer_ms=optimizer)] * 2,
                       stages=[Stage(device=k % 2, forward_ms=1, backward_input_ms=1, backward_weight_ms=1,
                                     activation_mib=1, reduce_ms=reduce[k]) for k in range(4)])

    (tmp_path / "p.json").write_text(loop([1.0, 1.0, 6.0, 6.0], 0.5).model_dump_json())
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "p.json"), "--time-limit", "10", "--engine", "cpsat",
                                      "--deterministic", "--out", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert "makespan 19.0000 ms, bound 19.0000 ms; iteration 21.5000 ms, bound 20.5000 ms," in final_line(result)
    (tmp_path / "q.json").write_text(loop([0.0] * 4, 0.0).model_dump_json())
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "q.json"), "--time-limit", "5", "--deterministic",
                                      "--out", str(tmp_path / "plan2.json")])
    assert result.exit_code == 0 and "iteration" not in final_line(result)
