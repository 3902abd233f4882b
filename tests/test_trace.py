"""pipeplan.trace/v1, predicted-vs-measured reports, calibration and the CLI (pure: no torch)."""

from __future__ import annotations

import json

import pytest
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Problem
from pipeplan.planner.exports import chrome_trace_compared
from pipeplan.planner.fidelity import calibrated_problem, fidelity, retime, synchronous_copies_makespan
from pipeplan.planner.trace import PIPEPLAN_RUNTIME, Trace, check_trace
from pydantic import ValidationError
from typer.testing import CliRunner

from pipeplan.cli import app

runner = CliRunner()


def problem(p2p: float = 1.0) -> Problem:
    return Problem.model_validate({
        "num_devices": 4, "num_microbatches": 6, "p2p_ms": p2p,
        "options": {"split_backward": True, "offload": True, "recompute": True},
        "stages": [{"device": d, "forward_ms": 2.0, "backward_input_ms": 2.0, "backward_weight_ms": 2.0,
                    "offload_ms": 1.0, "activation_mib": 10.0} for d in range(4)],
        "devices": [{"memory_limit_mib": None} for _ in range(4)]})


def replay(problem: Problem, plan, slow_stage: int | None = None, factor: float = 2.0,
           overhead: float = 0.0) -> Trace:
    """A 'measurement' of `plan`: its orders re-timed under costs where one stage is `factor` slower;
    with `overhead`, the runtime keeps the device that long after every compute op (the op's own
    measured end is before it)."""
    from pipeplan.planner.simulator import schedule_from_plan, simulate

    doc = problem.model_dump(mode="json")
    if slow_stage is not None:
        for name in ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms"):
            doc["stages"][slow_stage][name] *= factor
    for stage in doc["stages"]:
        for name in ("forward_ms", "backward_input_ms", "backward_weight_ms"):
            stage[name] += overhead
    truth = Problem.model_validate(doc)
    timing = simulate(truth, schedule_from_plan(plan))
    devices = []
    for dp in plan.devices:
        ops = []
        for p in dp.ops:
            from pipeplan.planner.ops import Kind, Op

            start, end = timing.times[Op(Kind(p.kind), p.stage, p.mb)]
            end -= overhead if p.kind in ("F", "B", "W") else 0.0
            ops.append({"kind": p.kind, "stage": p.stage, "mb": p.mb, "start_ms": start + 5.0, "end_ms": end + 5.0})
        devices.append({"device": dp.device, "ops": ops, "memory_source": "saved_tensors", "peak_memory_mib": 1.0})
    return Trace.model_validate({"problem_key": plan.problem_key, "revision": plan.revision, "clock": "monotonic",
                                 "device_kind": "emulated", "makespan_ms": timing.makespan, "devices": devices})


def test_a_faithful_run_has_no_error_and_its_critical_path_spans_the_iteration():
    prob = problem()
    plan = run_baseline(prob, "1f1b")
    trace = replay(prob, plan)
    assert check_trace(prob, plan, trace) == []
    report = fidelity(prob, plan, trace)
    assert report.measured_ms == pytest.approx(plan.makespan_ms)
    assert abs(report.error_pct) < 1e-9
    assert all(abs(e.error_pct) < 1e-9 for e in report.by_kind.values())
    path = report.critical_path
    assert path[0].op == "F(0,0)" and path[-1].end_ms - path[0].start_ms == pytest.approx(plan.makespan_ms)
    assert all(s.gap_ms < 1e-6 for s in path)


def test_a_slow_stage_shows_in_the_report_and_calibration_replans_for_it():
    prob = problem()
    plan = run_baseline(prob, "1f1b")
    trace = replay(prob, plan, slow_stage=2, factor=2.0)
    report = fidelity(prob, plan, trace)
    assert report.error_pct > 20
    assert report.by_stage[2].error_pct == pytest.approx(100.0)
    assert all(abs(report.by_stage[k].error_pct) < 1e-9 for k in (0, 1, 3))
    assert any(s.op.endswith(",0)") is False and s.device == 2 for s in report.critical_path)
    calibrated = calibrated_problem(prob, [trace])
    assert calibrated.stages[2].forward_ms == pytest.approx(4.0)
    assert calibrated.stages[0].forward_ms == pytest.approx(2.0)
    assert calibrated.p2p_ms == pytest.approx(1.0)
    assert calibrated.metadata["calibrated_from"]["problem_key"] == prob.key()
    # the old plan's orders, timed under the measured costs, are what was measured
    assert retime(calibrated, plan) == pytest.approx(trace.makespan_ms)


def test_a_stage_whose_whole_backward_ran_in_w_keeps_its_activation_until_w():
    """As torch's PipelineStage runs the first stage (B does nothing, W the whole backward): the
    calibrated stage holds its activation from B to W; the stages whose B measured keep theirs."""
    prob = problem()
    plan = run_baseline(prob, "zb-h1")
    doc = prob.model_dump(mode="json")
    doc["stages"][0].update(backward_input_ms=0.01, backward_weight_ms=4.0)
    trace = replay(Problem.model_validate(doc), plan)
    calibrated = calibrated_problem(prob, [trace])
    assert calibrated.stages[0].backward_weight_ms == pytest.approx(4.0)
    assert calibrated.stages[0].weight_grad_mib == calibrated.stages[0].activation_mib == 10.0
    assert [s.weight_grad_mib for s in calibrated.stages[1:]] == [0.0] * 3
    assert calibrated_problem(prob, [replay(prob, plan)]).stages[0].weight_grad_mib == 0.0
    # a trace of pipeplan's runtime: torch's split backward keeps every stage's activations until W
    ours = replay(prob, plan).model_copy(update={"metadata": {"runtime": PIPEPLAN_RUNTIME}})
    assert [s.weight_grad_mib for s in calibrated_problem(prob, [ours]).stages] == [10.0] * 4


