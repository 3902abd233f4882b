"""The parallel cost model: spec fields and their errors, per-GPU formulas against hand-worked figures
(Narayanan, Korthikanti with and without sequence parallelism), links and collectives, the whole
iteration on the problem, and specs without the new fields keeping their keys."""

from __future__ import annotations

import copy

import pytest
from pipeplan.planner.contract import Problem, error_messages
from pipeplan.planner.costmodel import layer_costs
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.layout import Layout
from pipeplan.planner.spec import CLUSTERS, HARDWARE, Spec
from pydantic import ValidationError

GPT = {"layers": 4, "hidden": 2048, "heads": 16, "vocab": 1000, "seq_len": 1024, "micro_batch_size": 2,
       "gated_mlp": False, "dropout": True}


def gpt_spec(parallel: dict | None = None, **top) -> Spec:
    doc = {"model": dict(GPT), "hardware": "H100-80GB", "training": {"devices": 2, "microbatches": 4,
           "flash_attention": False}, "parallel": parallel or {"tp": 1}, **top}
    return Spec.model_validate(doc)


def dense(spec: Spec):
    return next(c for c in layer_costs(spec) if c.type == "dense")


# --------------------------------------------------------------------------------------------------
# Old specs keep their problems
# --------------------------------------------------------------------------------------------------
LEGACY = [  # examples/specs as they were before parallel/precision/cluster existed, with their keys
    ({"format": "pipeplan.spec/v1",
      "model": {"name": "Llama-2-7B", "layers": 32, "hidden": 4096, "ffn": 11008, "heads": 32, "kv_heads": 32,
                "vocab": 32000, "seq_len": 4096, "micro_batch_size": 1, "dtype": "bf16", "gated_mlp": True},
      "hardware": "H100-80GB",
      "training": {"devices": 8, "microbatches": 32, "placement": "loop", "chunks": 1, "offload": False,
                   "recompute": False, "flash_attention": True},
      "partition": "uniform"}, "03138338b07924cd73cb954ac362d407c9894c879f559e01c8e2ccf2b61c9385"),
    ({"format": "pipeplan.spec/v1",
      "model": {"name": "Llama-2-70B", "layers": 80, "hidden": 8192, "ffn": 28672, "heads": 64, "kv_heads": 8,
                "vocab": 32000, "seq_len": 4096, "micro_batch_size": 1, "dtype": "bf16"},
      "hardware": {"preset": "A100-80GB", "mfu": 0.45, "link_gbps": 25, "link_latency_us": 20},
      "training": {"devices": 16, "microbatches": 64, "placement": "loop", "chunks": 1, "memory_budget_gib": 78,
                   "dp_shards": 8, "offload": True},
      "partition": "balanced"}, "a30c1bb3dd02f899d14a506971d3b5a0ab5d1d378b7c8cdb66a42568b16291c3"),
    ({"format": "pipeplan.spec/v1",
      "model": {"name": "DeepSeek-V2-Lite-like MoE + MTP head", "layers": 27, "hidden": 2048, "ffn": 10944,
                "heads": 16, "kv_heads": 16, "head_dim": 128, "vocab": 102400, "seq_len": 4096,
                "micro_batch_size": 1, "dtype": "bf16", "experts": 64, "top_k": 6, "moe_ffn": 1408,
                "shared_experts": 2, "first_dense_layers": 1, "mtp_heads": 1},
      "hardware": "H100-80GB",
      "training": {"devices": 8, "microbatches": 32, "placement": "v", "dp_shards": 4, "memory_budget_gib": 60},
      "partition": "balanced"}, "40b8358e3aa33d55667e45ebdd5d171eaa099a28fd1549e4c67b68f93c22c929"),
    ({"format": "pipeplan.spec/v1",
      "model": {"name": "Nemotron-H-8B-like hybrid (Mamba-2 / attention / MLP)", "hidden": 4096, "ffn": 21504,
                "heads": 32, "kv_heads": 8, "vocab": 131072, "seq_len": 8192, "micro_batch_size": 1,
                "dtype": "bf16", "gated_mlp": False, "mamba_d_state": 128, "mamba_expand": 2,
                "pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"},
      "hardware": "H200-141GB",
      "training": {"devices": 16, "microbatches": 64, "placement": "loop", "chunks": 2, "offload": True,
                   "recompute": True},
      "partition": "balanced"}, "21892ed65d30a0139a2f57c2fb0f5b0d9b11e74214d0bfc501995c1dd6f847d6"),
]


