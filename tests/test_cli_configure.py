"""`pipeplan configure` end to end: the table, the document and the best spec and plan beside it,
and the exit code and message of an impossible request."""

from __future__ import annotations

import json

from pipeplan.planner.contract import Plan
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.validator import validate_plan
from typer.testing import CliRunner

from pipeplan.cli import app

runner = CliRunner()
SPEC = {"model": {"name": "small", "layers": 8, "hidden": 1024, "ffn": 4096, "heads": 16, "kv_heads": 4,
                  "vocab": 32000, "seq_len": 2048},
        "hardware": "H100-80GB", "cluster": "DGX-H100", "precision": "bf16",
        "training": {"devices": 2, "microbatches": 4}}


def run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_configure_writes_the_ranking_and_the_best_spec_and_plan(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    out = tmp_path / "configs.json"
    result = run("configure", spec, "--gpus", 8, "--gpus-per-node", 8, "--global-batch", 16, "--top", 3,
                 "--out", out)
    assert result.exit_code == 0, result.output
    assert "| 1 | TP" in result.stdout and "layouts:" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "pipeplan.configurations/v1" and len(doc["candidates"]) == 3
    first = doc["candidates"][0]
    for key in ("parallel", "training", "micro_batch_size", "precision", "tokens_per_s_per_gpu", "iteration_ms",
                "peak_memory_mib", "problem_key"):
        assert key in first
    best_spec = json.loads((tmp_path / "configs.best.spec.json").read_text())
    problem = problem_from_document(best_spec)
    assert problem.key() == first["problem_key"]
    plan = Plan.model_validate_json((tmp_path / "configs.best.plan.json").read_text())
    assert validate_plan(problem, plan) == []
    assert abs(plan.tokens_per_s_per_gpu - first["tokens_per_s_per_gpu"]) < 0.01


def test_an_impossible_batch_exits_2_naming_the_nearest(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    result = run("configure", spec, "--gpus", 8, "--global-batch", 7, "--micro-batch-sizes", "2")
    assert result.exit_code == 2
    assert "global_batch" in result.stderr and "nearest valid: 6 or 8" in result.stderr


def test_configure_refines_the_ranked_candidates_with_the_solver(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    out = tmp_path / "configs.json"
    result = run("configure", spec, "--gpus", 8, "--global-batch", 16, "--top", 2, "--refine-s", 1,
                 "--refine-top", 2, "--out", out)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("solved ") == 2
    doc = json.loads(out.read_text())
    tokens = [c["tokens_per_s_per_gpu"] for c in doc["candidates"]]
    assert tokens == sorted(tokens, reverse=True)
    plan = Plan.model_validate_json((tmp_path / "configs.best.plan.json").read_text())
    assert validate_plan(problem_from_document(json.loads((tmp_path / "configs.best.spec.json").read_text())),
                         plan) == []