def test_link_latency_is_measured_from_waiting_consumers():
    prob = problem(p2p=1.0)
    plan = run_baseline(prob, "1f1b")
    trace = replay(problem(p2p=3.0), plan.model_copy(update={"problem_key": plan.problem_key}))
    assert calibrated_problem(prob, [trace]).p2p_ms == pytest.approx(3.0)


def test_the_runtime_s_overhead_between_ops_is_counted_into_each_op_and_not_into_the_link():
    prob = problem(p2p=1.0)
    plan = run_baseline(prob, "zb-h1")
    trace = replay(prob, plan, overhead=0.3)
    assert fidelity(prob, plan, trace).measured_ms > plan.makespan_ms + 3  # the overhead adds up
    calibrated = calibrated_problem(prob, [trace])
    assert calibrated.metadata["calibrated_from"]["runtime_overhead_ms"] == pytest.approx(0.3)
    assert calibrated.stages[1].forward_ms == pytest.approx(2.3)
    assert calibrated.stages[1].backward_weight_ms == pytest.approx(2.3)
    assert calibrated.p2p_ms == pytest.approx(1.0)
    assert retime(calibrated, plan) == pytest.approx(trace.makespan_ms)  # predicts what was measured


def test_synchronous_copies_cost_the_overlap_the_plan_counts_on():
    prob = problem()
    plan = run_baseline(prob, "1f1b")
    assert synchronous_copies_makespan(prob, plan) == pytest.approx(plan.makespan_ms)  # nothing to copy
    from torch_ranks import planned

    offload = planned(prob, offload={(0, i) for i in range(prob.num_microbatches)}, recompute=set())
    # device 0's six offloads and six reloads (1 ms each) run inline in its compute order
    assert synchronous_copies_makespan(prob, offload) > offload.makespan_ms + 1.0


def test_traces_of_another_plan_or_malformed_are_refused():
    prob = problem()
    plan = run_baseline(prob, "1f1b")
    trace = replay(prob, plan)
    other = run_baseline(prob, "zb-h1")
    assert any("ops missing" in e or "not in the plan" in e for e in check_trace(prob, other, trace))
    doc = trace.model_dump(mode="json")
    doc["devices"][0]["ops"].pop()
    assert any("missing" in e for e in check_trace(prob, plan, Trace.model_validate(doc)))
    doc = trace.model_dump(mode="json")
    doc["devices"][0]["ops"][0]["end_ms"] = -1.0
    with pytest.raises(ValidationError, match="before start_ms"):
        Trace.model_validate(doc)
    doc = trace.model_dump(mode="json")
    doc["format"] = "pipeplan.trace/v2"
    with pytest.raises(ValidationError, match="format"):
        Trace.model_validate(doc)


def test_chrome_export_puts_measured_lanes_beside_the_planned_ones():
    prob = problem()
    plan = run_baseline(prob, "1f1b")
    trace = replay(prob, plan, slow_stage=1)
    doc = chrome_trace_compared(prob, plan, trace)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    planned = [e for e in slices if e["tid"] < 10]
    measured = [e for e in slices if e["tid"] >= 10]
    assert len(planned) == len(measured) == sum(len(d.ops) for d in plan.devices)
    assert all("planned_start_ms" in e["args"] for e in measured)
    assert doc["otherData"]["measured_makespan_ms"] == pytest.approx(trace.makespan_ms)


def test_cli_fidelity_prints_the_report_and_writes_calibrated_problem_and_chrome(tmp_path):
    prob = problem()
    plan = run_baseline(prob, "1f1b")
    trace = replay(prob, plan, slow_stage=2)
    paths = {name: tmp_path / f"{name}.json" for name in ("problem", "plan", "trace")}
    paths["problem"].write_text(prob.model_dump_json())
    paths["plan"].write_text(plan.model_dump_json())
    paths["trace"].write_text(trace.model_dump_json())
    args = ["fidelity", str(paths["problem"]), str(paths["plan"]), str(paths["trace"])]
    result = runner.invoke(app, args + ["--calibrated", str(tmp_path / "cal.json"),
                                        "--chrome", str(tmp_path / "chrome.json")])
    assert result.exit_code == 0, result.output
    assert "measured critical path" in result.output and "stage 2" in result.output
    assert Problem.model_validate_json((tmp_path / "cal.json").read_text()).stages[2].forward_ms == pytest.approx(4.0)
    assert json.loads((tmp_path / "chrome.json").read_text())["traceEvents"]
    report = json.loads(runner.invoke(app, args + ["--json"]).output)
    assert report["by_stage"]["2"]["error_pct"] == pytest.approx(100.0)
    other = run_baseline(prob, "zb-h1")
    paths["plan"].write_text(other.model_dump_json())
    bad = runner.invoke(app, args)
    assert bad.exit_code == 2 and "is not a run of" in bad.output


def test_an_emulated_wait_ends_at_its_deadline_not_a_sleep_s_overshoot_later():
    """Emulated ops are padded to an absolute end time; a plain sleep wakes 50-100 µs late on Linux,
    which adds up along a critical path. Never early; typically within a small fraction of that."""
    import statistics
    import time

    from pipeplan.client.emulation import wait_until

    late = []
    for _ in range(30):
        deadline = time.perf_counter() + 0.003
        wait_until(deadline)
        late.append(time.perf_counter() - deadline)
    assert min(late) >= 0
    assert statistics.median(late) < 60e-6, statistics.median(late)
