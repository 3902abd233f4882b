"""The spec document (`pipeplan.spec/v1`): a model, its hardware and how it is trained.

Why a module of its own: the schema is the product's input format; the formulas that cost it
(planner.costmodel) and the partitioners that cut it into stages (planner.partition) both read it,
and neither belongs in the other. Validation names the field; `check_spec_size` bounds the work a
document may ask for before anything is built.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .contract import DEFAULT_LIMITS, PROBLEM_FORMAT, Limits

MIB = 2.0**20
GIB = 2.0**30
SPEC_FORMAT = "pipeplan.spec/v1"

LayerType = Literal["dense", "moe", "mamba", "attention", "mlp", "embedding", "lm_head", "mtp_head"]
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
PATTERN = {"D": "dense", "E": "moe", "M": "mamba", "*": "attention", "-": "mlp"}


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
    "LayerGroup",
    "ModelSpec",
    "Spec",
    "Training",
    "check_spec_size",
    "is_problem_document",
    "spec_from_document",
    "spec_layer_count",
]
