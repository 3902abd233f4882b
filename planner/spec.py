"""The spec document (`pipeplan.spec/v1`): a model, its hardware and how it is trained.

Why a module of its own: the schema is the product's input format; the formulas that cost it
(planner.costmodel) and the partitioners that cut it into stages (planner.partition) both read it,
and neither belongs in the other. Validation names the field; `check_spec_size` bounds the work a
document may ask for before anything is built.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from . import hf
from .contract import DEFAULT_LIMITS, PROBLEM_FORMAT, Limits

MIB = 2.0**20
GIB = 2.0**30
SPEC_FORMAT = "pipeplan.spec/v1"

LayerType = Literal["dense", "moe", "mamba", "attention", "mlp", "embedding", "lm_head", "mtp_head"]
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
PATTERN = {"D": "dense", "E": "moe", "M": "mamba", "*": "attention", "-": "mlp"}
PRECISION = Literal["bf16", "fp8"]
# The calibrated estimate's fitted figures (bench/published.py fits them; docs/costmodel.md says on
# which published runs): achieved fractions of the H100's peaks, and of the DGX links' rates.
H100_EFFICIENCY = {"bf16_efficiency": 0.491, "fp8_efficiency": 0.491}
CLUSTER_EFFICIENCY = {"bus_efficiency": 0.738}
# The host's time to issue one MoE layer pass of a dropless Megatron run on a DGX H100 node (fitted;
# docs/costmodel.md, "MoE layers").
H100_HOST = {"moe_host_ms": 4.37}


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
    output_grad_mib: float | None = Field(
        default=None, ge=0, description="what B keeps for W beside the activation (Stage.output_grad_mib);"
        " measured by `pipeplan profile`, else none")
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
    # Multi-head latent attention (DeepSeek-V2/V3; Hugging Face config names): set kv_lora_rank to use it
    q_lora_rank: int | None = Field(default=None, ge=1, description="MLA: query down-projection rank (none: full)")
    kv_lora_rank: int | None = Field(default=None, ge=1, description="MLA: joint key/value latent rank")
    qk_nope_head_dim: int | None = Field(default=None, ge=1, description="MLA: per-head query/key dims without RoPE")
    qk_rope_head_dim: int = Field(default=64, ge=0, description="MLA: per-head query/key dims with RoPE")
    v_head_dim: int | None = Field(default=None, ge=1, description="MLA: per-head value dims")
    # Attention extent, read by the calibrated estimate (a spec with `precision`); the original
    # estimate counts every attention score, as Narayanan et al. do
    causal: bool = Field(default=True, description="causal mask: kernels skip the masked half of the scores")
    sliding_window: int | None = Field(default=None, ge=1, description="tokens a query attends to (local layers)")
    full_attention_every: int | None = Field(
        default=None, ge=1, description="with sliding_window: every n-th block attends globally (None: none)")
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
        mla = (self.q_lora_rank, self.qk_nope_head_dim, self.v_head_dim)
        if self.kv_lora_rank is None and any(x is not None for x in mla):
            raise ValueError("kv_lora_rank: MLA fields are given (q_lora_rank, qk_nope_head_dim or"
                             " v_head_dim) but kv_lora_rank, which turns MLA on, is not")
        if self.full_attention_every is not None and self.sliding_window is None:
            raise ValueError("full_attention_every: needs sliding_window")
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

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """MLA: per-head query/key width (the no-RoPE and RoPE parts)."""
        return (self.qk_nope_head_dim or self.hd) + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        """Width of the attention output before the output projection."""
        return self.heads * (self.v_head_dim or self.hd) if self.mla else self.q_dim

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
    """One accelerator and its links. Presets give datasheet numbers; any field may be overridden.

    Two estimates read it: the original one (a spec without `precision`) times everything at `mfu`;
    the calibrated one (a spec with `precision`) times 16-bit matrix math at `bf16_efficiency` x the
    16-bit peak and FP8 linear layers at `fp8_efficiency` x `fp8_tflops`, fitted on published runs
    (docs/costmodel.md, "Calibration")."""

    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    peak_tflops: float = Field(gt=0, description="dense 16-bit tensor-core peak, TFLOP/s")
    mfu: float = Field(default=0.45, gt=0, le=1, description="achieved fraction of the peak")
    fp8_tflops: float | None = Field(default=None, gt=0, description="dense FP8 tensor-core peak, TFLOP/s")
    bf16_efficiency: float = Field(default=0.5, gt=0, le=1,
                                   description="calibrated estimate: achieved fraction of peak_tflops")
    fp8_efficiency: float = Field(default=0.4, gt=0, le=1,
                                  description="calibrated estimate: achieved fraction of fp8_tflops")
    attention_efficiency: float | None = Field(
        default=None, gt=0, le=1, description="calibrated estimate: attention kernels' achieved fraction of"
        " peak_tflops (default: bf16_efficiency)")
    moe_efficiency: float = Field(
        default=1.0, gt=0, le=1, description="calibrated estimate: routed-expert matmuls' achieved fraction of"
        " the dense matmul rate (grouped GEMMs)")
    moe_host_ms: float = Field(
        default=0.0, ge=0, description="calibrated estimate: host (CPU) time to issue one pass (forward, or"
        " backward) of a MoE layer; the pass lasts at least this long, and without parallel.ep_overlap"
        " it adds to the pass (0: never host-bound)")
    hbm_gib: float = Field(gt=0)
    hbm_gbps: float = Field(default=2000.0, gt=0, description="HBM bandwidth, GB/s")
    host_link_gbps: float = Field(gt=0, description="device<->host copy bandwidth per direction, GB/s")
    link_gbps: float = Field(gt=0, description="inter-stage (p2p) bandwidth per direction, GB/s")
    link_latency_us: float = Field(default=10.0, ge=0)


# Datasheet numbers (NVIDIA A100 / H100 / H200 datasheets: dense BF16 and FP8 tensor TFLOP/s, HBM size
# and bandwidth). Host link: achievable PCIe 4.0 x16 (~25 GB/s of 32) for A100, PCIe 5.0 x16 (~50 of
# 64) for H100/H200. Inter-stage link: NVLink per direction at ~80% (A100: 300 GB/s, H100/H200: 450
# GB/s per direction on the datasheet). Across nodes, override link_gbps with the NIC rate (e.g. 50 for
# 400 Gb/s InfiniBand), or give a `cluster`. hbm_gib is the memory nvidia-smi reports. `mfu` is the
# original estimate's figure; bf16_efficiency, fp8_efficiency and moe_host_ms are the calibrated
# estimate's, fitted on published H100 runs (docs/costmodel.md: which runs, and the fit); H200 has
# H100's compute (same SXM5 tensor cores and clocks) and DGX host, so it takes H100's figures; A100's
# are not calibrated.
HARDWARE: dict[str, Hardware] = {
    "A100-40GB": Hardware(name="A100-40GB", peak_tflops=312, mfu=0.5, hbm_gib=40.0, hbm_gbps=1555,
                          host_link_gbps=25, link_gbps=240),
    "A100-80GB": Hardware(name="A100-80GB", peak_tflops=312, mfu=0.5, hbm_gib=80.0, hbm_gbps=2039,
                          host_link_gbps=25, link_gbps=240),
    "H100-80GB": Hardware(name="H100-80GB", peak_tflops=989, mfu=0.4, hbm_gib=79.6, hbm_gbps=3350,
                          host_link_gbps=50, link_gbps=360, fp8_tflops=1979, **H100_EFFICIENCY, **H100_HOST),
    "H200-141GB": Hardware(name="H200-141GB", peak_tflops=989, mfu=0.4, hbm_gib=140.4, hbm_gbps=4800,
                           host_link_gbps=50, link_gbps=360, fp8_tflops=1979, **H100_EFFICIENCY, **H100_HOST),
}


class Cluster(BaseModel):
    """The nodes the GPUs sit in: how many per node and the links inside and between nodes.

    Bandwidths are per GPU and per direction; `bus_efficiency` is the fraction of them collectives
    and transfers achieve (NCCL's bus bandwidth over the link rate), fitted with the compute
    efficiencies (docs/costmodel.md)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    gpus_per_node: int = Field(default=8, ge=1)
    nvlink_gbps: float = Field(gt=0, description="inside a node, per GPU per direction, GB/s")
    nvlink_latency_us: float = Field(default=3.0, ge=0)
    ib_gbps: float = Field(gt=0, description="between nodes (the GPU's NIC), per direction, GB/s")
    ib_latency_us: float = Field(default=8.0, ge=0)
    bus_efficiency: float = Field(default=0.8, gt=0, le=1, description="achieved fraction of link rates")


# DGX nodes (NVIDIA DGX A100 / H100 / H200 datasheets): 8 GPUs on NVSwitch -- NVLink 3 at 600 GB/s
# and NVLink 4 at 900 GB/s per GPU, both directions together -- and one NIC per GPU: 200 Gb/s HDR
# InfiniBand (A100), 400 Gb/s NDR (H100, H200).
CLUSTERS: dict[str, Cluster] = {
    "DGX-A100": Cluster(name="DGX-A100", nvlink_gbps=300, ib_gbps=25, **CLUSTER_EFFICIENCY),
    "DGX-H100": Cluster(name="DGX-H100", nvlink_gbps=450, ib_gbps=50, **CLUSTER_EFFICIENCY),
    "DGX-H200": Cluster(name="DGX-H200", nvlink_gbps=450, ib_gbps=50, **CLUSTER_EFFICIENCY),
}
# The cluster a spec gets when it names none but lays a stage over several GPUs: its GPU's DGX node.
DEFAULT_CLUSTER = {"A100-40GB": "DGX-A100", "A100-80GB": "DGX-A100", "H100-80GB": "DGX-H100",
                   "H200-141GB": "DGX-H200"}


class Parallel(BaseModel):
    """How each pipeline stage is spread over GPUs, and how the optimizer state is sharded.

    Megatron-LM's conventions: GPUs = tp x cp x pp x dp (pp = training.devices); ranks are ordered
    tp fastest, then cp, then dp, then pp, so a tp group sits inside a node and pipeline hops cross
    nodes first. Expert layers fold their own etp x ep x edp grid onto the same tp x cp x dp GPUs of a
    stage (Megatron's "MoE parallel folding"): ep x etp divides tp x cp x dp, edp is the rest."""

    model_config = ConfigDict(extra="forbid")

    tp: int = Field(default=1, ge=1, description="tensor parallel degree")
    cp: int = Field(default=1, ge=1, description="context parallel degree (ring attention)")
    ep: int = Field(default=1, ge=1, description="expert parallel degree")
    etp: int | None = Field(default=None, ge=1, description="expert tensor parallel degree (default: tp)")
    dp: int | None = Field(default=None, ge=1, description="data parallel degree (default: from gpus, else 1)")
    gpus: int | None = Field(default=None, ge=1, description="total GPUs; checked against tp x cp x pp x dp")
    sp: bool | None = Field(default=None, description="sequence parallelism (default: on when tp > 1)")
    optimizer: Literal["replicated", "distributed", "fsdp"] = Field(
        default="distributed", description="replicated Adam; distributed optimizer (ZeRO-1, Megatron's"
        " --use-distributed-optimizer); fsdp (ZeRO-3, weights and gradients sharded too)")
    grad_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32", description="gradient buffer and reduction dtype (Megatron: fp32 main_grad)")
    tp_overlap: float = Field(default=0.0, ge=0, le=1, description=(
        "fraction of a layer pass's compute that hides its TP all-gathers / reduce-scatters"))
    ep_overlap: float = Field(default=0.0, ge=0, le=1, description=(
        "fraction of a MoE layer pass's compute that hides its expert all-to-alls"))
    overlap_grad_reduce: bool = Field(default=True, description="a stage's gradient reduction starts"
                                      " after its last weight gradient, beside later compute")
    overlap_param_gather: bool = Field(default=True, description="the distributed optimizer's"
                                       " parameter all-gather hides in the next iteration's forwards")

    def dp_of(self, pp: int) -> int:
        """The data parallel degree: given, else what `gpus` leaves, else 1."""
        if self.dp is not None:
            return self.dp
        return self.gpus // (self.tp * self.cp * pp) if self.gpus is not None else 1

    @property
    def sequence_parallel(self) -> bool:
        return self.sp if self.sp is not None else self.tp > 1

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp


class Training(BaseModel):
    """How the model is trained: pipeline size, microbatches, placement and memory policy."""

    model_config = ConfigDict(extra="forbid")

    devices: int = Field(ge=1, description="pipeline-parallel devices")
    microbatches: int = Field(ge=1)
    placement: Literal["loop", "v"] = "loop"
    chunks: int | None = Field(default=None, ge=1, le=64, description="stages per device (V: 2)")
    split_backward: bool = True
    backward_frees: Literal["at_b", "at_w"] = Field(default="at_b", description=(
        "where a split backward frees a microbatch's activations: at_b (Zero Bubble's implementation:"
        " B frees all but what W needs) or at_w (torch's PipelineStage, under pipeplan's runtime, torch's"
        " and torchtitan's: B retains the graph for W and keeps the output gradients W needs beside it)"))
    offload: bool = False
    recompute: bool = False
    memory_budget_gib: float | list[float] | None = Field(
        default=None, description="per-device limit (one number or one per device); default: HBM")
    reserved_gib: float = Field(default=0.0, ge=0, description="set aside: CUDA context, NCCL, slack")
    dp_shards: int = Field(default=1, ge=1, description="data-parallel degree sharding optimizer state")
    bytes_per_param: float | None = Field(default=None, gt=0, description="override the 16 of ZeRO")
    flash_attention: bool = True
    full_recompute: bool = Field(default=False, description=(
        "every block keeps only its input and recomputes its forward inside its backward (Megatron's"
        " recompute_granularity=full, torchtitan's full activation checkpointing)"))

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


def _hf_config_schema(schema: dict[str, Any]) -> None:
    """The JSON schema says what `Spec._from_hf` accepts: `hf_config` in place of (or beside) `model`."""
    schema["properties"]["hf_config"] = {
        "type": "object", "title": "Hf Config",
        "description": "A Hugging Face config.json (model_type one of " + ", ".join(hf.FAMILIES) + ") in place"
        " of model; model fields given beside it override the mapped ones (docs/costmodel.md)"}
    schema["required"] = [r for r in schema.get("required", []) if r != "model"]
    schema["anyOf"] = [{"required": ["model"]}, {"required": ["hf_config"]}]


class Spec(BaseModel):
    """A model spec document: what `problem_from_document` accepts besides a problem v1. Its model is
    `model`, or a Hugging Face config.json in `hf_config` (planner.hf maps it; `model` fields beside it
    override what the mapping chose, e.g. seq_len)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_hf_config_schema)

    format: Literal["pipeplan.spec/v1"] = SPEC_FORMAT
    model: ModelSpec
    hardware: Hardware
    training: Training
    partition: Literal["uniform", "balanced", "auto"] | list[int] = Field(
        default="balanced", description="strategy, or layers per stage (embedding/head included)")
    # Added after the first specs; each is optional and absent means what a spec meant before it
    # existed, so those specs keep their problems and cache keys (docs/costmodel.md).
    parallel: Parallel | None = Field(default=None, description="tensor/context/expert/data parallelism")
    precision: PRECISION | None = Field(
        default=None, description="bf16, or fp8 linear layers; selects the calibrated estimate")
    cluster: Cluster | None = Field(default=None, description="nodes and links (a preset name or fields)")

    @model_validator(mode="before")
    @classmethod
    def _from_hf(cls, value: Any) -> Any:
        """`hf_config` becomes `model`; its errors are located under hf_config (e.g. the missing key)."""
        if not isinstance(value, dict) or "hf_config" not in value:
            return value
        rest = {k: v for k, v in value.items() if k != "hf_config"}
        try:
            fields = hf.model_fields(value["hf_config"]).fields
        except hf.HfConfigError as exc:
            error = PydanticCustomError("hf_config", "{reason}", {"reason": exc.reason})
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=error, loc=("hf_config", *exc.path), input=value["hf_config"])]) from None
        overrides = {} if rest.get("model") is None else rest["model"]
        rest["model"] = {**fields, **overrides} if isinstance(overrides, dict) else overrides
        return rest

    @field_validator("hardware", mode="before")
    @classmethod
    def _hardware_preset(cls, value: Any) -> Any:
        return _preset(value, HARDWARE)

    @field_validator("cluster", mode="before")
    @classmethod
    def _cluster_preset(cls, value: Any) -> Any:
        return _preset(value, CLUSTERS)

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
        if self.precision is not None:
            if self.model.dtype != "bf16":
                raise ValueError(f"precision: {self.precision} needs model.dtype bf16, got {self.model.dtype}")
            if self.precision == "fp8" and self.hardware.fp8_tflops is None:
                raise ValueError(f"precision: fp8 needs hardware.fp8_tflops ({self.hardware.name} has no"
                                 " FP8 tensor cores in its preset)")
        if self.parallel is not None:
            _check_parallel(self)
        return self

    @property
    def parallel_or_default(self) -> Parallel:
        """The spec's parallel layout; a spec without one runs each stage on one GPU."""
        return self.parallel if self.parallel is not None else Parallel()

    @property
    def cluster_or_default(self) -> Cluster | None:
        """The spec's cluster, else its GPU's DGX node (None for custom hardware)."""
        if self.cluster is not None:
            return self.cluster
        name = DEFAULT_CLUSTER.get(self.hardware.name)
        return CLUSTERS[name] if name else None

    @property
    def describes_the_job(self) -> bool:
        """The spec uses the fields that describe a whole training job (parallel layout, precision or
        cluster): its problem carries the iteration around the pipeline (gradient reduction,
        optimizer step, tokens and FLOPs). Without them a spec means what it meant before they
        existed -- one pipeline, nothing around it -- and keeps its problem key."""
        return self.parallel is not None or self.precision is not None or self.cluster is not None


def _check_parallel(spec: Spec) -> None:
    """Raise ValueError naming the field when the parallel layout cannot run the model."""
    par, m, pp = spec.parallel, spec.model, spec.training.devices
    tp, cp, ep = par.tp, par.cp, par.ep
    if spec.training.dp_shards != 1:
        raise ValueError("training.dp_shards: with `parallel` the optimizer state is sharded by"
                         " parallel.optimizer over parallel.dp; drop dp_shards")
    if m.heads % tp:
        raise ValueError(f"parallel.tp: {tp} does not divide model.heads ({m.heads})")
    kv = m.kv_heads or m.heads
    if not m.mla and kv % tp:
        raise ValueError(f"parallel.tp: {tp} does not divide model.kv_heads ({kv}); Megatron splits"
                         " whole key/value groups")
    cluster = spec.cluster_or_default
    if tp > 1 and cluster is None:
        raise ValueError("cluster: needed to cost tensor parallelism on custom hardware (a preset"
                         f" name: {', '.join(CLUSTERS)}, or fields)")
    if cluster is not None and tp > cluster.gpus_per_node:
        raise ValueError(f"parallel.tp: {tp} exceeds cluster.gpus_per_node ({cluster.gpus_per_node});"
                         " tensor parallel collectives run every layer and need NVLink")
    if cp > 1 and m.seq_len % (2 * cp):
        raise ValueError(f"parallel.cp: 2 x {cp} does not divide model.seq_len ({m.seq_len}); ring"
                         " attention splits the sequence into 2 x cp load-balanced chunks")
    if par.gpus is not None and par.dp is None and par.gpus % (tp * cp * pp):
        raise ValueError(f"parallel.gpus: {par.gpus} is not a multiple of tp x cp x pp ="
                         f" {tp} x {cp} x {pp} = {tp * cp * pp} (pp is training.devices)")
    dp = par.dp_of(pp)
    if par.gpus is not None and tp * cp * pp * dp != par.gpus:
        raise ValueError(f"parallel.gpus: {par.gpus} but tp x cp x pp x dp = {tp} x {cp} x {pp} x {dp}"
                         f" = {tp * cp * pp * dp} (pp is training.devices)")
    if m.experts is None:
        if ep > 1 or par.etp not in (None, tp):
            raise ValueError("parallel.ep: expert parallelism needs a MoE model (model.experts)")
        return
    if m.experts % ep:
        raise ValueError(f"parallel.ep: {ep} does not divide model.experts ({m.experts})")
    if (tp * cp * dp) % (ep * par.expert_tp):
        raise ValueError(f"parallel.ep: ep x etp = {ep} x {par.expert_tp} does not divide the GPUs of a"
                         f" stage, tp x cp x dp = {tp * cp * dp} (experts fold onto them)")


def _preset(value: Any, presets: dict[str, BaseModel]) -> Any:
    """A preset name, or a dict with an optional `preset` whose fields it overrides."""
    if isinstance(value, str):
        if value not in presets:
            raise ValueError(f"unknown preset {value!r}; presets: {', '.join(presets)}")
        return presets[value]
    if isinstance(value, dict) and "preset" in value:
        name = value["preset"]
        if name not in presets:
            raise ValueError(f"preset: unknown {name!r}; presets: {', '.join(presets)}")
        rest = {k: v for k, v in value.items() if k != "preset"}
        return {**presets[name].model_dump(), **rest}
    return value


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
    blocks = hf.block_count(doc["hf_config"]) if "hf_config" in doc else 0
    if blocks > limits.max_layers:
        raise ValueError(f"hf_config.num_hidden_layers: {blocks} layers exceed the limit {limits.max_layers}")
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
    "CLUSTERS",
    "HARDWARE",
    "Cluster",
    "Hardware",
    "LayerGroup",
    "ModelSpec",
    "Parallel",
    "Spec",
    "Training",
    "check_spec_size",
    "is_problem_document",
    "spec_from_document",
    "spec_layer_count",
]