@pytest.mark.parametrize("doc, key", LEGACY, ids=["llama7b", "llama70b-a100", "moe-mtp", "mamba"])
def test_specs_without_the_new_fields_keep_their_keys(doc, key):
    problem = problem_from_document(copy.deepcopy(doc))
    assert problem.key() == key
    assert problem.workload is None and all(s.reduce_ms is None for s in problem.stages)
    assert "reduce_ms" not in problem.canonical_json() and "workload" not in problem.canonical_json()


def test_a_parallel_block_of_ones_costs_what_the_original_estimate_does():
    """tp = cp = 1: the per-GPU division and the new memory accounting change nothing per layer's time."""
    old = Spec.model_validate({k: v for k, v in LEGACY[0][0].items()})
    new = Spec.model_validate({**LEGACY[0][0], "parallel": {"tp": 1}})
    for a, b in zip(layer_costs(old), layer_costs(new)):
        assert b.forward_ms == pytest.approx(a.forward_ms) and b.backward_weight_ms == pytest.approx(a.backward_weight_ms)


# --------------------------------------------------------------------------------------------------
# Formulas per GPU
# --------------------------------------------------------------------------------------------------
def test_korthikanti_activations_with_and_without_sequence_parallelism():
    """Korthikanti et al. 2022, Table 2: sbh(34 + 5as/h)/t with SP, sbh(10 + 24/t + 5as/(ht)) without."""
    s, b, h, a, t = GPT["seq_len"], GPT["micro_batch_size"], GPT["hidden"], GPT["heads"], 4
    assert dense(gpt_spec({"tp": 1})).activation_bytes == s * b * h * (34 + 5 * a * s / h)
    with_sp = dense(gpt_spec({"tp": t}))
    assert with_sp.activation_bytes == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    without = dense(gpt_spec({"tp": t, "sp": False}))
    assert without.activation_bytes == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    cp = dense(gpt_spec({"tp": t, "cp": 2}))
    assert cp.activation_bytes == pytest.approx(with_sp.activation_bytes / 2)


def test_narayanan_flops_per_gpu_and_causal_half():
    """24bsh^2 + 4bs^2h per layer (Narayanan et al. 2021) split over tp; the calibrated estimate
    times the scores a causal kernel computes ((s+1)/2 of s keys per query) and MFU counts them."""
    s, b, h, t = GPT["seq_len"], GPT["micro_batch_size"], GPT["hidden"], 2
    linear, core = 24 * b * s * h * h, 4 * b * s * s * h
    spec = gpt_spec({"tp": t, "tp_overlap": 1.0}, precision="bf16")
    layer = dense(spec)
    assert layer.flops == linear + core
    assert layer.model_flops == pytest.approx(linear + core * (s + 1) / (2 * s))
    rate = HARDWARE["H100-80GB"].peak_tflops * 1e9 * HARDWARE["H100-80GB"].bf16_efficiency  # FLOP per ms
    compute = (linear + core * (s + 1) / (2 * s)) / t / rate
    assert layer.forward_ms == pytest.approx(compute, rel=1e-9)  # TP collectives hidden (overlap 1)
    full = dense(gpt_spec({"tp": t, "tp_overlap": 1.0}, precision="bf16", model={**GPT, "causal": False}))
    assert full.forward_ms == pytest.approx((linear + core) / t / rate, rel=1e-9)


