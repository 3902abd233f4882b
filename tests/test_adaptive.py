"""Adaptive partitioning: the search beats Megatron's default on a heavy-head model, respects memory
limits, answers "partition": "auto", and `pipeplan plan` writes a valid problem + plan."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeplan.planner import baselines
from pipeplan.planner.adaptive import adaptive_problem, plan_adaptive, search
from pipeplan.planner.bounds import MemoryInfeasibleError
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.costmodel import build_problem, layer_costs
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.partition import (
    Proxy,
    bottleneck_partition,
    device_balanced_partition,
    uniform_partition,
)
from pipeplan.planner.spec import Spec
from pipeplan.planner.validator import validate_plan
from typer.testing import CliRunner

from pipeplan.cli import app


def small_doc(**training) -> dict:
    """A 12-block model whose 128k-vocabulary head costs about three blocks: uniform is unbalanced."""
    doc = {
        "model": {"name": "tiny-big-vocab", "layers": 12, "hidden": 1024, "ffn": 2816, "heads": 8,
                  "vocab": 131072, "seq_len": 2048},
        "hardware": "A100-80GB",
        "training": {"devices": 4, "microbatches": 8},
    }
    doc["training"].update(training)
    return doc


def megatron_default(spec: Spec) -> Plan:
    costs = layer_costs(spec)
    problem = build_problem(spec, uniform_partition([c.type for c in costs], 8), "loop", 2, costs)
    return baselines.run_baseline(problem, "interleaved-1f1b")


def test_adaptive_beats_uniform_interleaved_and_returns_a_valid_pair():
    spec = Spec.model_validate(small_doc())
    result = plan_adaptive(spec, time_limit_s=3.0, solve_top=1)
    assert validate_plan(result.problem, result.plan) == []
    assert result.plan.problem_key == result.problem.key()
    ranges = result.problem.metadata["partition"]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(result.problem.metadata["layers"])
    assert len(ranges) == len(result.problem.stages)
    reference = megatron_default(spec)
    assert result.plan.makespan_ms < 0.9 * reference.makespan_ms
    for cand in result.candidates:  # every candidate reports its predicted time and peak memory
        if cand.fits:
            assert cand.makespan_ms > 0 and len(cand.peak_memory_mib) == 4
    assert any(c.strategy == "uniform" and c.schedule == "interleaved-1f1b" for c in result.candidates)
    assert "placement" in result.table().splitlines()[0]


def test_memory_limits_hold_for_every_candidate_and_infeasible_budgets_raise():
    spec = Spec.model_validate(small_doc(memory_budget_gib=12, dp_shards=1))
    cands = search(spec, budget_s=1.5)
    fitting = [c for c in cands if c.fits]
    assert fitting
    for cand in fitting:
        limits = [d.memory_limit_mib for d in cand.problem.devices]
        assert all(p <= lim + 1e-6 for p, lim in zip(cand.peak_memory_mib, limits))
    with pytest.raises(MemoryInfeasibleError):
        adaptive_problem(Spec.model_validate(small_doc(memory_budget_gib=0.5)), budget_s=0.5)


def test_bottleneck_partition_keeps_the_memory_estimate_under_the_limit():
    spec = Spec.model_validate(small_doc(memory_budget_gib=12))
    costs = layer_costs(spec)
    ranges = bottleneck_partition(spec, costs, "loop", 1)
    assert ranges is not None and ranges[-1][1] == len(costs)
    assert Proxy(spec, costs, "loop", 1).score(ranges)[0] == 0  # no memory excess in the estimate
    tiny = Spec.model_validate(small_doc(memory_budget_gib=1))
    assert bottleneck_partition(tiny, layer_costs(tiny), "loop", 1) is None


def test_device_balancing_pairs_the_heavy_head_with_a_light_stage():
    spec = Spec.model_validate(small_doc())
    costs = layer_costs(spec)
    start = uniform_partition([c.type for c in costs], 8)
    proxy = Proxy(spec, costs, "v", 2)
    ranges = device_balanced_partition(spec, costs, "v", 2, start)
    assert proxy.score(ranges) < proxy.score(start)
    assert max(proxy.loads([r[1] for r in ranges[:-1]])) < 0.8 * max(proxy.loads([r[1] for r in start[:-1]]))


def test_partition_auto_in_a_spec_document():
    problem = problem_from_document({**small_doc(), "partition": "auto"})
    assert problem.metadata["partition_strategy"] == "auto"
    assert Problem.model_validate_json(problem.model_dump_json()).key() == problem.key()


def test_cli_plan_writes_problem_and_plan(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps(small_doc()))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "spec.json"), "--time-limit", "2",
                                      "--solve-top", "1", "--out", str(tmp_path / "plan.json"),
                                      "--problem-out", str(tmp_path / "problem.json")])
    assert result.exit_code == 0, result.output
    assert "placement" in result.stderr and "chosen:" in result.stderr
    problem = Problem.model_validate_json((tmp_path / "problem.json").read_text())
    plan = Plan.model_validate_json((tmp_path / "plan.json").read_text())
    assert validate_plan(problem, plan) == []


def test_cli_plan_writes_the_problem_beside_the_plan_by_default(tmp_path):
    """Without --problem-out the plan would be keyed by a problem nobody has (the chosen partition)."""
    (tmp_path / "spec.json").write_text(json.dumps(small_doc()))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "spec.json"), "--time-limit", "1",
                                      "--solve-top", "0", "--out", str(tmp_path / "best.json")])
    assert result.exit_code == 0, result.output
    problem = Problem.model_validate_json((tmp_path / "best.problem.json").read_text())
    plan = Plan.model_validate_json((tmp_path / "best.json").read_text())
    assert validate_plan(problem, plan) == []


def test_cli_plan_rejects_bad_specs(tmp_path):
    doc = small_doc()
    doc["model"].pop("heads")
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "bad.json")])
    assert result.exit_code == 2 and "model.heads" in result.stderr
    (tmp_path / "oom.json").write_text(json.dumps(small_doc(memory_budget_gib=0.5)))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "oom.json"), "--time-limit", "1"])
    assert result.exit_code == 2 and "infeasible" in result.stderr


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(4, 30), vocab=st.integers(1000, 400_000), devices=st.integers(2, 6),
       placement=st.sampled_from(["loop", "v"]), budget=st.sampled_from([None, 3.0, 20.0]))
def test_partitions_are_valid_and_refinement_never_worsens_the_proxy(layers, vocab, devices, placement, budget):
    if layers + 2 < 2 * devices:
        return
    spec = Spec.model_validate({
        "model": {"layers": layers, "hidden": 512, "heads": 8, "vocab": vocab, "seq_len": 1024},
        "hardware": "A100-40GB",
        "training": {"devices": devices, "microbatches": 8, "memory_budget_gib": budget}})
    costs = layer_costs(spec)
    proxy = Proxy(spec, costs, placement, 2)
    for start in (uniform_partition([c.type for c in costs], 2 * devices),
                  bottleneck_partition(spec, costs, placement, 2)):
        if start is None:
            continue
        ranges = device_balanced_partition(spec, costs, placement, 2, start)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(costs) and len(ranges) == 2 * devices
        assert all(b > a for a, b in ranges) and all(x[1] == y[0] for x, y in itertools.pairwise(ranges))
        assert proxy.score(ranges) <= proxy.score(start)
