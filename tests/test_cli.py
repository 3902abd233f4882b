"""The planning commands end to end: exit codes 0/1/2, stdout/stderr, files (issue 2 item 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from core_schedules import make_problem, one_f_one_b, plan_of, problem_doc
from pipeplan.planner.baselines import NAMES
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.validator import validate_plan
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.settings import get_settings

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "specs" / "llama7b_8xh100.json"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture()
def files(tmp_path):
    """A small problem (4 devices, 8 microbatches, offload allowed) and a valid 1F1B plan of it."""
    problem = make_problem(p=4, m=8, p2p=0.05, offload=True, static=1000.0, limit=1500.0)
    plan = plan_of(problem, one_f_one_b(problem), "1F1B (test)")
    problem_path, plan_path = tmp_path / "problem.json", tmp_path / "plan.json"
    problem_path.write_text(problem.model_dump_json())
    plan_path.write_text(plan.model_dump_json())
    return tmp_path, problem, problem_path, plan_path


def write(tmp_path: Path, name: str, doc) -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


# -- problem ------------------------------------------------------------------------------------------
def test_problem_from_spec(tmp_path):
    out = tmp_path / "p.json"
    result = run("problem", SPEC, "--out", out)
    assert result.exit_code == 0, result.stderr
    problem = Problem.model_validate_json(out.read_text())
    assert problem.num_devices == 8 and problem.num_microbatches > 0
    assert "key" in result.stderr
    # stdout form gives the same problem
    result = run("problem", SPEC)
    assert Problem.model_validate_json(result.stdout).key() == problem.key()


def test_problem_normalizes_a_problem(tmp_path):
    path = write(tmp_path, "in.json", {k: v for k, v in problem_doc(p=2, m=2).items() if k != "format"})
    result = run("problem", path)
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["format"] == "pipeplan.problem/v1" and doc["stages"][0]["recompute_ms"] == 1.0


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ({"hello": 1}, "neither a problem v1"),
    ({**problem_doc(), "num_devices": 3}, "devices has 2 entries but num_devices is 3"),
])
def test_problem_bad_input(tmp_path, content, expected):
    result = run("problem", write(tmp_path, "bad.json", content))
    assert result.exit_code == 2
    assert result.stderr.startswith("error: bad input: ") and expected in result.stderr
    assert result.stdout == ""


def test_bad_field_is_named(tmp_path):
    doc = problem_doc()
    doc["stages"][1]["forward_ms"] = -2
    result = run("validate", write(tmp_path, "bad.json", doc), write(tmp_path, "plan.json", {}))
    assert result.exit_code == 2
    assert "stages.1.forward_ms: forward_ms must be >= 0, got -2.0" in result.stderr


def test_missing_file(tmp_path):
    result = run("problem", tmp_path / "nope.json")
    assert result.exit_code == 2 and "no such file" in result.stderr


def test_size_limits_come_from_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEPLAN_LIMITS__MAX_MICROBATCHES", "4")
    get_settings.cache_clear()
    try:
        result = run("problem", write(tmp_path, "p.json", problem_doc(p=2, m=8)))
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2 and "num_microbatches: 8 exceeds the limit 4" in result.stderr


# -- baseline -----------------------------------------------------------------------------------------
def test_baseline_writes_a_valid_plan(files):
    tmp_path, problem, problem_path, _ = files
    out = tmp_path / "out" / "1f1b.json"
    result = run("baseline", "1f1b", problem_path, "--out", out)
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(out.read_text())
    assert validate_plan(problem, plan) == []
    result = run("baseline", "1f1b", problem_path)
    assert Plan.model_validate_json(result.stdout).makespan_ms == plan.makespan_ms


def test_baseline_unknown_name(files):
    result = run("baseline", "zb-h9", files[2])
    assert result.exit_code == 2 and "unknown baseline 'zb-h9'" in result.stderr and "zb-h1" in result.stderr


def test_baseline_not_applicable(files):
    result = run("baseline", "zb-v", files[2])
    assert result.exit_code == 2
    assert "zb-v is not applicable:" in result.stderr


def test_baseline_does_not_fit_names_device_and_memory(tmp_path):
    # GPipe holds all 8 activations on every device (1800 MiB); the limit allows 3 (1300 MiB).
    path = write(tmp_path, "p.json", problem_doc(p=4, m=8, static=1000.0, limit=1300.0))
    result = run("baseline", "gpipe", path)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: infeasible: gpipe does not fit:")
    assert "device 0 would need 1800.0 MiB (limit 1300.0 MiB)" in result.stderr


def test_infeasible_memory_names_device_and_minimum(tmp_path):
    doc = problem_doc(p=2, m=4, static=1000.0, limit=2000.0)
    doc["devices"][1]["memory_limit_mib"] = 1050.0
    path = write(tmp_path, "p.json", doc)
    for args in (("baseline", "greedy", path), ("compare", path)):
        result = run(*args)
        assert result.exit_code == 2
        assert "infeasible: device 1 needs at least 1100.0 MiB but its limit is 1050.0 MiB" in result.stderr
        assert "device 0" not in result.stderr


# -- validate -----------------------------------------------------------------------------------------
def test_validate_valid(files):
    _, _, problem_path, plan_path = files
    result = run("validate", problem_path, plan_path)
    assert result.exit_code == 0 and result.stdout.startswith("valid: makespan")


def test_validate_invalid_prints_every_violation(files):
    tmp_path, _, problem_path, plan_path = files
    doc = json.loads(plan_path.read_text())
    doc["makespan_ms"] += 1.0
    doc["devices"][0]["ops"].pop(0)
    result = run("validate", problem_path, write(tmp_path, "bad.json", doc))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert any("F(stage 0, mb 0) is missing" in line for line in lines)
    assert any("makespan_ms is" in line for line in lines)
    assert "invalid plan:" in result.stderr and "violation(s)" in result.stderr


def test_validate_not_a_plan(files):
    tmp_path, _, problem_path, _ = files
    result = run("validate", problem_path, write(tmp_path, "x.json", {"format": "pipeplan.plan/v1"}))
    assert result.exit_code == 2 and "not a plan v1" in result.stderr and "makespan_ms: Field required" in result.stderr


def test_spec_accepted_wherever_a_problem_is(tmp_path):
    out = tmp_path / "plan.json"
    assert run("baseline", "zb-h2", SPEC, "--out", out).exit_code == 0
    result = run("validate", SPEC, out)
    assert result.exit_code == 0, result.stdout
    assert run("render", SPEC, out, "--out", tmp_path / "c.png").exit_code == 0


# -- compare ------------------------------------------------------------------------------------------
def test_compare_json(files):
    _, problem, problem_path, _ = files
    result = run("compare", problem_path, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["problem_key"] == problem.key()
    assert [row["name"] for row in doc["baselines"]] != [] and {r["name"] for r in doc["baselines"]} == set(NAMES)
    ok = [row for row in doc["baselines"] if row["status"] == "ok"]
    assert ok and [r["makespan_ms"] for r in ok] == sorted(r["makespan_ms"] for r in ok)
    for row in ok:
        assert row["makespan_ms"] >= doc["lower_bound_ms"] - 1e-9
        assert 0 <= row["gap"] < 1 and len(row["peak_memory_mib"]) == 4
        assert all(m <= 1500.0 + 1e-6 for m in row["peak_memory_mib"])
    skipped = [row for row in doc["baselines"] if row["status"] == "not_applicable"]
    assert any(row["name"] == "zb-v" and "V" in row["reason"] for row in skipped)
    assert doc["min_memory_mib"] == [1100.0] * 4 and doc["memory_limit_mib"] == [1500.0] * 4


def test_compare_table(files):
    result = run("compare", files[2])
    assert result.exit_code == 0
    text = result.stdout
    for needle in ("baseline", "makespan ms", "bubble", "gap to LB", "limit 1500.0", "1f1b", "zb-h1",
                   "not applicable", "lower bound", "min memory per device (MiB): 1100.0 1100.0 1100.0 1100.0"):
        assert needle in text, needle


# -- render -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".svg", b"<svg")])
def test_render_formats(files, suffix, magic):
    tmp_path, _, problem_path, plan_path = files
    out = tmp_path / f"chart{suffix}"
    result = run("render", problem_path, plan_path, "--out", out)
    assert result.exit_code == 0, result.stderr
    assert magic in out.read_bytes()[:400]


def test_render_bad_suffix(files):
    tmp_path, _, problem_path, plan_path = files
    result = run("render", problem_path, plan_path, "--out", tmp_path / "chart.pdf")
    assert result.exit_code == 2 and "must end in .svg or .png" in result.stderr


def test_render_invalid_plan_still_draws_but_exits_1(files):
    tmp_path, _, problem_path, plan_path = files
    doc = json.loads(plan_path.read_text())
    doc["bubble_ratio"] = 0.0
    out = tmp_path / "chart.png"
    result = run("render", problem_path, write(tmp_path, "bad.json", doc), "--out", out)
    assert result.exit_code == 1 and "bubble_ratio is 0" in result.stdout
    assert out.stat().st_size > 1000


def test_console_script_exit_codes(files):
    """The installed entry point (python -m equivalent) keeps the exit codes and the stderr text."""
    _, _, problem_path, plan_path = files
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", "from pipeplan.cli import main; main()"]
    ok = subprocess.run(cmd + ["validate", str(problem_path), str(plan_path)], capture_output=True, text=True, check=False,
                        env=env, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("valid")
    bad = subprocess.run(cmd + ["validate", str(plan_path), str(plan_path)], capture_output=True, text=True, check=False,
                         env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: bad input:")