def test_tp_collectives_show_beyond_the_compute_they_overlap():
    """A dense layer's 4 ring all-gathers / reduce-scatters of b·s·h 16-bit values per pass on NVLink,
    (t-1)/t x bytes / (450 GB/s x bus efficiency) + (t-1) x 3 us each: all of it shows without
    overlap; with tp_overlap 1 only what exceeds the pass's compute (this small layer: some)."""
    s, b, h, t = GPT["seq_len"], GPT["micro_batch_size"], GPT["hidden"], 4
    linear, core = 24 * b * s * h * h, 4 * b * s * s * h * (s + 1) / (2 * s)
    rate = HARDWARE["H100-80GB"].peak_tflops * 1e9 * HARDWARE["H100-80GB"].bf16_efficiency
    compute = (linear + core) / t / rate
    dgx = CLUSTERS["DGX-H100"]
    comm = 4 * ((t - 1) / t * b * s * h * 2 / (dgx.nvlink_gbps * dgx.bus_efficiency * 1e6) + (t - 1) * 3e-3)
    shown = dense(gpt_spec({"tp": t}, precision="bf16"))
    assert shown.forward_ms == pytest.approx(compute + comm, rel=1e-9)
    overlapped = dense(gpt_spec({"tp": t, "tp_overlap": 1.0}, precision="bf16"))
    assert overlapped.forward_ms == pytest.approx(max(compute, comm), rel=1e-9)
    assert shown.backward_weight_ms == pytest.approx(overlapped.backward_weight_ms)  # W has no collective


def test_static_memory_per_gpu_with_the_distributed_optimizer():
    """Megatron's distributed optimizer: 16-bit weight + gradient buffer per parameter on every data
    parallel rank, fp32 master weights and Adam moments (12 B) sharded over dp x cp."""
    h, t, dp = GPT["hidden"], 2, 4
    layer_params = 12 * h * h + 2 * h  # 4h^2 attention + 8h^2 MLP + two norms
    spec = gpt_spec({"tp": t, "dp": dp, "grad_dtype": "bf16"})
    assert dense(spec).params == layer_params
    assert dense(spec).static_bytes == pytest.approx(layer_params / t * (2 + 2 + 12 / dp))
    replicated = gpt_spec({"tp": t, "dp": dp, "optimizer": "replicated"})
    assert dense(replicated).static_bytes == pytest.approx(layer_params / t * 18)


def test_experts_spread_over_ep_and_their_optimizer_over_edp():
    doc = {"model": {"layers": 2, "hidden": 1024, "heads": 8, "vocab": 1000, "seq_len": 512, "experts": 16,
                     "top_k": 2, "moe_ffn": 512},
           "hardware": "H100-80GB", "training": {"devices": 1, "microbatches": 2},
           "parallel": {"tp": 2, "ep": 8, "etp": 1, "dp": 8, "grad_dtype": "bf16"}}
    moe = next(c for c in layer_costs(Spec.model_validate(doc)) if c.type == "moe")
    experts = 16 * 3 * 1024 * 512
    assert moe.expert_params == experts
    edp = 2 * 8 // 8
    dense_per_gpu = (moe.params - experts) / 2
    assert moe.static_bytes == pytest.approx(dense_per_gpu * (4 + 12 / 8) + experts / 8 * (4 + 12 / edp))


def test_deepseek_v3_parameter_count():
    """MLA + 256 routed experts + a shared one, 3 dense layers, one MTP module: 671 B (DeepSeek-V3
    report, Table 1) plus the 14 B MTP module."""
    doc = {"model": {"name": "DeepSeek-V3", "layers": 61, "hidden": 7168, "ffn": 18432, "heads": 128,
                     "vocab": 129280, "experts": 256, "top_k": 8, "moe_ffn": 2048, "shared_experts": 1,
                     "first_dense_layers": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                     "qk_rope_head_dim": 64, "v_head_dim": 128, "mtp_heads": 1, "seq_len": 4096},
           "hardware": "H100-80GB", "training": {"devices": 8, "microbatches": 8}}
    costs = layer_costs(Spec.model_validate(doc))
    total = sum(c.params for c in costs)
    assert total == pytest.approx(685e9, rel=0.01)
    assert sum(c.params for c in costs if c.type != "mtp_head") == pytest.approx(671e9, rel=0.01)


