"""`pipeplan solve`: writes a valid plan, reports progress on stderr, exits 2 on infeasible budgets."""

from __future__ import annotations

import json

from core_schedules import problem_doc
from typer.testing import CliRunner

from pipeplan.cli import app
from planner.contract import Plan, Problem
from planner.validator import validate_plan


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
    assert "100.0 MiB" in result.stderr and "device 0" in result.stderr
    assert not (tmp_path / "plan.json").exists()
