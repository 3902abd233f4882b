"""Cost model: the per-layer formulas that turn a spec (planner.spec) into a problem v1.

Why: clients know their model and their GPUs, not per-stage milliseconds. This module estimates, per
layer, the compute time of F (forward), B (input gradient) and W (weight gradient), the activation
memory each microbatch keeps, the part of it only W needs, the parameters, and from those the per-stage
numbers of a problem v1 for a given partition (planner.partition: contiguous layer ranges per stage)
and placement.
Profiled per-layer numbers, when a spec gives them, replace the estimates field by field.

Layers are indexed over the *whole* stack, embedding first and LM head (then MTP heads) last:
``metadata["layers"][i]`` is the type of layer i and ``metadata["partition"][k] = [first, end)`` are the
layers of stage k. A training script builds stage k from exactly those layers.

Formulas and their sources (b = micro-batch size, s = sequence length, h = hidden size, f = FFN size,
a = attention heads, h_kv = kv_heads x head_dim, V = vocabulary, E = experts, k = top-k, all per
microbatch; bytes for 16-bit activations unless noted):

* FLOPs of a transformer block, forward (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", §5.1: 24·b·s·h² + 4·b·s²·h for MHA and f = 4h),
  generalised term by term: Q and O projections 2·2·b·s·h², K and V projections 2·2·b·s·h·h_kv
  (grouped-query attention), scores and weighted sum 4·b·s²·h, MLP 2·b·s·h·f per matrix (3 matrices
  when gated/SwiGLU, 2 otherwise). With a = kv heads, f = 4h, not gated this is exactly Narayanan's.
* B and W (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Table 1): for a matmul Y = XW the input
  gradient dX = dY·Wᵀ and the weight gradient dW = Xᵀ·dY each cost what the forward did, so B ≈ F and
  W ≈ F on the linear part; the attention core (no weights) costs 2x its forward in B and nothing in W.
  F + B + W = 3·F, the classic 3x rule of Narayanan et al.
* Time = FLOPs / (peak FLOP/s x MFU) — MFU (model FLOPs utilisation) is an achieved fraction of the
  datasheet peak; 0.4-0.55 is typical for Megatron-LM on A100/H100 (Narayanan et al. 2021 report 52%
  on A100; Korthikanti et al. 2022 report 54-56%). Memory-bound pieces (embedding lookup and its
  scatter-add gradient) are timed from HBM bandwidth instead.
* Activation memory of a block (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", §4, Table 2 with t = 1): s·b·h·(34 + 5·a·s/h) bytes = attention 11·s·b·h +
  5·a·s²·b, MLP 19·s·b·h, two layer norms 4·s·b·h. Generalised term by term: attention keeps its input
  2h, Q 2h, K and V 2·h_kv each, the output-projection input 2h and a dropout mask h; MLP keeps its
  input 2h, then 2f per saved intermediate (2 when not gated: activation input and fc2 input; 4 when
  gated: gate, up, silu(gate), down input) and a dropout mask h. Flash attention (Dao et al. 2022)
  drops the 5·a·s²·b score term (it recomputes scores in the backward); without dropout the masks
  (1 byte each) vanish and the score term is 2·a·s²·b (the softmax output). With a = kv heads,
  f = 4h, not gated, with dropout, without flash attention: exactly Korthikanti's 34 + 5as/h.
* The part of the activation kept until W (Qi et al. 2023, Table 1: 32·s·b·h of the 34): the inputs of
  the linear layers and the gradients of their outputs. Generalised: inputs 2h+2h+2h+2f, output
  gradients 2(h+2h_kv)+2h+2f·(2 if gated else 1)+2h; capped at the activation (contract: a part of it).
* Parameters per block: attention 2h² + 2·h·h_kv, MLP (3 if gated else 2)·h·f, norms 2h. MoE: E
  experts of size moe_ffn, shared experts, a router h·E (Fedus et al. 2021 / DeepSeek-V3 layouts).
  FLOPs of MoE: router 2·b·s·h·E plus top-k routed and the shared expert MLPs per token.
* Mamba-2 layer (Dao & Gu 2024, "Transformers are SSMs"; d_inner = expand·h, N = d_state): in-proj
  h → 2·d_inner + 2·N + n_heads, out-proj d_inner → h, the chunked SSD scan ≈ 6·b·s·d_inner·N FLOPs
  (an estimate, linear in s), no attention term. Activations ≈ 2(2h + 4·d_inner + 2·N) + 2(d_inner + 2N)
  + 2·3·d_inner bytes per token (in/out projection inputs, conv output, scan output, gated norm).
* Embedding: V·h parameters, no FLOPs (a gather), time = bytes moved / HBM bandwidth. LM head: 2·b·s·h·V
  FLOPs forward (Narayanan's vocabulary term 6·b·s·h·V over F+B+W), activation 2·b·s·h input plus
  4·b·s·V for the fp32 logits the cross-entropy backward needs. Tied embeddings keep one copy on the
  first and one on the last stage (Megatron-LM does so under pipeline parallelism), so both count.
* MTP head (DeepSeek-V3, 2024, §2.2): one block + a 2h→h projection + the shared output head.
* Static memory (Rajbhandari et al. 2020, "ZeRO", §3.1): mixed-precision Adam keeps 2 (fp16/bf16
  weights) + 2 (gradients) + 12 (fp32 master weights, momentum, variance) = 16 bytes per parameter;
  ZeRO-1 / Megatron's distributed optimizer divides the 12 by the data-parallel degree
  (`dp_shards`). `bytes_per_param` overrides the 16 (Megatron with fp32 gradient accumulation: 18).
* Offload/reload time = offloaded bytes / host-link bandwidth (PCIe); the link time between stages =
  latency + boundary activation bytes (2·b·s·h) / inter-stage bandwidth. Recompute re-runs the
  forward (recompute_ms = forward_ms) keeping only the stage input (checkpoint = 2·b·s·h bytes).
"""