# --------------------------------------------------------------------------------------------------
# Links and collectives
# --------------------------------------------------------------------------------------------------
def test_pipeline_hops_cross_nodes_when_a_stage_fills_one():
    spec = gpt_spec({"tp": 4, "dp": 2}, cluster="DGX-H100")
    layout = Layout.of(spec)
    assert layout.p2p_crosses_nodes  # tp x dp = 8 GPUs per stage: every hop leaves the node
    small = Layout.of(gpt_spec({"tp": 2, "dp": 1}, cluster="DGX-H100"))
    assert not small.p2p_crosses_nodes  # 2 stages x 2 GPUs inside one node
    dgx = CLUSTERS["DGX-H100"]
    assert layout.p2p_ms(1e6) == pytest.approx(1e6 / (dgx.ib_gbps * dgx.bus_efficiency * 1e6) + 8e-3)
    assert small.p2p_ms(1e6) == pytest.approx(1e6 / (dgx.nvlink_gbps * dgx.bus_efficiency * 1e6) + 3e-3)


def test_all_to_all_splits_its_bytes_between_nvlink_and_infiniband():
    doc = {"model": {"layers": 2, "hidden": 1024, "heads": 8, "vocab": 1000, "seq_len": 512, "experts": 64,
                     "top_k": 2}, "hardware": "H100-80GB", "training": {"devices": 1, "microbatches": 2},
           "parallel": {"ep": 32, "etp": 1, "dp": 32}}
    layout = Layout.of(Spec.model_validate(doc))
    dgx = CLUSTERS["DGX-H100"]
    nbytes = 32e6
    inter = 24 / 32 * nbytes / (dgx.ib_gbps * dgx.bus_efficiency * 1e6)  # 24 of 32 peers on other nodes
    assert layout.all_to_all_ms(nbytes) == pytest.approx(inter + 8e-3)


# --------------------------------------------------------------------------------------------------
# The iteration on the problem
# --------------------------------------------------------------------------------------------------
def test_a_job_spec_carries_the_iteration_and_its_workload():
    doc = {"model": {**GPT, "seq_len": 2048}, "hardware": "H100-80GB", "precision": "bf16",
           "training": {"devices": 2, "microbatches": 8}, "parallel": {"tp": 2, "gpus": 16}}
    problem = problem_from_document(doc)
    assert problem.workload.gpus == 16 and problem.workload.tokens == 8 * 2 * 2048 * 4  # M x b x s x dp
    assert all(s.reduce_ms > 0 for s in problem.stages) and all(d.optimizer_ms > 0 for d in problem.devices)
    assert problem.metadata["job"]["dp"] == 4
    again = Problem.model_validate_json(problem.model_dump_json())
    assert again.key() == problem.key()
    unoverlapped = problem_from_document({**doc, "parallel": {**doc["parallel"], "overlap_grad_reduce": False}})
    assert all(s.reduce_ms is None for s in unoverlapped.stages)
    assert unoverlapped.devices[0].optimizer_ms == pytest.approx(
        problem.devices[0].optimizer_ms + sum(problem.reduce_of(k) for k in problem.stages_of(0)), abs=1e-3)


# --------------------------------------------------------------------------------------------------
# Errors name the field
# --------------------------------------------------------------------------------------------------
BASE = {"model": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "vocab": 1000, "seq_len": 4096},
        "hardware": "H100-80GB", "training": {"devices": 2, "microbatches": 4}}
