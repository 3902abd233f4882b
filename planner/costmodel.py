"""Cost model: a model + hardware + training description (a *spec*) turned into a problem v1.

Why: clients know their model and their GPUs, not per-stage milliseconds. This module estimates, per
layer, the compute time of F (forward), B (input gradient) and W (weight gradient), the activation
memory each microbatch keeps, the part of it only W needs, the parameters, and from those the per-stage
numbers of a problem v1 for a given partition (contiguous layer ranges per stage) and placement.
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
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .contract import DEFAULT_LIMITS, PROBLEM_FORMAT, Device, Limits, Options, Problem, Stage

MIB = 2.0**20
GIB = 2.0**30
SPEC_FORMAT = "pipeplan.spec/v1"
COSTMODEL_VERSION = "pipeplan.costmodel/1"

LayerType = Literal["dense", "moe", "mamba", "attention", "mlp", "embedding", "lm_head", "mtp_head"]
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
PATTERN = {"D": "dense", "E": "moe", "M": "mamba", "*": "attention", "-": "mlp"}


# --------------------------------------------------------------------------------------------------
# Spec models
# --------------------------------------------------------------------------------------------------
class LayerGroup(BaseModel):
    """`count` consecutive layers of one type; profiled numbers (per layer, per microbatch) replace
    the estimate of exactly the field they name."""

    model_config = ConfigDict(extra="forbid")

    type: LayerType
    count: int = Field(default=1, ge=1)
    forward_ms: float | None = Field(default=None, gt=0)
    backward_input_ms: float | None = Field(default=None, gt=0)
    backward_weight_ms: float | None = Field(default=None, ge=0)
    activation_mib: float | None = Field(default=None, ge=0)
    weight_grad_mib: float | None = Field(default=None, ge=0)
    params: float | None = Field(default=None, ge=0, description="parameter count of one layer")


class ModelSpec(BaseModel):
    """A transformer-like model. Without `stack`, the blocks are `layers` dense blocks (or MoE blocks
    when `experts` is set, after `first_dense_layers` dense ones, every `moe_every`-th layer)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "model"
    layers: int | None = Field(default=None, ge=1, description="transformer blocks (without embedding/head)")
    hidden: int = Field(ge=1)
    ffn: int | None = Field(default=None, ge=1, description="MLP inner size; default 4 x hidden")
    heads: int = Field(ge=1)
    kv_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1)
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    micro_batch_size: int = Field(default=1, ge=1)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    gated_mlp: bool = Field(default=True, description="SwiGLU/GeGLU MLP (3 matrices) instead of 2")
    dropout: bool = False
    tie_embeddings: bool = False
    experts: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=1)
    moe_ffn: int | None = Field(default=None, ge=1, description="expert MLP size; default ffn")
    shared_experts: int = Field(default=0, ge=0)
    moe_every: int = Field(default=1, ge=1)
    first_dense_layers: int = Field(default=0, ge=0)
    mamba_d_state: int = Field(default=128, ge=1)
    mamba_expand: int = Field(default=2, ge=1)
    mamba_head_dim: int = Field(default=64, ge=1)
    mtp_heads: int = Field(default=0, ge=0, description="multi-token-prediction heads after the LM head")
    stack: list[LayerGroup] | None = Field(
        default=None, description="explicit layer types in order; embedding/lm_head added when absent")
    pattern: str | None = Field(
        default=None, description="hybrid layout, one character per block (Megatron hybrid style): "
        "D dense, E MoE, M Mamba, * attention only, - MLP only")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.stack is not None and self.pattern is not None:
            raise ValueError("pattern: give either pattern or stack, not both")
        if self.pattern is not None:
            bad = sorted(set(self.pattern) - set(PATTERN))
            if bad or not self.pattern:
                raise ValueError(f"pattern: unknown characters {bad}; use {''.join(PATTERN)}")
            if "E" in self.pattern and self.experts is None:
                raise ValueError("pattern: has MoE blocks (E) but experts/top_k are not given")
        if self.stack is None and self.pattern is None and self.layers is None:
            raise ValueError("layers: give the number of blocks (or a pattern or an explicit stack)")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide heads ({self.heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"heads: {self.heads} does not divide hidden ({self.hidden}); give head_dim")
        if (self.experts is None) != (self.top_k is None):
            raise ValueError("experts/top_k: give both for a MoE model, or neither")
        if self.experts is not None and self.top_k > self.experts:
            raise ValueError(f"top_k: {self.top_k} exceeds experts ({self.experts})")
        uses_moe = self.stack is not None and any(g.type == "moe" for g in self.stack)
        if uses_moe and self.experts is None:
            raise ValueError("stack: has moe layers but experts/top_k are not given")
        if self.layers is not None and self.first_dense_layers > self.layers:
            raise ValueError("first_dense_layers: exceeds layers")
        return self

    # derived sizes
    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * self.hd

    def layer_groups(self) -> list[LayerGroup]:
        """The whole stack in order: embedding, blocks, LM head, MTP heads."""
        if self.stack is not None:
            groups = list(self.stack)
        elif self.pattern is not None:
            groups = [LayerGroup(type=PATTERN[c]) for c in self.pattern]
        else:
            groups = []
            for i in range(self.layers):
                moe = (self.experts is not None and i >= self.first_dense_layers
                       and (i - self.first_dense_layers) % self.moe_every == 0)
                groups.append(LayerGroup(type="moe" if moe else "dense"))
        if not groups or groups[0].type != "embedding":
            groups.insert(0, LayerGroup(type="embedding"))
        if not any(g.type == "lm_head" for g in groups):
            tail = [i for i, g in enumerate(groups) if g.type == "mtp_head"]
            groups.insert(tail[0] if tail else len(groups), LayerGroup(type="lm_head"))
        if not any(g.type == "mtp_head" for g in groups):
            groups += [LayerGroup(type="mtp_head") for _ in range(self.mtp_heads)]
        return [LayerGroup(**{**g.model_dump(), "count": 1}) for g in groups for _ in range(g.count)]


class Hardware(BaseModel):
    """One accelerator and its links. Presets give datasheet numbers; any field may be overridden."""

    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    peak_tflops: float = Field(gt=0, description="dense 16-bit tensor-core peak, TFLOP/s")
    mfu: float = Field(default=0.45, gt=0, le=1, description="achieved fraction of the peak")
    hbm_gib: float = Field(gt=0)
    hbm_gbps: float = Field(default=2000.0, gt=0, description="HBM bandwidth, GB/s")
    host_link_gbps: float = Field(gt=0, description="device<->host copy bandwidth per direction, GB/s")
    link_gbps: float = Field(gt=0, description="inter-stage (p2p) bandwidth per direction, GB/s")
    link_latency_us: float = Field(default=10.0, ge=0)


# Datasheet numbers (NVIDIA A100 / H100 / H200 datasheets: dense BF16 tensor TFLOP/s, HBM size and
# bandwidth). Host link: achievable PCIe 4.0 x16 (~25 GB/s of 32) for A100, PCIe 5.0 x16 (~50 of 64)
# for H100/H200. Inter-stage link: NVLink per direction at ~80% (A100: 300 GB/s, H100/H200: 450 GB/s
# per direction on the datasheet). Across nodes, override link_gbps with the NIC rate (e.g. 50 for
# 400 Gb/s InfiniBand). hbm_gib is the memory nvidia-smi reports.
HARDWARE: dict[str, Hardware] = {
    "A100-40GB": Hardware(name="A100-40GB", peak_tflops=312, mfu=0.5, hbm_gib=40.0, hbm_gbps=1555,
                          host_link_gbps=25, link_gbps=240),
    "A100-80GB": Hardware(name="A100-80GB", peak_tflops=312, mfu=0.5, hbm_gib=80.0, hbm_gbps=2039,
                          host_link_gbps=25, link_gbps=240),
    "H100-80GB": Hardware(name="H100-80GB", peak_tflops=989, mfu=0.4, hbm_gib=79.6, hbm_gbps=3350,
                          host_link_gbps=50, link_gbps=360),
    "H200-141GB": Hardware(name="H200-141GB", peak_tflops=989, mfu=0.4, hbm_gib=140.4, hbm_gbps=4800,
                           host_link_gbps=50, link_gbps=360),
}


class Training(BaseModel):
    """How the model is trained: pipeline size, microbatches, placement and memory policy."""

    model_config = ConfigDict(extra="forbid")

    devices: int = Field(ge=1, description="pipeline-parallel devices")
    microbatches: int = Field(ge=1)
    placement: Literal["loop", "v"] = "loop"
    chunks: int | None = Field(default=None, ge=1, le=8, description="stages per device (V: 2)")
    split_backward: bool = True
    offload: bool = False
    recompute: bool = False
    memory_budget_gib: float | list[float] | None = Field(
        default=None, description="per-device limit (one number or one per device); default: HBM")
    reserved_gib: float = Field(default=0.0, ge=0, description="set aside: CUDA context, NCCL, slack")
    dp_shards: int = Field(default=1, ge=1, description="data-parallel degree sharding optimizer state")
    bytes_per_param: float | None = Field(default=None, gt=0, description="override the 16 of ZeRO")
    flash_attention: bool = True

    @model_validator(mode="after")
    def _check(self) -> Training:
        if self.placement == "v" and self.chunks not in (None, 2):
            raise ValueError(f"chunks: V placement needs 2 stages per device, got {self.chunks}")
        if isinstance(self.memory_budget_gib, list) and len(self.memory_budget_gib) != self.devices:
            raise ValueError(f"memory_budget_gib: {len(self.memory_budget_gib)} entries for"
                             f" {self.devices} devices")
        budgets = self.memory_budget_gib if isinstance(self.memory_budget_gib, list) else [self.memory_budget_gib]
        if any(b is not None and not (b > 0 and math.isfinite(b)) for b in budgets):
            raise ValueError("memory_budget_gib: must be positive")
        return self

    @property
    def num_chunks(self) -> int:
        return self.chunks or (2 if self.placement == "v" else 1)


class Spec(BaseModel):
    """A model spec document: what `problem_from_document` accepts besides a problem v1."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["pipeplan.spec/v1"] = SPEC_FORMAT
    model: ModelSpec
    hardware: Hardware
    training: Training
    partition: Literal["uniform", "balanced", "auto"] | list[int] = Field(
        default="balanced", description="strategy, or layers per stage (embedding/head included)")

    @field_validator("hardware", mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        """A preset name, or a dict with an optional `preset` whose fields it overrides."""
        if isinstance(value, str):
            if value not in HARDWARE:
                raise ValueError(f"unknown preset {value!r}; presets: {', '.join(HARDWARE)}")
            return HARDWARE[value]
        if isinstance(value, dict) and "preset" in value:
            name = value["preset"]
            if name not in HARDWARE:
                raise ValueError(f"preset: unknown {name!r}; presets: {', '.join(HARDWARE)}")
            rest = {k: v for k, v in value.items() if k != "preset"}
            return {**HARDWARE[name].model_dump(), **rest}
        return value

    @model_validator(mode="after")
    def _check(self) -> Spec:
        n = len(self.model.layer_groups())
        stages = self.training.devices * self.training.num_chunks
        if n < stages:
            raise ValueError(f"training: {stages} stages but the model has only {n} layers"
                             " (embedding and head included)")
        if isinstance(self.partition, list):
            if len(self.partition) != stages:
                raise ValueError(f"partition: {len(self.partition)} entries for {stages} stages")
            if any(c < 1 for c in self.partition) or sum(self.partition) != n:
                raise ValueError(f"partition: layers per stage must be >= 1 and sum to {n}")
        return self


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
    """Per-layer, per-microbatch F/B/W time, activation and W-held bytes, parameters."""
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
            flops=p.linear_flops + p.core_flops,
        ))
    if model.tie_embeddings:
        head = next(c for c in out if c.type == "lm_head")
        head.params = out[0].params  # same shape; a second copy lives on the last stage
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
# Placement and partitions
# --------------------------------------------------------------------------------------------------
def stage_device(stage: int, devices: int, placement: str) -> int:
    """Loop: stage k on device k mod P (Megatron interleaving). V: chunk c runs forward on even c
    and backward on odd c, so stage k and stage 2P-1-k share a device (ZB-V)."""
    chunk, pos = divmod(stage, devices)
    if placement == "v" and chunk % 2 == 1:
        return devices - 1 - pos
    return pos


def _counts_to_ranges(counts: list[int]) -> list[list[int]]:
    ranges, start = [], 0
    for c in counts:
        ranges.append([start, start + c])
        start += c
    return ranges


def uniform_partition(types: list[str], stages: int) -> list[list[int]]:
    """Megatron-LM's default: the blocks split evenly (earlier stages take the remainder), the
    embedding joins the first stage and the LM head / MTP heads the last."""
    head = sum(1 for t in types[:1] if t == "embedding")
    tail = 0
    while tail < len(types) - head and types[len(types) - 1 - tail] in ("lm_head", "mtp_head"):
        tail += 1
    blocks = len(types) - head - tail
    if blocks < stages:  # too few blocks: fall back to spreading every layer
        base, extra = divmod(len(types), stages)
        return _counts_to_ranges([base + (i < extra) for i in range(stages)])
    base, extra = divmod(blocks, stages)
    counts = [base + (i < extra) for i in range(stages)]
    counts[0] += head
    counts[-1] += tail
    return _counts_to_ranges(counts)


def balanced_partition(weights: list[float], stages: int) -> list[list[int]]:
    """Contiguous split of `weights` into `stages` non-empty ranges minimising the largest sum
    (exact dynamic programme, O(stages·L²)); among optimal splits it prefers the smallest sum of
    squares so the slack is spread instead of piled onto the last stage."""
    n = len(weights)
    if n < stages:
        raise ValueError(f"partition: {n} layers cannot fill {stages} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (math.inf, math.inf)
    # best[j][i]: (max, sumsq) splitting the first i layers into j stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, stages + 1):
        for i in range(j, n - (stages - j) + 1):
            for p in range(j - 1, i):
                prev = best[j - 1][p]
                if prev[0] == math.inf:
                    continue
                w = prefix[i] - prefix[p]
                cand = (max(prev[0], w), prev[1] + w * w)
                if cand[0] < best[j][i][0] - 1e-12 or (
                        abs(cand[0] - best[j][i][0]) <= 1e-12 and cand[1] < best[j][i][1]):
                    best[j][i] = cand
                    cut[j][i] = p
    ranges, i = [], n
    for j in range(stages, 0, -1):
        p = cut[j][i]
        ranges.append([p, i])
        i = p
    return ranges[::-1]


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
        return _counts_to_ranges(strategy)
    if strategy == "uniform":
        return uniform_partition([c.type for c in costs], stages)
    return balanced_partition([c.total_ms for c in costs], stages)


def is_problem_document(doc: Any) -> bool:
    return isinstance(doc, dict) and (doc.get("format") == PROBLEM_FORMAT or "stages" in doc)


def _int(value: Any) -> int | None:
    """An integer field's value when it is one (anything else is left to the model's validation)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def spec_layer_count(model: Any) -> int:
    """Blocks a raw `model` dict asks for (layers, pattern or stack counts), without building them."""
    if not isinstance(model, dict):
        return 0
    n = len(model["pattern"]) if isinstance(model.get("pattern"), str) else 0
    stack = model.get("stack")
    if isinstance(stack, list):
        n = max(n, sum(max(1, _int(g.get("count", 1)) or 1) for g in stack if isinstance(g, dict)))
    return max(n, _int(model.get("layers")) or 0) + max(0, _int(model.get("mtp_heads")) or 0)