from __future__ import annotations

import itertools

from pydantic import BaseModel

from .contract import PROBLEM_FORMAT, Device, Options, Problem, Stage
from .partition import balanced_partition, counts_to_ranges, stage_device, uniform_partition
from .spec import DTYPE_BYTES, MIB, Hardware, ModelSpec, Spec, Training

COSTMODEL_VERSION = "pipeplan.costmodel/1"


# --------------------------------------------------------------------------------------------------
# Per-layer costs
# --------------------------------------------------------------------------------------------------
class LayerCost(BaseModel):
    """Per-microbatch cost of one layer (times in ms, memory in bytes)."""

    type: str
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    activation_bytes: float
    weight_grad_bytes: float
    params: float
    static_bytes: float  # weights, gradients and optimizer state kept on the device
    flops: float  # forward FLOPs (for the model summary)

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_input_ms + self.backward_weight_ms


class _Parts(BaseModel):
    """Raw estimate of one layer: linear and attention-core FLOPs, activation and W-held bytes."""

    linear_flops: float = 0.0
    core_flops: float = 0.0
    act: float = 0.0
    wgrad: float = 0.0
    params: float = 0.0
    hbm_bytes: float = 0.0  # memory-bound work per pass (embedding)


def _attention(m: ModelSpec, t: Training) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    q, kv, a = m.q_dim, m.kv_dim, m.heads
    linear = 2 * b * s * h * (2 * q + 2 * kv)  # Q, O (h x q) and K, V (h x kv) projections
    core = 4 * b * s * s * q  # QK^T and (softmax)V
    mask = 1 if m.dropout else 0
    # per token: LN input 2h, QKV input 2h, Q 2q, K 2kv, V 2kv, O-proj input 2q, dropout mask h
    act = 2 * h + 2 * h + 2 * q + 4 * kv + 2 * q + mask * h
    if not t.flash_attention:
        act += (5 if m.dropout else 2) * a * s  # softmax out (+ dropout mask and output) per score
    # W needs the inputs of QKV and O projections and the gradients of their outputs
    wgrad = 2 * h + 2 * q + 2 * (q + 2 * kv) + 2 * h
    params = 2 * h * q + 2 * h * kv + h  # + norm
    return _Parts(linear_flops=linear, core_flops=core, act=b * s * act, wgrad=b * s * wgrad, params=params)


