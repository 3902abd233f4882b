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

A spec that describes the whole job (`parallel`, `precision`, `cluster`; docs/costmodel.md) is costed
per GPU, following Megatron-LM's decomposition: FLOPs and weights over tp (experts over ep x etp),
activations per Korthikanti et al. 2022 Table 2 with or without sequence parallelism, sequence terms
over cp, static memory with the optimizer sharded over dp x cp (experts over edp); TP collectives,
the CP ring and expert all-to-alls add what their overlap leaves on the compute stream
(planner/layout.py times them); each stage gets its gradient reduction, each device its optimizer
step, the problem its workload. With `precision` the time is the calibrated estimate: matmuls at
fitted fractions of the FP8 / 16-bit peaks, attention on the scores a causal kernel computes, a MoE
layer's routed copies (permutation, expert activation, FP8 casts) at the HBM rate, and each MoE layer
pass no shorter than the host's time to issue it (`hardware.moe_host_ms`, fitted).
Without those fields every number is the original estimate above, so old specs keep their keys.
"""

from __future__ import annotations

import itertools

from pydantic import BaseModel

from .contract import PROBLEM_FORMAT, Device, Options, Problem, Stage, Workload
from .layout import Layout
from .partition import balanced_partition, counts_to_ranges, stage_device, uniform_partition
from .spec import DTYPE_BYTES, MIB, ModelSpec, Spec, Training

COSTMODEL_VERSION = "pipeplan.costmodel/1"

# Memory traffic of the kernels that are not matmuls (calibrated estimate): bytes per 16-bit value an
# element-wise kernel reads or writes, and bytes per value of an FP8 matmul input under current
# scaling -- an amax pass (read 2 B), a cast (read 2 B) writing row- and column-wise FP8 copies (2 x 1 B).
STREAM = 2
CAST = 6


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
    output_grad_bytes: float = 0.0  # torch's split backward: what B keeps for W beside the activation
    static_bytes: float  # weights, gradients and optimizer state kept on the device
    flops: float  # forward FLOPs (for the model summary)
    model_flops: float = 0.0  # forward FLOPs, causal attention counted as computed (for MFU)
    expert_params: float = 0.0  # of `params`, routed experts
    transient_bytes: float = 0.0  # full recompute: the block's activation, held during its backward
    comm_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # TP, EP, CP time shown in F + B (parallel estimate)
    grad_bytes: tuple[float, float] = (0.0, 0.0)  # per GPU, dense and expert gradients to reduce
    optimizer_params: float = 0.0  # per GPU, parameters whose optimizer state this GPU updates

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_input_ms + self.backward_weight_ms


class _Parts(BaseModel):
    """Raw estimate of one layer for one microbatch of one pipeline replica: FLOPs, activation and
    W-held bytes, parameters; the subsets and counts the parallel estimate needs beside them."""

    linear_flops: float = 0.0  # every matmul with weights (experts and heads included)
    core_flops: float = 0.0  # attention scores and weighted sum, every score counted (or SSD scan)
    act: float = 0.0
    wgrad: float = 0.0
    # torch's split backward: the output gradients of the weight-consuming ops (norm scales included),
    # which B allocates beside the activation and W needs (Zero Bubble's `wgrad` counts them within it)
    ograd: float = 0.0
    params: float = 0.0
    hbm_bytes: float = 0.0  # memory-bound work per pass (embedding)
    # subsets, for the parallel / calibrated estimate
    expert_params: float = 0.0  # routed experts: spread over ep x etp, reduced over edp
    expert_flops: float = 0.0  # of linear_flops, the routed experts' (top_k per token)
    unfused_act: float = 0.0  # of act, what Megatron's fused kernels do not keep (SwiGLU, MoE permutation)
    bf16_flops: float = 0.0  # matmuls that stay 16-bit in an FP8 run (LM head, router)
    fp8_act: float = 0.0  # 16-bit bytes of saved linear-layer inputs, which FP8 runs keep in 8 bits
    rep_act: float = 0.0  # bytes every TP rank keeps whole without sequence parallelism
    tp_collectives: float = 0.0  # TP all-gathers + reduce-scatters of the hidden state per pass
    all_to_alls: float = 0.0  # expert all-to-alls per pass (dispatch, combine)
    ring_width: float = 0.0  # K and V values per token an attention layer passes around the CP ring
    stream_bytes: float = 0.0  # routed experts' element-wise (memory-bound) traffic in F; B moves twice it
    cast_bytes: float = 0.0  # FP8 runs: scaling and casting the routed experts' inputs, in F; B twice
    moe_layers: float = 0.0  # MoE layers (each pass no shorter than the host's time to issue it)


def _attention(m: ModelSpec, t: Training) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    if m.mla:
        return _mla(m, t)
    q, kv, a = m.q_dim, m.kv_dim, m.heads
    linear = 2 * b * s * h * (2 * q + 2 * kv)  # Q, O (h x q) and K, V (h x kv) projections
    core = 4 * b * s * s * q  # QK^T and (softmax)V
    mask = 1 if m.dropout else 0
    # per token: LN input 2h, QKV input 2h, Q 2q, K 2kv, V 2kv, O-proj input 2q, dropout mask h
    act = 2 * h + 2 * h + 2 * q + 4 * kv + 2 * q + mask * h
    if not t.flash_attention:
        act += (5 if m.dropout else 2) * a * s  # softmax out (+ dropout mask and output) per score
    # W needs the inputs of QKV and O projections and the gradients of their outputs (and torch
    # keeps the norm's scale's beside them)
    outputs = 2 * (q + 2 * kv) + 2 * h
    wgrad, ograd = 2 * h + 2 * q + outputs, outputs + 2 * h
    params = 2 * h * q + 2 * h * kv + h  # + norm
    return _Parts(linear_flops=linear, core_flops=core, act=b * s * act, wgrad=b * s * wgrad, params=params,
                  ograd=b * s * ograd, fp8_act=b * s * (2 * h + 2 * q),
                  rep_act=b * s * (2 * h + 2 * h + mask * h), tp_collectives=2, ring_width=2 * kv)


def _mla(m: ModelSpec, t: Training) -> _Parts:
    """Multi-head latent attention (DeepSeek-V2 §2.1): queries through a rank-r_q bottleneck (or a
    plain projection), keys and values from one rank-r_kv latent plus a shared RoPE key."""
    b, s, h, a = m.micro_batch_size, m.seq_len, m.hidden, m.heads
    rq, rkv, rope = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    qk, vd = m.qk_head_dim, m.v_head_dim or m.hd
    nope = qk - rope
    q_proj = h * rq + rq * a * qk if rq else h * a * qk
    weights = q_proj + h * (rkv + rope) + rkv * a * (nope + vd) + a * vd * h
    core = 2 * b * s * s * a * (qk + vd)  # QK^T over qk dims, (softmax)V over v dims
    mask = 1 if m.dropout else 0
    # per token: LN input, down-projection input, latents (+ their norms' inputs), Q, K, V, O input
    act = 2 * h + 2 * h + 4 * ((rq or 0) + rkv + rope) + 2 * a * qk * 2 + 2 * a * vd + 2 * a * vd + mask * h
    if not t.flash_attention:
        act += (5 if m.dropout else 2) * a * s
    # outputs: the Q and KV latents and RoPE key, Q, K and V, O; torch also keeps the input norm's and
    # the latents' norms' scales'
    outputs = 2 * ((rq or 0) + rkv + rope) + 2 * a * (qk + nope + vd) + 2 * h
    wgrad = 2 * h + 2 * ((rq or 0) + rkv) + 2 * a * vd + outputs
    ograd = outputs + 2 * h + 2 * ((rq or 0) + rkv)
    return _Parts(linear_flops=2 * b * s * weights, core_flops=core, act=b * s * act, wgrad=b * s * wgrad,
                  ograd=b * s * ograd, params=weights + h + (rq or 0) + rkv,
                  fp8_act=b * s * (2 * h + 2 * ((rq or 0) + rkv) + 2 * a * vd),
                  rep_act=b * s * (2 * h + 2 * h + mask * h), tp_collectives=2, ring_width=a * (qk + vd))


def _mlp(m: ModelSpec, f: int, tokens_per_token: float = 1.0, mask: bool = True) -> _Parts:
    """One MLP of inner size f applied to `tokens_per_token` x the tokens (MoE top-k routing)."""
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    mats = 3 if m.gated_mlp else 2
    linear = tokens_per_token * 2 * b * s * h * f * mats
    saved = 4 if m.gated_mlp else 2
    # per routed token: input 2h, saved intermediates 2f each; per token: LN input 2h, dropout mask h
    act = tokens_per_token * (2 * h + saved * 2 * f) + (m.dropout and mask) * h
    ograd = tokens_per_token * (2 * f * (2 if m.gated_mlp else 1) + 2 * h)  # gate and up (or fc1), down
    wgrad = tokens_per_token * (2 * h + 2 * f) + ograd  # their inputs beside
    params = mats * h * f
    return _Parts(linear_flops=linear, act=b * s * act, wgrad=b * s * wgrad, params=params,
                  ograd=b * s * ograd, fp8_act=b * s * tokens_per_token * (2 * h + 2 * f),
                  # a fused SwiGLU keeps its input (gate, up) and output, not silu(gate)
                  unfused_act=b * s * tokens_per_token * 2 * f if m.gated_mlp else 0.0,
                  rep_act=b * s * (tokens_per_token * 2 * h + (m.dropout and mask) * h), tp_collectives=2)


def _add(*parts: _Parts) -> _Parts:
    return _Parts(**{k: sum(getattr(p, k) for p in parts) for k in _Parts.model_fields})


def _norm_act(m: ModelSpec) -> float:
    return m.micro_batch_size * m.seq_len * 2 * m.hidden  # second layer norm input (2h per token)


def _norm(m: ModelSpec) -> _Parts:
    """The second layer norm: its input, replicated over TP ranks without sequence parallelism."""
    return _Parts(act=_norm_act(m), params=m.hidden, rep_act=_norm_act(m), ograd=_norm_act(m))


def _dense(m: ModelSpec, t: Training) -> _Parts:
    return _add(_attention(m, t), _mlp(m, m.f), _norm(m))


def _moe_mlp(m: ModelSpec) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    e, k, fe = m.experts, m.top_k, m.moe_ffn or m.f
    routed = _mlp(m, fe, tokens_per_token=k)
    shared = _mlp(m, fe, tokens_per_token=m.shared_experts, mask=False) if m.shared_experts else _Parts()
    router = _Parts(linear_flops=2 * b * s * h * e, act=b * s * (4 * e + 2 * k * h), params=h * e,
                    bf16_flops=2 * b * s * h * e, ograd=b * s * 2 * e)
    out = _add(routed, shared, router)
    out.params = e * routed.params + m.shared_experts * routed.params + h * e
    out.expert_params = e * routed.params
    out.expert_flops = routed.linear_flops
    out.unfused_act += b * s * 2 * k * h  # the permuted copies, counted again as the experts' inputs
    # routed experts exchange tokens by all-to-all (no TP collective around them when etp = 1, which
    # the parallel estimate accounts for); a shared expert is a TP-split MLP
    out.tp_collectives = 2 if m.shared_experts else 0
    out.all_to_alls = 2
    out.moe_layers = 1
    # Element-wise traffic of the routed path, per routed copy of a token: permutation and unpermutation
    # each read and write the hidden state (4h values), the fused activation reads gate and up and
    # writes fe (3fe, 2fe when not gated); FP8 casts of both expert inputs (h, fe). A dense layer's
    # element-wise work stays inside the fitted matmul efficiency (docs/costmodel.md says why);
    # fine-grained experts repeat it top_k times per token for a fraction of a dense MLP's matmuls.
    copies = b * s * k
    out.stream_bytes = copies * STREAM * (4 * h + (3 if m.gated_mlp else 2) * fe)
    out.cast_bytes = copies * CAST * (h + fe)
    return out


def _moe(m: ModelSpec, t: Training) -> _Parts:
    return _add(_attention(m, t), _moe_mlp(m), _norm(m))


def _mamba(m: ModelSpec) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    di, n = m.mamba_expand * h, m.mamba_d_state
    nh = max(1, di // m.mamba_head_dim)
    proj_out = 2 * di + 2 * n + nh
    linear = 2 * b * s * h * proj_out + 2 * b * s * di * h
    core = 6 * b * s * di * n  # chunked SSD scan (estimate)
    act = 2 * (2 * h + 4 * di + 2 * n) + 2 * (di + 2 * n) + 2 * 3 * di
    outputs = 2 * proj_out + 2 * h  # in- and out-projections
    wgrad = 2 * h + 2 * di + outputs
    ograd = outputs + 2 * (di + 2 * n) + 2 * h + 2 * di  # and torch's: the conv's, the norms' scales'
    params = h * proj_out + di * h + 4 * (di + 2 * n) + 3 * nh + di + h  # + conv, A, D, dt, norms
    return _Parts(linear_flops=linear, core_flops=core, act=b * s * act, wgrad=b * s * wgrad, params=params,
                  ograd=b * s * ograd, fp8_act=b * s * (2 * h + 2 * di),
                  rep_act=b * s * 2 * 2 * h, tp_collectives=2)


def _lm_head(m: ModelSpec) -> _Parts:
    b, s, h, v = m.micro_batch_size, m.seq_len, m.hidden, m.vocab
    # input 2h, final norm input 2h, fp32 logits 4V per token for the cross-entropy backward; Megatron
    # keeps the output layer in 16 bits in FP8 runs (it is not a Transformer Engine layer)
    return _Parts(linear_flops=2 * b * s * h * v, act=b * s * (4 * h + 4 * v), wgrad=b * s * (2 * h + 2 * v),
                  ograd=b * s * (2 * v + 2 * h), params=h * v + h, bf16_flops=2 * b * s * h * v,
                  rep_act=b * s * 4 * h, tp_collectives=1)


def _embedding(m: ModelSpec) -> _Parts:
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    bytes_ = DTYPE_BYTES[m.dtype]
    # gather: read and write b*s*h values; the weight gradient scatter-adds as many
    return _Parts(act=b * s * 8, hbm_bytes=2 * b * s * h * bytes_, params=m.vocab * h, rep_act=b * s * 8,
                  tp_collectives=1)


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
                          wgrad=b * s * (2 * 2 * h + 2 * h), ograd=b * s * (2 * h + 2 * 2 * h),
                          params=2 * h * h + 2 * h)
            head = _lm_head(m)
            head.params = 0.0  # the output head is shared with the main LM head (DeepSeek-V3)
            return _add(block, proj, head)
    raise ValueError(f"stack: unknown layer type {kind!r}")


def _scale_bytes(m: ModelSpec, p: _Parts) -> _Parts:
    """Formulas count 16-bit activations; fp32 models keep twice the bytes."""
    if DTYPE_BYTES[m.dtype] == 2:
        return p
    k = DTYPE_BYTES[m.dtype] / 2
    return p.model_copy(update={name: getattr(p, name) * k for name in
                                ("act", "wgrad", "ograd", "fp8_act", "rep_act", "unfused_act")})


ATTENDING = ("dense", "moe", "attention", "mtp_head")  # layer types with an attention core
BLOCKS = ("dense", "moe", "mamba", "attention", "mlp", "mtp_head")  # what full recompute recomputes


def _attended(m: ModelSpec, block: int) -> float:
    """Fraction of the s x s attention scores a kernel computes in block `block` (0-based): about
    half with a causal mask (FlashAttention skips masked tiles), w/s(1 - w/2s) with a causal window
    of w tokens; 1 without a mask."""
    s, w = m.seq_len, m.sliding_window
    local = w is not None and w < s and not (m.full_attention_every and (block + 1) % m.full_attention_every == 0)
    if local:
        keys = w - w * (w - 1) / (2 * s) if m.causal else min(2 * w + 1, s)
    else:
        keys = (s + 1) / 2 if m.causal else s
    return keys / s


class _Rates(BaseModel):
    """What one GPU does per ms (calibrated estimate): 16-bit and FP8 matmul FLOPs, attention FLOPs,
    the slowdown of routed-expert work, HBM bytes."""

    bf16: float
    fp8: float
    attention: float
    moe: float
    hbm: float

    @classmethod
    def of(cls, spec: Spec) -> _Rates:
        hw = spec.hardware
        bf16 = hw.peak_tflops * 1e9 * hw.bf16_efficiency
        fp8 = hw.fp8_tflops * 1e9 * hw.fp8_efficiency if spec.precision == "fp8" else bf16
        attention = hw.peak_tflops * 1e9 * (hw.attention_efficiency or hw.bf16_efficiency)
        return cls(bf16=bf16, fp8=fp8, attention=attention, moe=hw.moe_efficiency, hbm=hw.hbm_gbps * 1e6)


def _pass_times(p: _Parts, spec: Spec, layout: Layout, block: int | None
                ) -> tuple[float, float, float, float]:
    """F, B, W compute time of one layer on one GPU (calibrated estimate) and its attention kernels' F:
    FP8-able matmuls at the FP8 rate, the rest at the 16-bit one, the scores a kernel computes
    (`_attended`); the routed experts' element-wise kernels and FP8 casts at the HBM rate, twice
    their traffic in B (a backward reads what the forward read and the output's gradient, and writes
    the input's); all over tp x cp."""
    r = _Rates.of(spec)
    share = layout.tp * layout.cp
    core = p.core_flops * (_attended(spec.model, block) if block is not None else 1.0)
    expert = p.expert_flops / r.moe - p.expert_flops  # the routed experts' extra time, at the FP8-able rate
    linear = ((p.linear_flops - p.bf16_flops + expert) / r.fp8 + p.bf16_flops / r.bf16) / share
    core_ms = core / (r.attention if block is not None else r.bf16) / share
    hbm = p.hbm_bytes / layout.cp / r.hbm
    stream = (p.stream_bytes + (p.cast_bytes if spec.precision == "fp8" else 0.0)) / share / r.hbm
    return linear + core_ms + hbm + stream, linear + 2 * core_ms + hbm + 2 * stream, linear + hbm, core_ms


def exposed_parts(p: _Parts, spec: Spec, layout: Layout, compute: tuple[float, float], core_ms: float
                  ) -> list[tuple[float, float, float]]:
    """Communication time left on the compute stream in F and in B, by kind -- (TP, EP, CP) ms for each
    pass (docs/costmodel.md; a configuration search reports the kinds apart):

    * TP: `tp_collectives` all-gathers / reduce-scatters of the hidden state (b·s/cp·h 16-bit values)
      per pass; the part beyond `tp_overlap` x the pass's compute shows;
    * EP: `all_to_alls` per pass, each GPU sending its b·s/(tp·cp) tokens x top_k x h 16-bit values;
      the part beyond `ep_overlap` x the pass's compute shows;
    * CP: cp - 1 ring steps of the K and V chunk in F, twice that in B (K, V and their gradients);
      they overlap the attention kernels, only the excess shows."""
    m, par = spec.model, spec.parallel_or_default
    b, s, h = m.micro_batch_size, m.seq_len, m.hidden
    tp = p.tp_collectives * layout.tp_collective_ms(b * s / layout.cp * h * 2)
    routed = b * s / (layout.tp * layout.cp) * (m.top_k or 0) * h * 2
    a2a = p.all_to_alls * layout.all_to_all_ms(routed)
    ring = (layout.cp - 1) * layout.cp_ring_ms(b * s / layout.cp * p.ring_width * 2 / layout.tp)
    return [(max(0.0, tp - par.tp_overlap * busy), max(0.0, a2a - par.ep_overlap * busy),
             max(0.0, (k + 1) * (ring - core_ms))) for k, busy in enumerate(compute)]


def _host_floor(p: _Parts, spec: Spec, fwd: float, bi: float, bw: float) -> tuple[float, float]:
    """F and B of a MoE layer when the host bounds them (calibrated estimate, docs/costmodel.md).

    A MoE layer pass issues hundreds of small kernels (routing, permutation, one GEMM per local expert
    and pass in Transformer Engine's grouped linear on Hopper), and a dropless dispatcher copies the
    tokens each expert receives to the host every pass (Megatron-Core's token dispatchers synchronise
    there unless inputs are padded to a fixed capacity), so the host cannot run ahead of the device
    across layers: each pass lasts at least the host's time to issue it, `hardware.moe_host_ms` per
    MoE layer. The backward's floor covers B and W together (Megatron runs them in one pass).

    How much of the host's time hides behind the device's follows the expert all-to-all overlap
    (`parallel.ep_overlap`). With it (Megatron's overlap_moe_expert_parallel_comm runs one
    microbatch's forward beside another's backward), the host issues one while the device runs the
    other, and a pass lasts the longer of the two. Without it the synchronisation drains the
    device's queue every pass, so the host's time adds to the device's; in between, the part of the
    host's time the overlap does not cover adds."""
    host = p.moe_layers * spec.hardware.moe_host_ms
    if host <= 0:
        return fwd, bi
    exposed = (1.0 - spec.parallel_or_default.ep_overlap) * host
    return max(fwd + exposed, host), max(bi + bw + exposed, host) - bw


def _per_gpu_memory(p: _Parts, spec: Spec, layout: Layout) -> tuple[float, float]:
    """(activation, W-held) bytes one GPU keeps for the layer: what Megatron's fused kernels keep
    (`unfused_act` out); FP8 runs keep linear-layer inputs in 8 bits; TP with sequence parallelism
    splits everything, without it only what is not `rep_act` (Korthikanti et al. 2022, Table 2:
    sbh(10 + 24/t + 5as/(ht)) vs sbh(34 + 5as/h)/t); CP splits the sequence."""
    act = p.act - p.unfused_act
    if spec.precision == "fp8":
        act -= p.fp8_act / 2
    if layout.tp > 1 or layout.cp > 1:
        rep = min(p.rep_act, act)
        act = ((act - rep) / layout.tp + (rep / layout.tp if layout.sp else rep)) / layout.cp
    wgrad = min(p.wgrad * act / p.act, act) if p.act > 0 else 0.0
    return act, wgrad


def layer_costs(spec: Spec) -> list[LayerCost]:
    """Per-layer, per-microbatch F/B/W time, activation and W-held bytes, parameters and the static
    bytes they keep -- per GPU: a stage's GPU holds its layers' share over tp x cp (and ep)."""
    model, hardware, training = spec.model, spec.hardware, spec.training
    flops_per_ms = hardware.peak_tflops * 1e12 * hardware.mfu / 1e3
    if model.dtype == "fp32":
        flops_per_ms /= 2  # without 16-bit tensor cores (TF32 is half the BF16 rate on A100/H100)
    bytes_per_ms = hardware.hbm_gbps * 1e9 / 1e3
    layout = Layout.of(spec) if spec.describes_the_job else None
    out, block = [], 0
    for g in model.layer_groups():
        p = _scale_bytes(model, _parts(model, training, g.type))
        attending = block if g.type in ATTENDING else None
        if spec.precision is None:  # the original estimate, every number as it always was
            fwd = (p.linear_flops + p.core_flops) / flops_per_ms + p.hbm_bytes / bytes_per_ms
            bi = (p.linear_flops + 2 * p.core_flops) / flops_per_ms + p.hbm_bytes / bytes_per_ms
            bw = p.linear_flops / flops_per_ms + p.hbm_bytes / bytes_per_ms
            core_ms = p.core_flops / flops_per_ms
            if layout is not None and layout.tp * layout.cp > 1:
                fwd, bi, bw, core_ms = (x / (layout.tp * layout.cp) for x in (fwd, bi, bw, core_ms))
        else:
            fwd, bi, bw, core_ms = _pass_times(p, spec, layout, attending)
        act, wg = p.act, p.wgrad
        og = p.ograd / (layout.tp * layout.cp) if layout is not None else p.ograd  # split as the outputs are
        transient, comm = 0.0, (0.0, 0.0, 0.0)
        if layout is not None:
            shown = exposed_parts(p, spec, layout, (fwd, bi), core_ms)
            fwd_comm, bi_comm = shown[0][0] + shown[0][1] + shown[0][2], shown[1][0] + shown[1][1] + shown[1][2]
            comm = (shown[0][0] + shown[1][0], shown[0][1] + shown[1][1], shown[0][2] + shown[1][2])
            act, wg = _per_gpu_memory(p, spec, layout)
            if training.full_recompute and g.type in BLOCKS:
                # keep the block's input only; rerun its forward inside the backward
                transient, act = act, min(act, boundary_bytes(model) / (layout.tp * layout.cp))
                wg, bi = min(wg, act), bi + fwd + fwd_comm
            fwd, bi = fwd + fwd_comm, bi + bi_comm
            if spec.precision is not None:
                fwd, bi = _host_floor(p, spec, fwd, bi, bw)
        if g.type in BLOCKS:
            block += 1
        act = g.activation_mib * MIB if g.activation_mib is not None else act
        wg = g.weight_grad_mib * MIB if g.weight_grad_mib is not None else wg
        attended = _attended(model, attending) if attending is not None else 1.0
        out.append(LayerCost(
            type=g.type,
            forward_ms=g.forward_ms if g.forward_ms is not None else fwd,
            backward_input_ms=g.backward_input_ms if g.backward_input_ms is not None else bi,
            backward_weight_ms=g.backward_weight_ms if g.backward_weight_ms is not None else bw,
            activation_bytes=act,
            weight_grad_bytes=min(wg, act),
            output_grad_bytes=g.output_grad_mib * MIB if g.output_grad_mib is not None else og,
            params=g.params if g.params is not None else p.params,
            static_bytes=0.0,
            flops=p.linear_flops + p.core_flops,
            model_flops=p.linear_flops + p.core_flops * attended,
            expert_params=p.expert_params,
            transient_bytes=transient,
            comm_ms=comm,
        ))
    if model.tie_embeddings:
        head = next(c for c in out if c.type == "lm_head")
        head.params = out[0].params  # same shape; a second copy lives on the last stage
    _static(spec, out, layout)
    return out


def _static(spec: Spec, costs: list[LayerCost], layout: Layout | None) -> None:
    """Fill each layer's static bytes (weights, gradients, optimizer state) and, with a parallel
    layout, the per-GPU gradient bytes its stage reduces and parameters its optimizer steps."""
    par, t = spec.parallel, spec.training
    if par is None:
        bpp = static_bytes_per_param(t)
        for c in costs:
            c.static_bytes = c.params * bpp
        if layout is None:
            return
    grad = 4 if par is None or par.grad_dtype == "fp32" else 2
    optimizer = "distributed" if par is None else par.optimizer
    dp_group = layout.dp * layout.cp
    for c in costs:
        dense = (c.params - c.expert_params) / layout.tp
        expert = c.expert_params / (layout.ep * layout.etp)
        c.grad_bytes = (dense * grad, expert * grad)
        sharded = (dense, expert) if optimizer == "replicated" else (dense / dp_group, expert / layout.edp)
        c.optimizer_params = sharded[0] + sharded[1]
        if par is None:
            continue
        if t.bytes_per_param is not None:
            c.static_bytes = (dense + expert) * t.bytes_per_param
        elif optimizer == "fsdp":  # 16-bit weights and gradients gathered for the stage, the rest sharded
            c.static_bytes = (dense + expert) * 4 + (4 + 4 + 8) * c.optimizer_params
        else:  # 16-bit weights (FP8 runs: FP8 data + transpose, as Megatron's fp8_param_gather keeps
            # them), gradient buffer, fp32 master weights and Adam moments (12 B, sharded)
            c.static_bytes = (dense + expert) * (2 + grad) + 12 * c.optimizer_params


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
    placed loop or V with `chunks` stages per device (defaults: the spec's training settings).

    A spec that describes the whole job (`parallel`, `precision` or `cluster`) also gets the
    iteration around the pipeline: each stage's gradient reduction, each device's optimizer step,
    and the workload that turns the iteration time into tokens/s per GPU and MFU."""
    m, hw, t = spec.model, spec.hardware, spec.training
    placement = placement or t.placement
    chunks = chunks or (t.num_chunks if placement == t.placement else (2 if placement == "v" else 1))
    costs = costs if costs is not None else layer_costs(spec)
    num_stages = t.devices * chunks
    if len(partition) != num_stages:
        raise ValueError(f"partition: {len(partition)} ranges for {num_stages} stages")
    if partition[0][0] != 0 or partition[-1][1] != len(costs) or any(
            a[1] != b[0] for a, b in itertools.pairwise(partition)) or any(r[1] <= r[0] for r in partition):
        raise ValueError(f"partition: ranges must be non-empty, contiguous and cover 0..{len(costs)}")
    layout = Layout.of(spec) if spec.describes_the_job else None
    boundary = boundary_bytes(m)
    if layout is not None and layout.tp * layout.cp > 1:
        boundary /= layout.tp * layout.cp  # each GPU sends and checkpoints its share of the hidden state
    host_bytes_per_ms = hw.host_link_gbps * 1e9 / 1e3
    frees_at_w = t.backward_frees == "at_w"  # torch's split backward: B retains the graph for W
    stages, params_on = [], [0.0] * t.devices
    static_on, transient_on, tail_on = [0.0] * t.devices, [0.0] * t.devices, [0.0] * t.devices
    for k, (lo, hi) in enumerate(partition):
        layer = costs[lo:hi]
        act = sum(c.activation_bytes for c in layer)
        wg = sum(c.weight_grad_bytes for c in layer)
        # only torch's split backward keeps output gradients beside the activation (Zero Bubble's
        # model counts them in weight_grad_mib), and not on the first stage, whose W runs it all
        og = sum(c.output_grad_bytes for c in layer) if frees_at_w and k > 0 else 0.0
        fwd = sum(c.forward_ms for c in layer)
        ckpt = min(boundary if lo > 0 else m.micro_batch_size * m.seq_len * 8, act)
        offload = act / host_bytes_per_ms
        device = stage_device(k, t.devices, placement)
        params_on[device] += sum(c.params for c in layer)
        reduce = None
        if layout is not None:
            static_on[device] += sum(c.static_bytes for c in layer)
            transient_on[device] = max([transient_on[device], *(c.transient_bytes for c in layer)])
            reduce = _reduce_ms(spec, layout, layer)
            if not spec.parallel_or_default.overlap_grad_reduce:  # all reductions after the device's last op
                tail_on[device], reduce = tail_on[device] + reduce, None
        stages.append(Stage(
            device=device, forward_ms=_r_pos(fwd),
            backward_input_ms=_r_pos(sum(c.backward_input_ms for c in layer)),
            backward_weight_ms=_r(sum(c.backward_weight_ms for c in layer)),
            recompute_ms=_r_pos(fwd), offload_ms=_r(max(offload, 1e-4)),
            activation_mib=_r(act / MIB), weight_grad_mib=_r((act if frees_at_w else min(wg, act)) / MIB),
            offloadable_mib=_r(act / MIB), checkpoint_mib=_r(min(ckpt, act) / MIB),
            output_grad_mib=_r(og / MIB) if og else None,
            reduce_ms=_r(reduce) if reduce else None,
        ))
    budgets = t.memory_budget_gib if isinstance(t.memory_budget_gib, list) else [t.memory_budget_gib] * t.devices
    limits = [_r(((b if b is not None else hw.hbm_gib) - t.reserved_gib) * 1024) for b in budgets]
    if spec.parallel is None:
        bpp = static_bytes_per_param(t)
        static = [params_on[d] * bpp for d in range(t.devices)]
    else:
        static = static_on
    static = [static[d] + transient_on[d] for d in range(t.devices)]
    optimizer = [None] * t.devices
    if layout is not None:
        optimizer = [_r(_optimizer_ms(spec, layout, [c for k, (lo, hi) in enumerate(partition)
                                                     if stage_device(k, t.devices, placement) == d
                                                     for c in costs[lo:hi]]) + tail_on[d])
                     for d in range(t.devices)]
    devices = [Device(memory_limit_mib=limits[d], static_mib=_r(static[d] / MIB), optimizer_ms=optimizer[d])
               for d in range(t.devices)]
    if layout is None:
        p2p = hw.link_latency_us / 1e3 + boundary / (hw.link_gbps * 1e9 / 1e3)
    else:
        p2p = layout.p2p_ms(boundary)
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
    workload = None
    if layout is not None:
        metadata["job"] = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep,
                           "etp": layout.etp, "sp": layout.sp, "gpus": layout.gpus,
                           "precision": spec.precision or m.dtype, "cluster": layout.cluster.name,
                           "optimizer": spec.parallel_or_default.optimizer}
        replicas = t.microbatches * layout.dp
        workload = Workload(tokens=replicas * m.micro_batch_size * m.seq_len, gpus=layout.gpus,
                            model_flops=3 * sum(c.model_flops for c in costs) * replicas,
                            peak_tflops=hw.peak_tflops)
    return Problem(
        format=PROBLEM_FORMAT, num_devices=t.devices, num_microbatches=t.microbatches, p2p_ms=_r(p2p),
        options=Options(split_backward=t.split_backward, offload=t.offload, recompute=t.recompute),
        stages=stages, devices=devices, metadata=metadata, workload=workload,
    )


# Adam's step reads and writes fp32 master weights and both moments (24 B), reads the gradient and
# writes the 16-bit weight (about 8 B more): memory-bound, at the HBM rate.
OPTIMIZER_BYTES_PER_PARAM = 32.0


def _reduce_ms(spec: Spec, layout: Layout, layers: list[LayerCost]) -> float:
    """The stage's data-parallel gradient reduction (layout.grad_reduce_ms)."""
    dense = sum(c.grad_bytes[0] for c in layers)
    expert = sum(c.grad_bytes[1] for c in layers)
    return layout.grad_reduce_ms(dense, expert, all_reduce=spec.parallel_or_default.optimizer == "replicated")


def _optimizer_ms(spec: Spec, layout: Layout, layers: list[LayerCost]) -> float:
    """One device's optimizer step over the parameters it updates, plus the distributed optimizer's
    parameter all-gather when it does not hide in the next iteration's forwards."""
    par = spec.parallel_or_default
    step = sum(c.optimizer_params for c in layers) * OPTIMIZER_BYTES_PER_PARAM / (spec.hardware.hbm_gbps * 1e6)
    if par.optimizer == "distributed" and not par.overlap_param_gather:
        dense = sum(c.grad_bytes[0] for c in layers) / (4 if par.grad_dtype == "fp32" else 2) * 2
        expert = sum(c.grad_bytes[1] for c in layers) / (4 if par.grad_dtype == "fp32" else 2) * 2
        step += layout.param_gather_ms(dense, expert)
    return step


def partition_for(spec: Spec, strategy: str | list[int], chunks: int | None = None,
                  costs: list[LayerCost] | None = None) -> list[list[int]]:
    """Layer ranges for 'uniform' / 'balanced' (by F+B+W time, embedding and heads counted) or an
    explicit list of layers per stage."""
    costs = costs if costs is not None else layer_costs(spec)
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
