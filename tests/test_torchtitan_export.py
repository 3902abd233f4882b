"""`pipeplan export torchtitan` against torchtitan 0.3.0 itself (the `torchtitan` extra).

torchtitan's `ConfigManager` parses the exported overrides on its llama3 debug model; torchtitan's
own `_split_module` cuts that model (built on the meta device) by our module names; then 2 gloo
ranks build the stages torchtitan's placement rule assigns them and run one step through
torchtitan's schedule builder, which loads our CSV: gradients equal a single-process reference.
"""

from __future__ import annotations

import json
import shlex

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy", reason="gloo's shape inference needs numpy")
pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (.[torchtitan])")

from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Problem
from pipeplan.planner.documents import problem_from_document
from torch_ranks import reference_grads, spawn_torchtitan
from typer.testing import CliRunner

from pipeplan.cli import app

pytestmark = pytest.mark.torch

DEBUGMODEL = {"name": "llama3 debugmodel", "layers": 6, "hidden": 256, "heads": 16, "ffn": 768, "vocab": 2048,
              "seq_len": 2048, "micro_batch_size": 1}


def debug_problem(placement: str, microbatches: int = 4) -> Problem:
    """torchtitan's llama3 debug model (6 layers) on 2 devices, two stages each, loop or V."""
    return problem_from_document({
        "model": DEBUGMODEL, "hardware": "H100-80GB", "partition": "uniform",
        "training": {"devices": 2, "microbatches": microbatches, "placement": placement, "chunks": 2}})


def export(tmp_path, problem: Problem, plan, name: str) -> list[str]:
    """Run the CLI (as users do) and return torchtitan.args' arguments."""
    problem_file, plan_file, out = (tmp_path / f"{name}.problem.json", tmp_path / f"{name}.plan.json",
                                    tmp_path / name)
    problem_file.write_text(problem.model_dump_json())
    plan_file.write_text(plan.model_dump_json())
    done = CliRunner().invoke(app, ["export", "torchtitan", str(problem_file), str(plan_file), "--out",
                                    str(out)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert "torchtitan: as planned" in done.output
    assert json.loads((out / "export.json").read_text())["format"] == "pipeplan.runtimes/v1"
    return shlex.split((out / "torchtitan.args").read_text())


@pytest.mark.integration
def test_torchtitan_parses_splits_and_runs_the_export(tmp_path):
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.pipeline_parallel import _split_module

    cases = []
    for placement, baseline in (("loop", "interleaved-1f1b"), ("v", "zb-v")):
        problem = debug_problem(placement)
        args = export(tmp_path, problem, run_baseline(problem, baseline), placement)
        config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *args])
        par = config.parallelism
        assert par.pipeline_parallel_degree == 2
        expected = {"loop": "PipelineScheduleMulti", "v": "ZBVZeroBubble"}[placement]
        assert par.pipeline_parallel_schedule == expected
        microbatches = config.training.local_batch_size // par.pipeline_parallel_microbatch_size
        assert microbatches == problem.num_microbatches
        assert config.training.disable_cuda_graphs and config.activation_checkpoint is None
        assert len(par.module_fqns_per_model_part) == problem.num_stages
        # torchtitan's own split of its own model by our names: every parameter in exactly one stage
        with torch.device("meta"):
            model = config.model_spec.model.build()
        assert len(model.layers) == DEBUGMODEL["layers"]
        owned = [name for names in par.module_fqns_per_model_part
                 for name, _ in _split_module(model, names).named_parameters()]
        assert sorted(owned) == sorted(name for name, _ in model.named_parameters())
        cases.append((problem, par, config.training.local_batch_size))

    reports = spawn_torchtitan(2, [(par, batch, problem.num_stages) for problem, par, batch in cases],
                               str(tmp_path))
    for (problem, _, _), report in zip(cases, reports):
        reference = reference_grads(problem.num_stages, problem.num_microbatches)
        for rank, rank_report in enumerate(report):
            assert rank_report["stages"] == problem.stages_of(rank)  # torchtitan placed them as we did
            assert rank_report["schedule"] == "_PipelineScheduleRuntime"
            for k, grads in rank_report["grads"].items():
                for got, want in zip(grads, reference[int(k)]):
                    got = torch.tensor(got, dtype=want.dtype)
                    assert torch.allclose(got, want, atol=1e-9, rtol=0), (rank, k)