MOE = {**BASE["model"], "experts": 8, "top_k": 2}


@pytest.mark.parametrize("extra, field", [
    ({"parallel": {"tp": 3}}, "parallel.tp: 3 does not divide model.heads"),
    ({"parallel": {"tp": 8}}, "parallel.tp: 8 does not divide model.kv_heads"),
    ({"parallel": {"tp": 16}, "model": {**BASE["model"], "heads": 32, "kv_heads": 16}},
     "parallel.tp: 16 exceeds cluster.gpus_per_node"),
    ({"parallel": {"ep": 3}, "model": MOE}, "parallel.ep: 3 does not divide model.experts"),
    ({"parallel": {"ep": 4}, "model": MOE}, "parallel.ep: ep x etp = 4 x 1 does not divide"),
    ({"parallel": {"ep": 2}}, "parallel.ep: expert parallelism needs a MoE model"),
    ({"parallel": {"tp": 2, "gpus": 10}}, "parallel.gpus: 10 is not a multiple of tp x cp x pp"),
    ({"parallel": {"tp": 2, "dp": 2, "gpus": 16}}, "parallel.gpus: 16 but tp x cp x pp x dp"),
    ({"parallel": {"cp": 3}}, "parallel.cp: 2 x 3 does not divide model.seq_len"),
    ({"parallel": {"tp": 2}, "training": {"devices": 2, "microbatches": 4, "dp_shards": 4}},
     "training.dp_shards"),
    ({"precision": "fp8", "hardware": "A100-80GB"}, "precision: fp8 needs hardware.fp8_tflops"),
    ({"precision": "fp8", "model": {**BASE["model"], "dtype": "fp32"}}, "precision: fp8 needs model.dtype"),
    ({"cluster": "DGX-B300"}, "cluster"),
    ({"model": {**BASE["model"], "v_head_dim": 128}}, "kv_lora_rank"),
    ({"model": {**BASE["model"], "full_attention_every": 2}}, "full_attention_every"),
    ({"parallel": {"tp": 2}, "hardware": {"peak_tflops": 100, "hbm_gib": 10, "host_link_gbps": 10,
                                          "link_gbps": 10}}, "cluster: needed"),
])
def test_bad_parallel_specs_name_the_field(extra, field):
    doc = {**copy.deepcopy(BASE), **extra}
    with pytest.raises((ValidationError, ValueError)) as info:
        problem_from_document(doc)
    assert field in "; ".join(error_messages(info.value))


# --------------------------------------------------------------------------------------------------
# MoE layers: the routed path's memory traffic and the host
# --------------------------------------------------------------------------------------------------
SMALL_MOE = {"layers": 2, "hidden": 1024, "heads": 8, "vocab": 1000, "seq_len": 2048, "experts": 16,
             "top_k": 4, "moe_ffn": 512}


def moe_layer(precision: str, host_ms: float = 0.0, ep_overlap: float = 1.0):
    doc = {"model": SMALL_MOE, "precision": precision,
           "hardware": {"preset": "H100-80GB", "moe_host_ms": host_ms},
           "training": {"devices": 1, "microbatches": 2}, "parallel": {"tp": 1, "ep_overlap": ep_overlap}}
    return next(c for c in layer_costs(Spec.model_validate(doc)) if c.type == "moe")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_routed_copies_move_their_permutation_activation_and_casts_through_hbm(precision):
    """A MoE layer on one GPU by hand: matmuls at their rates, the causal scores, and per routed copy of
    a token the element-wise traffic -- permutation and unpermutation read and write h values, the
    fused SwiGLU reads 2fe and writes fe (2 B each) -- plus, in FP8, scaling and casting both expert
    inputs (6 B per value). F moves it once, B twice, W not at all."""
    s, h, e, k, fe = (SMALL_MOE[x] for x in ("seq_len", "hidden", "experts", "top_k", "moe_ffn"))
    hw = HARDWARE["H100-80GB"]
    bf16, fp8 = hw.peak_tflops * 1e9 * hw.bf16_efficiency, hw.fp8_tflops * 1e9 * hw.fp8_efficiency
    fast = fp8 if precision == "fp8" else bf16
    router, linear = 2 * s * h * e, 8 * s * h * h + 6 * k * s * h * fe  # attention projections, experts
    matmul = router / bf16 + linear / fast
    core = 4 * s * s * h * (s + 1) / (2 * s) / bf16
    per_copy = 2 * (4 * h + 3 * fe) + (6 * (h + fe) if precision == "fp8" else 0)
    traffic = s * k * per_copy / (hw.hbm_gbps * 1e6)
    layer = moe_layer(precision)
    assert layer.forward_ms == pytest.approx(matmul + core + traffic, rel=1e-9)
    assert layer.backward_input_ms == pytest.approx(matmul + 2 * core + 2 * traffic, rel=1e-9)
    assert layer.backward_weight_ms == pytest.approx(matmul, rel=1e-9)