def check_spec_size(doc: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ValueError naming the field when a raw spec document asks for more than `limits` allow.

    Runs on the dict before any validation: Spec validation builds every layer (ten million layers
    took 14 GB) and an "auto" partition runs a search, so the sizes are checked first, in microseconds.
    """
    if not isinstance(doc, dict):
        return
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    training = doc.get("training") if isinstance(doc.get("training"), dict) else {}
    layers = spec_layer_count(model)
    if layers > limits.max_layers:
        field = next((f for f in ("layers", "pattern", "stack") if model.get(f) is not None), "layers")
        raise ValueError(f"model.{field}: {layers} layers exceed the limit {limits.max_layers}")
    devices = _int(training.get("devices")) or 1
    microbatches = _int(training.get("microbatches")) or 1
    chunks = _int(training.get("chunks")) or (2 if training.get("placement") == "v" else 1)
    for name, value, cap in (("devices", devices, limits.max_devices),
                             ("microbatches", microbatches, limits.max_microbatches),
                             ("chunks", chunks, limits.max_stages_per_device)):
        if value > cap:
            raise ValueError(f"training.{name}: {value} exceeds the limit {cap}")
    ops = 4 * devices * max(1, chunks) * microbatches
    if ops > limits.max_ops:
        raise ValueError(f"training: devices x chunks x microbatches gives up to {ops} ops, over the"
                         f" limit {limits.max_ops}")
    if doc.get("partition") == "auto" and 4 * devices * 2 * microbatches > limits.max_auto_ops:
        # the search also tries 2 stages per device, so it is sized at chunks = 2
        raise ValueError(f"partition: \"auto\" searches up to {4 * devices * 2 * microbatches} ops per"
                         f" candidate at {devices} devices x {microbatches} microbatches, over the limit"
                         f" {limits.max_auto_ops}; give \"balanced\" or a list of layers per stage")


def spec_from_document(doc: dict) -> Spec:
    """Validate a spec document (ValidationError names the field)."""
    return Spec.model_validate(doc)


__all__ = [
    "HARDWARE",
    "Hardware",
    "LayerCost",
    "LayerGroup",
    "ModelSpec",
    "Spec",
    "Training",
    "ValidationError",
    "balanced_partition",
    "build_problem",
    "check_spec_size",
    "is_problem_document",
    "layer_costs",
    "partition_for",
    "spec_from_document",
    "stage_device",
    "uniform_partition",
]
