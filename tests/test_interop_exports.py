"""Exports for the stacks people train with, without the stacks: torch's CSV made runnable by torch's
stock runtime (renumbered, compute order only or refused), torchtitan overrides, Megatron-LM
arguments, the per-plan runtime statement, and the `pipeplan export` commands.

The stacks' own parsers check the same exports in test_torchtitan_export.py, test_megatron_export.py
and test_torch_csv_runtime.py."""

from __future__ import annotations

import json

import pytest
from core_schedules import make_problem, one_f_one_b, plan_of, problem_doc, serialized
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.exports import (
    ExportRefused,
    last_stage_forward_order,
    placement_of,
    relabel_microbatches,
    stage_layers,
    torch_actions,
    torch_schedule,
)
from pipeplan.planner.megatron_args import layout_string, megatron_export
from pipeplan.planner.runtimes import runtimes_document, torch_peaks
from pipeplan.planner.torchtitan_args import module_fqns, schedule_class, torchtitan_export
from pipeplan.planner.validator import validate_plan
from typer.testing import CliRunner

from pipeplan.cli import app


def spec_problem(devices: int = 2, chunks: int = 1, placement: str = "loop", microbatches: int = 4,
                 partition: str | list[int] = "uniform", **model) -> Problem:
    return problem_from_document({
        "model": {"layers": 6, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 512,
                  "micro_batch_size": 2, **model},
        "hardware": "H100-80GB", "partition": partition,
        "training": {"devices": devices, "chunks": chunks, "placement": placement,
                     "microbatches": microbatches, "offload": True, "recompute": True}})


def tight_offload_case():
    """Limits 60% of the way from the floor to 1F1B's peak: pipeoffload fits only by offloading."""
    doc = problem_doc(p=4, m=8, p2p=0.05, offload=True, recompute=True)
    problem = Problem.model_validate(doc)
    peak, floor = run_baseline(problem, "1f1b").peak_memory_mib, min_memory(problem)
    for d, device in enumerate(doc["devices"]):
        device["memory_limit_mib"] = floor[d] + 0.6 * (peak[d] - floor[d])
    problem = Problem.model_validate(doc)
    return problem, run_baseline(problem, "pipeoffload")


def v_memory_case():
    """V placement, offload and recompute planned, and the compute order alone still fits 260 MiB."""
    doc = problem_doc(p=2, m=3, chunks=2, placement="v", offload=True, recompute=True, limit=260.0)
    doc["stages"][0]["checkpoint_mib"] = 90.0
    doc["stages"][1]["checkpoint_mib"] = 5.0
    problem = Problem.model_validate(doc)
    return problem, plan_of(problem, serialized(problem))


# -- torch's stock runtime --------------------------------------------------------------------------
def test_an_in_order_plan_goes_to_torch_unchanged():
    problem = make_problem(p=4, m=8, p2p=0.1)
    plan = plan_of(problem, one_f_one_b(problem))
    schedule = torch_schedule(problem, plan)
    assert schedule.plan == plan and schedule.as_planned and schedule.notes == []
    assert schedule.microbatch_order == list(range(8))


def test_out_of_order_forwards_are_renumbered_on_every_rank():
    problem = make_problem(p=2, m=4, chunks=2, placement="v", split=False)
    plan = relabel_microbatches(problem, run_baseline(problem, "gpipe"), [2, 0, 3, 1])  # 2 -> 0, 0 -> 1, ...
    order = last_stage_forward_order(problem, plan)
    assert order == [1, 3, 0, 2]
    schedule = torch_schedule(problem, plan)
    assert schedule.microbatch_order == order and schedule.as_planned
    assert last_stage_forward_order(problem, schedule.plan) == [0, 1, 2, 3]
    assert validate_plan(problem, schedule.plan) == [] and schedule.plan.makespan_ms == plan.makespan_ms
    # the same permutation everywhere: each device's ops keep their times, only the labels change
    for before, after in zip(plan.devices, schedule.plan.devices):
        assert [(p.kind, p.stage, p.start_ms) for p in before.ops] == [
            (p.kind, p.stage, p.start_ms) for p in after.ops]
        assert [order[p.mb] for p in after.ops] == [p.mb for p in before.ops]
    assert "renumbered" in schedule.notes[0]
    with pytest.raises(ValueError, match="permutation"):
        relabel_microbatches(problem, plan, [0, 0, 1, 2])


