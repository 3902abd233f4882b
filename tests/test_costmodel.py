"""Cost model: the worked example of docs/costmodel.md, the published formulas, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeplan.planner.contract import Problem, error_messages
from pipeplan.planner.costmodel import build_problem, layer_costs
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.partition import balanced_partition, stage_device, uniform_partition
from pipeplan.planner.spec import HARDWARE, Spec
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "examples" / "specs"
MIB = 2**20


def llama_doc(**training) -> dict:
    doc = json.loads((SPECS / "llama7b_8xh100.json").read_text())
    doc["training"].update(training)
    return doc


def test_worked_example_llama7b_on_8xh100():
    """Every number computed by hand in docs/costmodel.md."""
    p = problem_from_document(llama_doc())
    h, f, s = 4096, 11008, 4096
    # one block: FLOPs = 2sh(2h+2h) + 2sh*f*3 + 4s^2h
    block_flops = 2 * s * h * 4 * h + 6 * s * h * f + 4 * s * s * h
    assert block_flops == 1_932_735_283_200
    eff = 989e12 * 0.4  # H100 dense BF16 peak x MFU
    f_block = block_flops / eff * 1e3
    assert f_block == pytest.approx(4.8856, abs=1e-4)
    # uniform: stage 0 = embedding + 4 blocks, stages 1..6 = 4 blocks, stage 7 = 4 blocks + LM head
    assert p.metadata["partition"][0] == [0, 5] and p.metadata["partition"][-1] == [29, 34]
    assert p.stages[1].forward_ms == pytest.approx(4 * f_block, abs=1e-3)  # 19.5423
    assert p.stages[1].forward_ms == pytest.approx(19.5423, abs=1e-4)
    # B: linear once + attention core twice; W: linear once
    core = 4 * s * s * h / eff * 1e3
    assert p.stages[1].backward_input_ms == pytest.approx(4 * (f_block + core), abs=1e-3)
    assert p.stages[1].backward_weight_ms == pytest.approx(4 * (f_block - core), abs=1e-3)
    # activation: s*(16h + 8f) bytes per block (flash attention, no dropout, SwiGLU) = 600 MiB
    assert s * (16 * h + 8 * f) / MIB == 600.0
    assert p.stages[1].activation_mib == 2400.0
    # LM head: 2shV FLOPs, fp32 logits 4sV + inputs 4sh bytes
    head_f = 2 * s * h * 32000 / eff * 1e3
    assert p.stages[7].forward_ms == pytest.approx(4 * f_block + head_f, abs=1e-3)  # 22.2565
    assert p.stages[7].activation_mib == pytest.approx(2400 + s * (4 * h + 4 * 32000) / MIB, abs=1e-3)
    # static: 4 blocks x 202,383,360 params x 16 bytes (ZeRO mixed-precision Adam)
    block_params = 2 * h * h + 2 * h * h + 3 * h * f + 2 * h
    assert block_params == 202_383_360
    assert p.devices[1].static_mib == pytest.approx(4 * block_params * 16 / MIB, abs=1e-3)  # 12352.5
    assert p.devices[0].static_mib == pytest.approx((4 * block_params + 32000 * h) * 16 / MIB, abs=1e-3)
    assert p.metadata["model"]["params"] == 6_738_415_616  # Llama-2-7B's published 6.74B
    # p2p: 10 us + 2sh bytes / 360 GB/s; offload: activation bytes / 50 GB/s
    assert p.p2p_ms == pytest.approx(0.01 + 2 * s * h / 360e9 * 1e3, abs=1e-4)
    assert p.stages[1].offload_ms == pytest.approx(2400 * MIB / 50e9 * 1e3, abs=1e-3)
    assert p.devices[0].memory_limit_mib == pytest.approx(79.6 * 1024)


def test_narayanan_and_korthikanti_formulas_exactly():
    """GPT layout (MHA, f = 4h, GeLU, dropout, no flash): 24bsh^2 + 4bs^2h FLOPs and
    sbh(34 + 5as/h) bytes of activations (Korthikanti et al. 2022, Table 2, t = 1)."""
    h, s, a, b = 2048, 1024, 16, 2
    doc = {"model": {"layers": 4, "hidden": h, "heads": a, "vocab": 1000, "seq_len": s,
                     "micro_batch_size": b, "gated_mlp": False, "dropout": True},
           "hardware": "A100-80GB",
           "training": {"devices": 2, "microbatches": 4, "flash_attention": False}}
    spec = Spec.model_validate(doc)
    dense = next(c for c in layer_costs(spec) if c.type == "dense")
    assert dense.flops == 24 * b * s * h * h + 4 * b * s * s * h
    assert dense.activation_bytes == s * b * h * (34 + 5 * a * s / h)
    assert dense.weight_grad_bytes == 32 * s * b * h  # Zero Bubble Table 1
    doc["training"]["flash_attention"] = True
    spec = Spec.model_validate(doc)
    dense = next(c for c in layer_costs(spec) if c.type == "dense")
    assert dense.activation_bytes == 34 * s * b * h


def test_balanced_counts_embedding_and_head():
    doc = json.loads((SPECS / "gemma_like_64xh100.json").read_text())
    doc["partition"] = "uniform"
    uni = problem_from_document(doc)
    doc["partition"] = "balanced"
    bal = problem_from_document(doc)
    cost = lambda p: max(s.forward_ms + s.backward_input_ms + s.backward_weight_ms for s in p.stages)
    assert cost(bal) < 0.9 * cost(uni)  # the 256k-vocabulary head makes the uniform last stage heavy
    last = bal.metadata["partition"][-1]
    assert last[1] - last[0] < uni.metadata["partition"][-1][1] - uni.metadata["partition"][-1][0]


def test_balanced_partition_is_optimal_on_small_cases():
    import itertools

    weights = [5.0, 1.0, 1.0, 1.0, 3.0, 2.0, 2.0, 6.0]
    ranges = balanced_partition(weights, 3)
    best = min(max(sum(weights[a:b]) for a, b in zip((0,) + cuts, cuts + (len(weights),)))
               for cuts in itertools.combinations(range(1, len(weights)), 2))
    assert max(sum(weights[a:b]) for a, b in ranges) == best
    assert all(b > a for a, b in ranges)


def test_uniform_is_megatron_default():
    types = ["embedding"] + ["dense"] * 8 + ["lm_head", "mtp_head"]
    assert uniform_partition(types, 4) == [[0, 3], [3, 5], [5, 7], [7, 11]]


def test_v_placement_and_chunks():
    p = problem_from_document(llama_doc(placement="v", chunks=2))
    assert len(p.stages) == 16
    assert [s.device for s in p.stages] == list(range(8)) + list(range(7, -1, -1))
    assert p.metadata["placement"] == "v" and p.metadata["chunks"] == 2
    assert stage_device(9, 4, "loop") == 1 and stage_device(5, 4, "v") == 2


def test_all_examples_build_valid_problems():
    for path in sorted(SPECS.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("partition") == "auto":
            doc["partition"] = "balanced"
        p = problem_from_document(doc)
        assert isinstance(p, Problem) and p.metadata["partition"][0][0] == 0, path
        Problem.model_validate_json(p.model_dump_json())  # round-trips as a problem v1


def test_profiled_numbers_replace_estimates():
    doc = llama_doc()
    doc["model"]["stack"] = [{"type": "dense", "count": 31},
                             {"type": "dense", "forward_ms": 7.0, "activation_mib": 100.0}]
    doc["partition"] = "balanced"
    spec = Spec.model_validate(doc)
    costs = layer_costs(spec)
    assert costs[32].forward_ms == 7.0 and costs[32].activation_bytes == 100 * MIB
    assert costs[32].backward_input_ms == pytest.approx(costs[31].backward_input_ms)  # estimate kept


def test_presets_and_overrides():
    doc = llama_doc()
    doc["hardware"] = {"preset": "A100-40GB", "mfu": 0.5, "link_gbps": 50}
    p = problem_from_document(doc)
    assert p.devices[0].memory_limit_mib == 40 * 1024
    assert set(HARDWARE) == {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"}


def test_memory_budget_dp_sharding_and_offload_options():
    p = problem_from_document(llama_doc(memory_budget_gib=30, dp_shards=4, offload=True, recompute=True))
    assert p.devices[0].memory_limit_mib == 30 * 1024
    assert p.devices[1].static_mib == pytest.approx(4 * 202_383_360 * (4 + 3) / MIB, abs=1e-3)
    assert p.options.offload and p.options.recompute


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["model"].pop("hidden"), "model.hidden"),
    (lambda d: d["model"].update(kv_heads=5), "kv_heads"),
    (lambda d: d.update(hardware="B300"), "hardware"),
    (lambda d: d["training"].update(devices=40), "training"),
    (lambda d: d.update(partition=[1, 2, 3]), "partition"),
    (lambda d: d["training"].update(placement="v", chunks=3), "chunks"),
    (lambda d: d["model"].update(hiddne=1), "hiddne"),
    (lambda d: d["training"].update(memory_budget_gib=[1, 2]), "memory_budget_gib"),
])
def test_errors_name_the_field(mutate, field):
    doc = llama_doc()
    mutate(doc)
    with pytest.raises((ValidationError, ValueError)) as info:
        problem_from_document(doc)
    assert field in "; ".join(error_messages(info.value))


def test_detects_documents():
    p = problem_from_document(llama_doc())
    again = problem_from_document(json.loads(p.model_dump_json()))
    assert again.key() == p.key()
    with pytest.raises(ValueError, match="neither a problem v1"):
        problem_from_document({"hello": 1})


def test_build_problem_rejects_bad_ranges():
    spec = Spec.model_validate(llama_doc())
    with pytest.raises(ValueError, match="partition"):
        build_problem(spec, [[0, 5], [6, 34]] + [[0, 1]] * 6)


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(2, 24), heads=st.sampled_from([4, 8, 16]), mult=st.integers(8, 64),
       vocab=st.integers(1000, 300_000), devices=st.integers(1, 6), chunks=st.integers(1, 2),
       placement=st.sampled_from(["loop", "v"]), pattern=st.booleans())
def test_random_specs_build_valid_problems_and_balanced_never_loses(
        layers, heads, mult, vocab, devices, chunks, placement, pattern):
    chunks = 2 if placement == "v" else chunks
    model = {"hidden": heads * mult, "heads": heads, "vocab": vocab, "seq_len": 512}
    if pattern:
        model["pattern"] = "".join("DM*-"[i % 4] for i in range(layers))
    else:
        model["layers"] = layers
    if layers + 2 < devices * chunks:
        return
    doc = {"model": model, "hardware": "H200-141GB",
           "training": {"devices": devices, "microbatches": 4, "placement": placement, "chunks": chunks}}
    loads = {}
    for strategy in ("uniform", "balanced"):
        problem = problem_from_document({**doc, "partition": strategy})
        ranges = problem.metadata["partition"]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(problem.metadata["layers"])
        assert all(b > a for a, b in ranges) and len(ranges) == devices * chunks
        loads[strategy] = max(s.forward_ms + s.backward_input_ms + s.backward_weight_ms for s in problem.stages)
    assert loads["balanced"] <= loads["uniform"] + 1e-3


def test_backward_frees_at_w_plans_for_torch_s_split_backward():
    """`training.backward_frees: at_w` (torch's PipelineStage: B retains the graph for W) keeps every
    stage's whole activation until W; the default (Zero Bubble's) keeps only what W needs."""
    from pipeplan.planner.baselines import run_baseline
    from pipeplan.planner.runtimes import torch_peaks

    zb = problem_from_document(llama_doc())
    torch = problem_from_document(llama_doc(backward_frees="at_w"))
    assert all(s.weight_grad_mib < s.activation_mib for s in zb.stages)
    assert all(s.weight_grad_mib == s.activation_mib for s in torch.stages)
    # and B's output gradients beside them (none on the first stage, whose W runs the whole
    # backward): s(7h + 2f) 16-bit values per block, 4 blocks = 1,584 MiB, what an H200's allocator
    # grew by across B for this very shape (docs/torch.md, "On a GPU")
    assert torch.stages[0].output_grad_mib is None and all(s.output_grad_mib is None for s in zb.stages)
    assert [s.output_grad_mib for s in torch.stages[1:-1]] == [1584.0] * (torch.num_stages - 2)
    assert [s.activation_mib for s in torch.stages] == [s.activation_mib for s in zb.stages]
    plan = run_baseline(torch, "zb-h1")  # W's late: what the plan counts is what torch holds
    assert torch_peaks(torch, plan) == pytest.approx(plan.peak_memory_mib)
    zb_plan = run_baseline(zb, "zb-h2")
    assert max(torch_peaks(zb, zb_plan)) > max(zb_plan.peak_memory_mib)
