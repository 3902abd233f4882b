"""`pipeplan profile`: a torch model's measured per-layer costs become a spec's stack and a problem."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from pipeplan.planner.contract import Problem
from pipeplan.planner.spec import Spec
from typer.testing import CliRunner

from pipeplan.cli import app

pytestmark = pytest.mark.torch
runner = CliRunner()


def test_profile_writes_a_spec_with_measured_layers_and_its_problem(tmp_path):
    base = json.loads(open("examples/specs/llama7b_8xh100.json").read())
    base["training"]["devices"] = 2
    (tmp_path / "base.json").write_text(json.dumps(base))
    args = ["profile", "torch_ranks:tiny_model", "--base", str(tmp_path / "base.json"), "--repeats", "2"]
    result = runner.invoke(app, args + ["--out", str(tmp_path / "spec.json")])
    assert result.exit_code == 0, result.output
    spec = Spec.model_validate_json((tmp_path / "spec.json").read_text())
    stack = spec.model.stack
    assert [g.type for g in stack] == ["embedding"] + ["dense"] * 4 + ["lm_head"]
    dense = stack[1]
    assert dense.forward_ms > 0 and dense.backward_input_ms > 0 and dense.backward_weight_ms > 0
    # saved: the first Linear's output and the GELU's output (4x16x128 fp32 each) + the block's output
    assert dense.activation_mib == pytest.approx((2 * 4 * 16 * 128 + 4 * 16 * 32) * 4 / 2**20, abs=1e-5)
    assert dense.params == 32 * 128 + 128 + 128 * 32 + 32
    result = runner.invoke(app, args + ["--problem"])
    assert result.exit_code == 0, result.output
    problem = Problem.model_validate_json(result.stdout)
    assert problem.num_devices == 2
    # the profiled numbers, not the formulas, make the stage costs (each run measures anew: the
    # spec written above is turned into its problem here)
    from pipeplan.planner.documents import problem_from_spec

    from_spec = problem_from_spec(spec)
    assert sum(s.forward_ms for s in from_spec.stages) == pytest.approx(sum(g.forward_ms for g in stack), rel=1e-3)


def test_profile_names_a_factory_it_cannot_load(tmp_path):
    result = runner.invoke(app, ["profile", "no_such_module:f", "--base", "examples/specs/llama7b_8xh100.json"])
    assert result.exit_code == 2 and "cannot load" in result.output


def test_profiled_backward_is_the_backward_a_training_step_takes(monkeypatch):
    """B + W is one backward's work (torch's split backward computes each activation gradient once,
    in B, and W only the weight gradients), not B plus a weight pass of its own that walks the
    activation gradients again (1.68x the run's backward on an H200). Measured in FLOPs instead of
    milliseconds (the profiler's clock swapped for torch's FLOP counter), so the check is exact: for
    linear layers F, B (every input gradient) and W (every weight gradient) each do 2 x rows x weights."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pipeplan.client import profiler

    def flop_meter(work) -> float:
        with FlopCounterMode(display=False) as counter:
            work()
        return float(counter.get_total_flops())
    monkeypatch.setattr(profiler, "_timer", lambda device: lambda works: [flop_meter(w) for w in works])
    rows, sizes = 64, [(32, 128), (128, 32), (32, 32)]
    block = torch.nn.Sequential(*(m for n, k in sizes for m in (torch.nn.Linear(n, k), torch.nn.GELU())))
    numbers, _ = profiler.profile_layer(block, torch.randn(rows, 32), repeats=1)
    each = 2.0 * rows * sum(n * k for n, k in sizes)
    passes = (numbers["forward_ms"], numbers["backward_input_ms"], numbers["backward_weight_ms"])
    assert passes == (each, each, each)


def test_profiled_output_gradients_are_what_b_leaves_for_w():
    """torch's B keeps, for W, the gradient of every weight-consuming op's output: in a Llama-like
    block q, k, v, o and down (width each), gate and up (ffn each) and the two norms' scales (width
    each), per token. The profile reads them from torch's own param groups; on an H200 the allocator
    grew by exactly that across B (1,584 MiB for 4 blocks at width 4096, docs/torch.md)."""
    import torch

    from bench.llama_stage import ffn_width, make_stage
    from pipeplan.client.profiler import profile_stack

    width, seq = 128, 32
    blocks = make_stage(width, 2, torch.float32, torch.device("cpu"))
    groups = profile_stack([("dense", b) for b in blocks], torch.randn(1, seq, width), repeats=1)
    per_block = seq * (7 * width + 2 * ffn_width(width)) * 4 / 2**20
    assert [g["output_grad_mib"] for g in groups] == [pytest.approx(per_block, abs=1e-6)] * 2
    head = torch.nn.Linear(width, 64)  # one product: the gradient it is handed is what W needs
    (group,) = profile_stack([("head", head)], torch.randn(seq, width), repeats=1)
    assert group["output_grad_mib"] == pytest.approx(seq * 64 * 4 / 2**20, abs=1e-6)