def test_memory_actions_are_left_out_when_the_compute_order_fits():
    problem, plan = v_memory_case()
    schedule = torch_schedule(problem, plan)
    kinds = {p.kind for d in schedule.plan.devices for p in d.ops}
    assert kinds == {"F", "B", "W"} and not schedule.as_planned and schedule.left_out > 0
    assert validate_plan(problem, schedule.plan) == []
    assert max(schedule.plan.peak_memory_mib) > max(plan.peak_memory_mib)  # it keeps what the plan dropped
    assert "left out" in schedule.notes[0] and "MiB" in schedule.notes[0]
    # the compute order is the plan's, in the same order on every device
    original = [[a for a in row] for row in torch_actions(plan)]
    assert torch_actions(schedule.plan) == original


def test_an_offload_plan_that_needs_its_offloads_is_refused_with_the_memory_it_would_need():
    problem, plan = tight_offload_case()
    assert any(p.kind == "OFFLOAD" for d in plan.devices for p in d.ops)
    with pytest.raises(ExportRefused, match=r"device 0 would need \d+ MiB \(limit \d+ MiB\)") as caught:
        torch_schedule(problem, plan)
    assert "pipeplan's runtime" in str(caught.value)


def test_runtimes_say_per_plan_who_runs_it_as_planned():
    problem, plan = tight_offload_case()
    doc = json.loads(json.dumps(runtimes_document(problem, plan)))
    by = {r["runtime"]: r for r in doc["runtimes"]}
    assert by["pipeplan"]["runs"] and not by["torch"]["runs"] and not by["torchtitan"]["runs"]
    assert doc["torch_microbatch_order"] is None
    # PipeOffload's W's come late: held from B to W, as torch's split backward holds them, the
    # activations take devices 1 and 2 over their limits (device 2: 200 MiB, planned 100, limit 160)
    held = torch_peaks(problem, plan)
    over = [d for d in range(4) if held[d] > problem.limit_of(d) + 1e-6]
    assert over == [1, 2] and not by["pipeplan"]["as_planned"]
    assert (f"device 2 peaks at {held[2]:.0f} MiB, not the planned {plan.peak_memory_mib[2]:.0f}"
            f" (limit {problem.limit_of(2):.0f} MiB, over it); 2 device(s) over") in by["pipeplan"]["note"]
    # ZB-H2 at exactly its own peaks: its late W's take 3 of 4 devices over their limits under torch
    doc = problem_doc(p=4, m=8, weight_grad_mib=20.0)
    peaks = run_baseline(Problem.model_validate(doc), "zb-h2").peak_memory_mib
    for device, limit in zip(doc["devices"], peaks):
        device["memory_limit_mib"] = limit
    tight = Problem.model_validate(doc)
    zb_h2 = run_baseline(tight, "zb-h2")
    assert sum(h > limit + 1e-6 for h, limit in zip(torch_peaks(tight, zb_h2), peaks)) == 3
    by = {r["runtime"]: r for r in runtimes_document(tight, zb_h2)["runtimes"]}
    assert not by["pipeplan"]["as_planned"] and not by["torch"]["as_planned"]
    assert "3 device(s) over their limits" in by["torch"]["note"]
    spec = spec_problem()
    by = {r["runtime"]: r for r in runtimes_document(spec, run_baseline(spec, "1f1b"))["runtimes"]}
    assert by["torch"]["as_planned"] and by["torchtitan"]["as_planned"]
    assert by["megatron"]["runs"] and not by["megatron"]["as_planned"]
    # torch's split backward holds activations from B to W: said where the plan splits a backward
    held_note = "keeps a microbatch's saved activations from its B to its W"
    assert not any(held_note in r["note"] for r in by.values())
    by = {r["runtime"]: r for r in runtimes_document(spec, run_baseline(spec, "zb-h1"))["runtimes"]}
    assert all(held_note in by[name]["note"] and by[name]["as_planned"]
               for name in ("pipeplan", "torch", "torchtitan"))