def _mlp(m: ModelSpec, f: int, tokens_per_token: float = 1.0, mask: bool = True) -> _Parts:
    """One MLP of inner size f applied to `tokens_per_token` x the tokens (MoE top-k routing)."""
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    mats = 3 if m.gated_mlp else 2
    linear = tokens_per_token * 2 * b * s * h * f * mats
    saved = 4 if m.gated_mlp else 2
    # per routed token: input 2h, saved intermediates 2f each; per token: LN input 2h, dropout mask h
    act = tokens_per_token * (2 * h + saved * 2 * f) + (m.dropout and mask) * h
    wgrad = tokens_per_token * (2 * h + 2 * f + 2 * f * (2 if m.gated_mlp else 1) + 2 * h)
    params = mats * h * f
    return _Parts(linear_flops=linear, act=b * s * act, wgrad=b * s * wgrad, params=params)


def _add(*parts: _Parts) -> _Parts:
    return _Parts(**{k: sum(getattr(p, k) for p in parts) for k in _Parts.model_fields})


def _norm_act(m: ModelSpec) -> float:
    return m.micro_batch_size * m.seq_len * 2 * m.hidden  # second layer norm input (2h per token)


def _dense(m: ModelSpec, t: Training) -> _Parts:
    return _add(_attention(m, t), _mlp(m, m.f), _Parts(act=_norm_act(m), params=m.hidden))


def _moe_mlp(m: ModelSpec) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    e, k, fe = m.experts, m.top_k, m.moe_ffn or m.f
    routed = _mlp(m, fe, tokens_per_token=k)
    shared = _mlp(m, fe, tokens_per_token=m.shared_experts, mask=False) if m.shared_experts else _Parts()
    router = _Parts(linear_flops=2 * b * s * h * e, act=b * s * (4 * e + 2 * k * h), params=h * e)
    out = _add(routed, shared, router)
    out.params = e * routed.params + m.shared_experts * routed.params + h * e
    return out


def _moe(m: ModelSpec, t: Training) -> _Parts:
    return _add(_attention(m, t), _moe_mlp(m), _Parts(act=_norm_act(m), params=m.hidden))