def test_without_expert_overlap_the_hosts_time_adds_to_each_moe_pass():
    """No all-to-all overlap: the dispatcher's synchronisation drains the device's queue, so the host's
    time adds to F and to B + W; half an overlap leaves half of it, and the floor still holds."""
    free = moe_layer("fp8", ep_overlap=0.0)
    layer = moe_layer("fp8", host_ms=5.0, ep_overlap=0.0)
    assert layer.forward_ms == pytest.approx(free.forward_ms + 5.0)
    assert layer.backward_input_ms == pytest.approx(free.backward_input_ms + 5.0)
    assert layer.backward_weight_ms == free.backward_weight_ms
    half, host = moe_layer("fp8", ep_overlap=0.5), free.forward_ms  # F + half the host's time > the floor
    layer = moe_layer("fp8", host_ms=host, ep_overlap=0.5)
    assert layer.forward_ms == pytest.approx(half.forward_ms + host / 2)
    layer = moe_layer("fp8", host_ms=5.0, ep_overlap=0.5)
    assert layer.forward_ms == pytest.approx(max(half.forward_ms + 2.5, 5.0))
    assert moe_layer("fp8", host_ms=0.0, ep_overlap=0.0).forward_ms == free.forward_ms


def test_a_moe_pass_lasts_at_least_the_hosts_time_to_issue_it():
    """With the all-to-all overlapped, hardware.moe_host_ms is a floor per MoE layer and pass: F, and
    B + W together (one backward in Megatron); a pass the device makes longer keeps its time; dense
    layers and the original estimate (no precision) never get one."""
    free = moe_layer("fp8")
    assert free.forward_ms < 1.0 and free.backward_input_ms + free.backward_weight_ms < 2.0
    bound = moe_layer("fp8", host_ms=5.0)
    assert bound.forward_ms == pytest.approx(5.0)
    assert bound.backward_input_ms + bound.backward_weight_ms == pytest.approx(5.0)
    assert bound.backward_weight_ms == free.backward_weight_ms
    light = moe_layer("fp8", host_ms=0.01)
    assert (light.forward_ms, light.backward_input_ms) == (free.forward_ms, free.backward_input_ms)
    dense_model = {k: v for k, v in SMALL_MOE.items() if k not in ("experts", "top_k", "moe_ffn")}
    doc = {"model": dense_model, "precision": "fp8", "hardware": {"preset": "H100-80GB", "moe_host_ms": 5.0},
           "training": {"devices": 1, "microbatches": 2}, "parallel": {"tp": 1}}
    assert next(c for c in layer_costs(Spec.model_validate(doc)) if c.type == "dense").forward_ms < 1.0
    original = {**doc, "model": SMALL_MOE}
    del original["precision"]
    assert next(c for c in layer_costs(Spec.model_validate(original)) if c.type == "moe").forward_ms < 1.0