# -- partition and placement ------------------------------------------------------------------------
def test_stage_layers_and_placement():
    problem = spec_problem(devices=2, chunks=2, placement="v")
    layers = stage_layers(problem)
    assert [t for s in layers for t in s] == ["embedding", *["dense"] * 6, "lm_head"]
    assert placement_of(problem) == "v" and placement_of(spec_problem(chunks=2)) == "loop"
    odd = problem_doc(p=2, m=2, chunks=2)
    odd["stages"][0]["device"], odd["stages"][1]["device"] = 1, 0
    assert placement_of(Problem.model_validate(odd)) is None
    with pytest.raises(ExportRefused, match="metadata.partition"):
        stage_layers(make_problem(p=2, m=2))


# -- torchtitan --------------------------------------------------------------------------------------
def test_torchtitan_args_agree_with_the_csv_and_the_partition():
    problem = spec_problem(devices=2, chunks=2, placement="v")
    export = torchtitan_export(problem, run_baseline(problem, "zb-v"), "/jobs/run1/schedule.csv")
    args = dict(line.split(" ", 1) if " " in line else (line, None) for line in export.args)
    assert args["--parallelism.pipeline_parallel_degree"] == "2"
    assert args["--parallelism.pipeline_parallel_schedule"] == "ZBVZeroBubble"
    assert args["--parallelism.pipeline_parallel_schedule_csv"] == "/jobs/run1/schedule.csv"
    assert args["--parallelism.pipeline_parallel_microbatch_size"] == "2"
    assert args["--training.local_batch_size"] == str(2 * problem.num_microbatches)
    parts = [p.split(",") for p in args["--parallelism.module_fqns_per_model_part"].split(" ")]
    assert parts == module_fqns(problem) and len(parts) == problem.num_stages
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    assert [n for p in parts for n in p if n.startswith("layers.")] == [f"layers.{i}" for i in range(6)]
    assert export.args[-1] == "activation-checkpoint:none" and "--training.disable_cuda_graphs" in args


def test_torchtitan_schedule_class_follows_the_placement_and_refuses_what_it_cannot_place():
    assert schedule_class(spec_problem(chunks=1)) == "PipelineScheduleSingle"
    assert schedule_class(spec_problem(chunks=2)) == "PipelineScheduleMulti"
    assert schedule_class(spec_problem(chunks=2, placement="v")) == "ZBVZeroBubble"
    with pytest.raises(ExportRefused, match="loop .* or V"):
        schedule_class(make_problem(p=2, m=2, chunks=4, placement="v"))
    with pytest.raises(ExportRefused, match="mtp_head"):
        module_fqns(spec_problem(mtp_heads=1))
    problem = spec_problem()
    with pytest.raises(ExportRefused, match="whitespace"):
        torchtitan_export(problem, run_baseline(problem, "1f1b"), "/my jobs/schedule.csv")


# -- Megatron-LM -------------------------------------------------------------------------------------
def test_layout_strings_compress_repeats_without_adding_stages():
    assert layout_string(["Ettt", *["tt"] * 29, "m", "L"]) == "Et*3|(tt|)*29,m|L"
    assert layout_string(["Et", "tt", "tt", "tL"]) == "Et|(tt|)*2,tL"
    assert layout_string(["Et", "tt", "tt"]) == "Et|tt|tt"
    assert layout_string(["Et", "tt", "tt", "tt"]) == "Et|(tt|)*2,tt"
    assert layout_string(["EtL"]) == "EtL"