def _mamba(m: ModelSpec) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    di, n = m.mamba_expand * h, m.mamba_d_state
    nh = max(1, di // m.mamba_head_dim)
    proj_out = 2 * di + 2 * n + nh
    linear = 2 * b * s * h * proj_out + 2 * b * s * di * h
    core = 6 * b * s * di * n  # chunked SSD scan (estimate)
    act = 2 * (2 * h + 4 * di + 2 * n) + 2 * (di + 2 * n) + 2 * 3 * di
    wgrad = 2 * h + 2 * proj_out + 2 * di + 2 * h
    params = h * proj_out + di * h + 4 * (di + 2 * n) + 3 * nh + di + h  # + conv, A, D, dt, norms
    return _Parts(linear_flops=linear, core_flops=core, act=b * s * act, wgrad=b * s * wgrad, params=params)


def _lm_head(m: ModelSpec) -> _Parts:
    b, s, h, v = m.micro_batch_size, m.seq_len, m.hidden, m.vocab
    # input 2h, final norm input 2h, fp32 logits 4V per token for the cross-entropy backward
    return _Parts(linear_flops=2 * b * s * h * v, act=b * s * (4 * h + 4 * v), wgrad=b * s * (2 * h + 2 * v),
                  params=h * v + h)


def _embedding(m: ModelSpec) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    bytes_ = DTYPE_BYTES[m.dtype]
    # gather: read and write b*s*h values; the weight gradient scatter-adds as many
    return _Parts(act=b * s * 8, hbm_bytes=2 * b * s * h * bytes_, params=m.vocab * h)


def _parts(m: ModelSpec, t: Training, kind: str) -> _Parts:
    match kind:
        case "dense":
            return _dense(m, t)
        case "moe":
            return _moe(m, t)
        case "mamba":
            return _mamba(m)
        case "attention":
            return _attention(m, t)
        case "mlp":
            return _add(_mlp(m, m.f), _Parts(act=_norm_act(m)))
        case "embedding":
            return _embedding(m)
        case "lm_head":
            return _lm_head(m)
        case "mtp_head":
            b, s, h = m.micro_batch_size, m.seq_len, m.hidden
            block = _moe(m, t) if m.experts else _dense(m, t)
            proj = _Parts(linear_flops=2 * b * s * 2 * h * h, act=b * s * 2 * 2 * h,
                          wgrad=b * s * (2 * 2 * h + 2 * h), params=2 * h * h + 2 * h)
            head = _lm_head(m)
            head.params = 0.0  # the output head is shared with the main LM head (DeepSeek-V3)
            return _add(block, proj, head)
    raise ValueError(f"stack: unknown layer type {kind!r}")


def _scale_bytes(m: ModelSpec, p: _Parts) -> _Parts:
    """Formulas count 16-bit activations; fp32 models keep twice the bytes."""
    if DTYPE_BYTES[m.dtype] == 2:
        return p
    k = DTYPE_BYTES[m.dtype] / 2
    return p.model_copy(update={"act": p.act * k, "wgrad": p.wgrad * k})


def layer_costs(model: ModelSpec, hardware: Hardware, training: Training) -> list[LayerCost]:
    """Per-layer, per-microbatch F/B/W time, activation and W-held bytes, parameters and the static
    bytes they keep."""
    flops_per_ms = hardware.peak_tflops * 1e12 * hardware.mfu / 1e3
    if model.dtype == "fp32":
        flops_per_ms /= 2  # without 16-bit tensor cores (TF32 is half the BF16 rate on A100/H100)
    bytes_per_ms = hardware.hbm_gbps * 1e9 / 1e3
    out = []
    for g in model.layer_groups():
        p = _scale_bytes(model, _parts(model, training, g.type))
        fwd = (p.linear_flops + p.core_flops) / flops_per_ms + p.hbm_bytes / bytes_per_ms
        bi = (p.linear_flops + 2 * p.core_flops) / flops_per_ms + p.hbm_bytes / bytes_per_ms
        bw = p.linear_flops / flops_per_ms + p.hbm_bytes / bytes_per_ms
        act = g.activation_mib * MIB if g.activation_mib is not None else p.act
        wg = g.weight_grad_mib * MIB if g.weight_grad_mib is not None else p.wgrad
        out.append(LayerCost(
            type=g.type,
            forward_ms=g.forward_ms if g.forward_ms is not None else fwd,
            backward_input_ms=g.backward_input_ms if g.backward_input_ms is not None else bi,
            backward_weight_ms=g.backward_weight_ms if g.backward_weight_ms is not None else bw,
            activation_bytes=act,
            weight_grad_bytes=min(wg, act),
            params=g.params if g.params is not None else p.params,
            static_bytes=0.0,
            flops=p.linear_flops + p.core_flops,
        ))
    if model.tie_embeddings:
        head = next(c for c in out if c.type == "lm_head")
        head.params = out[0].params  # same shape; a second copy lives on the last stage
    bpp = static_bytes_per_param(training)
    for c in out:
        c.static_bytes = c.params * bpp
    return out


def static_bytes_per_param(training: Training) -> float:
    """ZeRO §3.1: 2 + 2 + 12 bytes per parameter; the 12 of optimizer state sharded over dp_shards."""
    if training.bytes_per_param is not None:
        return training.bytes_per_param
    return 2 + 2 + 12 / training.dp_shards


def boundary_bytes(model: ModelSpec) -> float:
    """The hidden state passed between stages (and kept as a recompute checkpoint): 2·b·s·h bytes."""
    return model.micro_batch_size * model.seq_len * model.hidden * DTYPE_BYTES[model.dtype]



# --------------------------------------------------------------------------------------------------
# Problem assembly
# --------------------------------------------------------------------------------------------------
def _r(x: float) -> float:
    """Round to 4 decimals so keys and documents stay readable and stable."""
    return round(float(x), 4)


def _r_pos(x: float) -> float:
    """As _r, but never 0: the contract needs F and B > 0 (a stage of only an embedding is tiny)."""
    return max(_r(x), 1e-4)


def build_problem(spec: Spec, partition: list[list[int]], placement: str | None = None,
                  chunks: int | None = None, costs: list[LayerCost] | None = None) -> Problem:
    """The problem v1 of `spec` cut at `partition` ([first, end) layer ranges, one per stage) and
    placed loop or V with `chunks` stages per device (defaults: the spec's training settings)."""
    m, hw, t = spec.model, spec.hardware, spec.training
    placement = placement or t.placement
    chunks = chunks or (t.num_chunks if placement == t.placement else (2 if placement == "v" else 1))
    costs = costs if costs is not None else layer_costs(m, hw, t)
    num_stages = t.devices * chunks
    if len(partition) != num_stages:
        raise ValueError(f"partition: {len(partition)} ranges for {num_stages} stages")
    if partition[0][0] != 0 or partition[-1][1] != len(costs) or any(
            a[1] != b[0] for a, b in itertools.pairwise(partition)) or any(r[1] <= r[0] for r in partition):
        raise ValueError(f"partition: ranges must be non-empty, contiguous and cover 0..{len(costs)}")
    boundary = boundary_bytes(m)
    host_bytes_per_ms = hw.host_link_gbps * 1e9 / 1e3
    stages, params_on = [], [0.0] * t.devices
    for k, (lo, hi) in enumerate(partition):
        layer = costs[lo:hi]
        act = sum(c.activation_bytes for c in layer)
        wg = sum(c.weight_grad_bytes for c in layer)
        fwd = sum(c.forward_ms for c in layer)
        ckpt = min(boundary if lo > 0 else m.micro_batch_size * m.seq_len * 8, act)
        offload = act / host_bytes_per_ms
        device = stage_device(k, t.devices, placement)
        params_on[device] += sum(c.params for c in layer)
        stages.append(Stage(
            device=device, forward_ms=_r_pos(fwd),
            backward_input_ms=_r_pos(sum(c.backward_input_ms for c in layer)),
            backward_weight_ms=_r(sum(c.backward_weight_ms for c in layer)),
            recompute_ms=_r_pos(fwd), offload_ms=_r(max(offload, 1e-4)),
            activation_mib=_r(act / MIB), weight_grad_mib=_r(min(wg, act) / MIB),
            offloadable_mib=_r(act / MIB), checkpoint_mib=_r(min(ckpt, act) / MIB),
        ))
    bpp = static_bytes_per_param(t)
    budgets = t.memory_budget_gib if isinstance(t.memory_budget_gib, list) else [t.memory_budget_gib] * t.devices
    devices = [Device(memory_limit_mib=_r(((b if b is not None else hw.hbm_gib) - t.reserved_gib) * 1024),
                      static_mib=_r(params_on[d] * bpp / MIB)) for d, b in enumerate(budgets)]
    p2p = hw.link_latency_us / 1e3 + boundary / (hw.link_gbps * 1e9 / 1e3)
    total_params = sum(c.params for c in costs)
    metadata = {
        "costmodel": COSTMODEL_VERSION,
        "partition": partition,
        "layers": [c.type for c in costs],
        "placement": placement,
        "chunks": chunks,
        "model": {
            "name": m.name, "params": total_params, "layers": len(costs),
            "flops_per_microbatch": sum(c.flops for c in costs), "seq_len": m.seq_len,
            "micro_batch_size": m.micro_batch_size, "hidden": m.hidden, "vocab": m.vocab,
        },
        "hardware": hw.name,
    }
    return Problem(
        format=PROBLEM_FORMAT, num_devices=t.devices, num_microbatches=t.microbatches, p2p_ms=_r(p2p),
        options=Options(split_backward=t.split_backward, offload=t.offload, recompute=t.recompute),
        stages=stages, devices=devices, metadata=metadata,
    )


def partition_for(spec: Spec, strategy: str | list[int], chunks: int | None = None,
                  costs: list[LayerCost] | None = None) -> list[list[int]]:
    """Layer ranges for 'uniform' / 'balanced' (by F+B+W time, embedding and heads counted) or an
    explicit list of layers per stage."""
    costs = costs if costs is not None else layer_costs(spec.model, spec.hardware, spec.training)
    stages = spec.training.devices * (chunks or spec.training.num_chunks)
    if isinstance(strategy, list):
        return counts_to_ranges(strategy)
    if strategy == "uniform":
        return uniform_partition([c.type for c in costs], stages)
    return balanced_partition([c.total_ms for c in costs], stages)


__all__ = [
    "COSTMODEL_VERSION",
    "LayerCost",
    "boundary_bytes",
    "build_problem",
    "layer_costs",
    "partition_for",
    "static_bytes_per_param",
]
