"""`pipeplan export megatron` against megatron-core 0.16.1 itself (the `megatron` extra).

megatron-core's `PipelineParallelLayerLayout` parses and validates the exported layout, which must
hold our partition stage by stage; its `TransformerConfig` accepts the exported pipeline and
recompute arguments together (the checks Megatron-LM runs at start-up).
"""

from __future__ import annotations

import importlib.util
import shlex

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("megatron") is None:  # found, not imported: megatron.core takes seconds to load
    pytest.skip("the megatron extra is not installed (.[megatron])", allow_module_level=True)

from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.exports import stage_layers
from pipeplan.planner.megatron_args import megatron_export
from torch_ranks import planned

pytestmark = pytest.mark.torch
LETTERS = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}


def spec_problem(model: dict, partition, devices: int = 4, chunks: int = 1, microbatches: int = 8) -> Problem:
    return problem_from_document({
        "model": {"hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 512, "micro_batch_size": 2, **model},
        "hardware": "H100-80GB", "partition": partition,
        "training": {"devices": devices, "chunks": chunks, "microbatches": microbatches, "recompute": True}})


def all_pairs(problem: Problem) -> set[tuple[int, int]]:
    return {(k, i) for k in range(problem.num_stages) for i in range(problem.num_microbatches)}


def megatron_config(problem: Problem, plan: Plan):
    """Exported lines -> megatron-core's TransformerConfig (its __post_init__ validates them)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    export = megatron_export(problem, plan, data_parallel=2)
    args = dict(shlex.split(line) if " " in line else (line, None) for line in export.lines())
    assert int(args["--global-batch-size"]) == problem.num_microbatches * int(args["--micro-batch-size"]) * 2
    fields = ("--num-layers", "--pipeline-model-parallel-size", "--pipeline-model-parallel-layout",
              "--mtp-num-layers", "--recompute-granularity", "--recompute-method", "--recompute-num-layers")
    kwargs = {flag[2:].replace("-", "_"): value for flag, value in args.items() if flag in fields}
    for name in ("num_layers", "pipeline_model_parallel_size", "mtp_num_layers", "recompute_num_layers"):
        if name in kwargs:
            kwargs[name] = int(kwargs[name])
    config = TransformerConfig(hidden_size=256, num_attention_heads=8, pipeline_dtype=torch.bfloat16,
                               **kwargs)
    return export, config


@pytest.mark.parametrize("model,partition,chunks,recompute", [
    ({"layers": 30}, "balanced", 2, "all"),  # interleaved, every pair recomputed: exact recompute
    ({"layers": 13}, [2, 3, 3, 2, 2, 1, 1, 1], 2, "some"),  # uneven (layers per stage, embedding and head in)
    ({"layers": 7, "experts": 8, "top_k": 2, "moe_ffn": 256, "mtp_heads": 1}, "uniform", 1, "none"),
    ({"layers": 14, "experts": 8, "top_k": 2, "moe_ffn": 256, "mtp_heads": 1}, "uniform", 2, "none"),
])
def test_megatron_core_accepts_the_layout_and_recompute(model, partition, chunks, recompute):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    problem = spec_problem(model, partition, chunks=chunks)
    pairs = {"all": all_pairs(problem), "some": {(0, 0), (3, 5)}, "none": set()}[recompute]
    plan = planned(problem, offload=set(), recompute=pairs) if pairs else run_baseline(
        problem, "interleaved-1f1b" if chunks > 1 else "1f1b")
    export, config = megatron_config(problem, plan)

    layout = PipelineParallelLayerLayout(export.layout, problem.num_devices)
    layout.validate_layer_layout(config.num_layers, config.mtp_num_layers)
    assert layout.virtual_pipeline_model_parallel_size == chunks == export.virtual_stages
    # stage k is virtual stage k // P of rank k % P, holding exactly our stage's layers
    ours = [[{"embedding": "E", "lm_head": "L", "mtp_head": "m"}.get(t, "t") for t in types]
            for types in stage_layers(problem)]
    head = next(k for k, s in enumerate(ours) if "L" in s)
    ours[head].remove("L")
    ours[-1].append("L")  # Megatron computes the loss last
    p = problem.num_devices
    theirs = ["".join(LETTERS[x.name] for x in layout.layout[k % p][k // p])
              for k in range(problem.num_stages)]
    assert theirs == ["".join(s) for s in ours]
    if pairs:
        assert (config.recompute_granularity, config.recompute_method) == ("full", "uniform")
        counts = [s.count("t") for s in theirs if s.count("t")]
        assert all(c % config.recompute_num_layers == 0 for c in counts)  # Megatron indexes within a stage
        assert (recompute == "some") == any("flags recompute all" in line for line in export.cannot_express)
    else:
        assert config.recompute_granularity is None
    if head != problem.num_stages - 1:
        assert any("LM head" in line for line in export.cannot_express)