def test_megatron_refuses_what_it_cannot_place():
    with pytest.raises(ExportRefused, match="loop placement"):
        problem = spec_problem(chunks=2, placement="v")
        megatron_export(problem, run_baseline(problem, "zb-v"))
    with pytest.raises(ExportRefused, match="multiple of the pipeline size"):
        problem = spec_problem(devices=2, chunks=2, microbatches=3)
        megatron_export(problem, run_baseline(problem, "interleaved-1f1b"))
    with pytest.raises(ExportRefused, match="hybrid"):
        problem = spec_problem(pattern="M*M-M*", layers=None)
        megatron_export(problem, run_baseline(problem, "1f1b"))


def test_megatron_reports_offload_and_the_op_order_as_not_expressible():
    problem = spec_problem(devices=4, microbatches=8, layers=6)
    limited = problem.model_dump(mode="json")
    peak, floor = run_baseline(problem, "1f1b").peak_memory_mib, min_memory(problem)
    for d, device in enumerate(limited["devices"]):
        device["memory_limit_mib"] = floor[d] + 0.5 * (peak[d] - floor[d])
    problem = Problem.model_validate(limited)
    plan = run_baseline(problem, "pipeoffload")
    export = megatron_export(problem, plan, data_parallel=4)
    assert any(line.startswith("offload:") for line in export.cannot_express)
    assert any(line.startswith("the op order") for line in export.cannot_express)
    assert "--global-batch-size 64" in export.lines()  # 8 microbatches x 2 per microbatch x 4 replicas
    assert not any(line.startswith("--recompute") for line in export.lines())


# -- the commands ------------------------------------------------------------------------------------
def _files(tmp_path, problem, plan):
    (tmp_path / "problem.json").write_text(problem.model_dump_json())
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    return str(tmp_path / "problem.json"), str(tmp_path / "plan.json")


def test_export_commands(tmp_path):
    runner = CliRunner()
    problem = spec_problem(devices=2, chunks=2)
    plan = run_baseline(problem, "interleaved-1f1b")
    files = _files(tmp_path, problem, plan)
    done = runner.invoke(app, ["export", "torch", *files, "--out", str(tmp_path / "s.csv")])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "s.csv").read_text().splitlines() == [",".join(r) for r in torch_actions(plan)]
    assert "torch: as planned" in done.output and "megatron: in part" in done.output
    done = runner.invoke(app, ["export", "torchtitan", *files, "--out", str(tmp_path / "tt"), "--csv-path",
                               "schedule.csv"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "tt" / "schedule.csv").exists()
    args = (tmp_path / "tt" / "torchtitan.args").read_text()
    assert "--parallelism.pipeline_parallel_schedule_csv schedule.csv" in args
    assert json.loads((tmp_path / "tt" / "export.json").read_text())["runtimes"][0]["runtime"] == "pipeplan"
    done = runner.invoke(app, ["export", "megatron", *files])
    assert done.exit_code == 0 and "--pipeline-model-parallel-layout 'Ett|tt|t|tL'" in done.stdout
    assert "cannot express: the op order" in done.output
    done = runner.invoke(app, ["export", "runtimes", *files])
    assert json.loads(done.stdout)["format"] == "pipeplan.runtimes/v1"


def test_export_commands_refuse_clearly(tmp_path):
    runner = CliRunner()
    problem, plan = tight_offload_case()
    files = _files(tmp_path, problem, plan)
    done = runner.invoke(app, ["export", "torch", *files])
    assert done.exit_code == 2 and "error: cannot export to torch: " in done.output
    assert "would need" in done.output
    done = runner.invoke(app, ["export", "torchtitan", *files, "--out", str(tmp_path / "tt")])
    assert done.exit_code == 2 and "metadata.partition" in done.output
    assert not (tmp_path / "tt").exists()
    other = make_problem(p=4, m=8)
    (tmp_path / "other.json").write_text(other.model_dump_json())
    done = runner.invoke(app, ["export", "megatron", str(tmp_path / "other.json"), files[1]])
    assert done.exit_code == 1 and "not a valid plan" in done.output
