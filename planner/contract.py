"""Problem v1 and plan v1 documents (docs/formats.md), their validation and the canonical key.

Everything that crosses a process boundary is one of these two models. Validation names the field and
the reason; normalization fills the contract's defaults so that the canonical key is the same however
a client spelled the problem.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

PROBLEM_FORMAT = "pipeplan.problem/v1"
PLAN_FORMAT = "pipeplan.plan/v1"


class Limits(BaseModel):
    """Size limits on accepted problems; the service overrides them from its settings.

    They bound the work one request can cause (ops to solve, JSON to store), not the physics.
    """

    model_config = ConfigDict(frozen=True)

    max_devices: int = 256
    max_microbatches: int = 4096
    # Megatron allows as many virtual stages as a device has layers; published runs use up to 24
    max_stages_per_device: int = 64
    # 4 x stages x microbatches: P=64 M=512, P=32 M=1024, P=256 M=128. The size the service answers a
    # cold POST for within about 3 s on 2 cores (README, results); a first plan's time grows linearly
    # with the ops, so raise it (PIPEPLAN_LIMITS__MAX_OPS) on machines that can afford it.
    max_ops: int = 131_072
    max_duration_ms: float = 1e7
    max_memory_mib: float = 1e9
    # model specs: checked on the raw document before conversion (spec.check_spec_size), so a
    # 400-byte spec cannot ask for ten million layers; "auto" partition searches are capped apart
    # because each candidate costs a heuristic run over all ops
    max_layers: int = 4096
    max_auto_ops: int = 16_384


DEFAULT_LIMITS = Limits()


class Options(BaseModel):
    """Which schedule freedoms the problem allows (docs/formats.md: problem)."""

    model_config = ConfigDict(extra="forbid")

    split_backward: bool = True
    offload: bool = False
    recompute: bool = False


def _finite_non_negative(value: float, info: ValidationInfo) -> float:
    if value is None:
        return value
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{info.field_name} must be a finite number, got {value}")
    if value < 0:
        raise ValueError(f"{info.field_name} must be >= 0, got {value}")
    return float(value)


class Stage(BaseModel):
    """One pipeline stage: its device and its per-microbatch costs."""

    model_config = ConfigDict(extra="forbid")

    device: int = Field(ge=0)
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    recompute_ms: float | None = None
    offload_ms: float | None = None
    reload_ms: float | None = None
    activation_mib: float
    weight_grad_mib: float = 0.0
    offloadable_mib: float | None = None
    checkpoint_mib: float = 0.0
    output_grad_mib: float | None = Field(
        default=None, description="What B allocates and keeps until W's end beside the activation: the"
        " gradients of the weight-consuming ops' outputs, which W multiplies by their inputs (torch's split"
        " backward keeps them; None = 0, as Zero Bubble's model counts). Not part of the activation.")
    reduce_ms: float | None = Field(
        default=None, description="Data-parallel gradient reduction of the stage once its last weight"
        " gradient is done, on its device's reduce lane (None = 0: no data parallelism).")

    _finite = field_validator(
        "forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms", "offload_ms",
        "reload_ms", "activation_mib", "weight_grad_mib", "offloadable_mib", "checkpoint_mib",
        "output_grad_mib", "reduce_ms",
    )(_finite_non_negative)

    @field_validator("forward_ms", "backward_input_ms")
    @classmethod
    def _positive(cls, value: float, info: ValidationInfo) -> float:
        if value <= 0:
            raise ValueError(f"{info.field_name} must be > 0, got {value}")
        return value

    @model_validator(mode="after")
    def _fill_and_check(self) -> Stage:
        if self.recompute_ms is None:
            self.recompute_ms = self.forward_ms
        if self.offload_ms is None:
            if self.reload_ms is not None:
                raise ValueError("reload_ms is given but offload_ms is missing")
            self.offload_ms = 0.0
        if self.reload_ms is None:
            self.reload_ms = self.offload_ms
        if self.offloadable_mib is None:
            self.offloadable_mib = self.activation_mib
        for name in ("offloadable_mib", "weight_grad_mib", "checkpoint_mib"):
            if getattr(self, name) > self.activation_mib:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) exceeds activation_mib ({self.activation_mib}):"
                    " it is a part of the activation"
                )
        return self


class Device(BaseModel):
    """Memory of one device: its limit (None = unlimited) and what weights/optimizer state hold.

    `host_memory_limit_mib` caps the pinned host memory the device's offloads may hold at once
    (None = unlimited): pinned pages are a scarce host resource shared by every rank of a node.
    `optimizer_ms` is the optimizer step that follows the device's last gradient reduction (None = 0).
    """

    model_config = ConfigDict(extra="forbid")

    memory_limit_mib: float | None = None
    static_mib: float = 0.0
    host_memory_limit_mib: float | None = None
    optimizer_ms: float | None = None

    _finite = field_validator("memory_limit_mib", "static_mib", "host_memory_limit_mib",
                              "optimizer_ms")(_finite_non_negative)


class Workload(BaseModel):
    """What one iteration computes and on how many GPUs: turns its time into throughput.

    `model_flops` counts the model's F + B + W work of the whole iteration on all GPUs, a causal
    attention's scores counted half (recomputation not counted); `peak_tflops` is one GPU's dense
    16-bit peak, the scale MFU is quoted on (FP8 runs included)."""

    model_config = ConfigDict(extra="forbid")

    tokens: float = Field(gt=0, description="tokens per iteration, all data-parallel replicas")
    gpus: int = Field(ge=1, description="GPUs the iteration runs on")
    model_flops: float = Field(gt=0, description="model FLOPs per iteration, all GPUs")
    peak_tflops: float = Field(gt=0, description="one GPU's dense 16-bit peak, TFLOP/s")

    _finite = field_validator("tokens", "model_flops", "peak_tflops")(_finite_non_negative)


MAX_METADATA_DEPTH = 32


def _text_error(text: str) -> str | None:
    """Why `text` cannot be stored as text (PostgreSQL holds no NUL; UTF-8 no lone surrogate), or None."""
    if "\x00" in text:
        return "must not contain a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone UTF-16 surrogate; text must be valid Unicode"
    return None


def check_metadata(value: Any) -> None:
    """Free-form metadata is part of a key and stored as JSON: bounded nesting (serializers and
    databases have depth limits), finite numbers (JSON has no NaN or Infinity: stored, they come back
    as null) and text every database can hold. Raises ValueError naming the path."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels")
        if isinstance(item, str) and (why := _text_error(item)):
            raise ValueError(f"{path or 'value'}: {why}")
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{path or 'value'}: must be a finite number, got {item}")
        if isinstance(item, dict):
            for k, v in item.items():
                if why := _text_error(str(k)):
                    raise ValueError(f"{path or 'key'} {str(k)[:40]!a}: {why}")
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item))


class Problem(BaseModel):
    """A pipeline schedule problem (`pipeplan.problem/v1`)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["pipeplan.problem/v1"] = PROBLEM_FORMAT
    num_devices: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    p2p_ms: float = 0.0
    options: Options = Field(default_factory=Options)
    stages: list[Stage] = Field(min_length=1)
    devices: list[Device]
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="Free-form provenance (model, partition layer ranges); part of the key.",
    )
    workload: Workload | None = Field(
        default=None, description="Tokens, GPUs and FLOPs of one iteration (None: not a whole job).")

    _finite = field_validator("p2p_ms")(_finite_non_negative)

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_metadata(value)
        return value

    @model_validator(mode="after")
    def _check_shape(self) -> Problem:
        if len(self.devices) != self.num_devices:
            raise ValueError(
                f"devices has {len(self.devices)} entries but num_devices is {self.num_devices}"
            )
        counts = [0] * self.num_devices
        for k, stage in enumerate(self.stages):
            if stage.device >= self.num_devices:
                raise ValueError(
                    f"stages[{k}].device is {stage.device} but there are only {self.num_devices}"
                    f" devices (0..{self.num_devices - 1})"
                )
            counts[stage.device] += 1
        for d, count in enumerate(counts):
            if count == 0:
                raise ValueError(f"device {d} holds no stage: every device needs at least one")
        if len(set(counts)) != 1:
            raise ValueError(
                "every device must hold the same number of stages (len(stages) = num_devices x"
                f" chunks); stages per device are {counts}"
            )
        if self.options.offload and all(s.offload_ms == 0 and s.reload_ms == 0 for s in self.stages):
            raise ValueError("options.offload is true but no stage gives offload_ms")
        return self

    # -- derived facts used everywhere ---------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def chunks(self) -> int:
        return len(self.stages) // self.num_devices

    def stages_of(self, device: int) -> list[int]:
        return [k for k, s in enumerate(self.stages) if s.device == device]

    def work_ms(self, device: int) -> float:
        """Compute time of one microbatch on `device`: F + B + W of each of its stages."""
        return sum(s.forward_ms + s.backward_input_ms + s.backward_weight_ms
                   for s in self.stages if s.device == device)

    def link_ms(self, from_stage: int, to_stage: int) -> float:
        """Transfer time between two stages: p2p_ms across devices, nothing on one device."""
        same = self.stages[from_stage].device == self.stages[to_stage].device
        return 0.0 if same else self.p2p_ms

    def limit_of(self, device: int) -> float:
        limit = self.devices[device].memory_limit_mib
        return math.inf if limit is None else limit

    def free_mib(self, device: int) -> float:
        """Memory left on `device` for activations once its static memory is in (inf = unlimited)."""
        return self.limit_of(device) - self.devices[device].static_mib

    def limited_devices(self) -> list[int]:
        """The devices with a memory limit (the memory-aware bounds and fit checks look only there)."""
        return [d for d in range(self.num_devices) if math.isfinite(self.limit_of(d))]

    def reduce_of(self, stage: int) -> float:
        """The stage's gradient reduction time (0 without data parallelism)."""
        return self.stages[stage].reduce_ms or 0.0

    def output_grad_of(self, stage: int) -> float:
        """What the stage's B allocates and holds until its W ends (0 when the problem gives none)."""
        return self.stages[stage].output_grad_mib or 0.0

    def optimizer_of(self, device: int) -> float:
        """The device's optimizer step time (0 when the problem gives none)."""
        return self.devices[device].optimizer_ms or 0.0

    def host_limit_of(self, device: int) -> float:
        """Pinned host memory `device`'s offloads may hold at once (inf = unlimited)."""
        limit = self.devices[device].host_memory_limit_mib
        return math.inf if limit is None else limit

    def check_limits(self, limits: Limits = DEFAULT_LIMITS) -> None:
        """Raise ValueError naming the field when the problem exceeds the configured sizes."""
        checks = [
            ("num_devices", self.num_devices, limits.max_devices),
            ("num_microbatches", self.num_microbatches, limits.max_microbatches),
            ("stages", self.chunks, limits.max_stages_per_device),
        ]
        for name, value, cap in checks:
            if value > cap:
                raise ValueError(f"{name}: {value} exceeds the limit {cap}")
        if self.p2p_ms > limits.max_duration_ms:
            raise ValueError(f"p2p_ms: {self.p2p_ms} exceeds the limit {limits.max_duration_ms}")
        ops = 4 * self.num_stages * self.num_microbatches
        if ops > limits.max_ops:
            raise ValueError(f"stages x num_microbatches: up to {ops} ops exceeds the limit {limits.max_ops}")
        for k, s in enumerate(self.stages):
            for name in ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms",
                         "offload_ms", "reload_ms", "reduce_ms"):
                if (getattr(s, name) or 0.0) > limits.max_duration_ms:
                    raise ValueError(f"stages[{k}].{name} exceeds the limit {limits.max_duration_ms}")
        for d, dev in enumerate(self.devices):
            for name in ("memory_limit_mib", "static_mib", "host_memory_limit_mib"):
                value = getattr(dev, name)
                if value is not None and value > limits.max_memory_mib:
                    raise ValueError(f"devices[{d}].{name} exceeds the limit {limits.max_memory_mib}")
            if (dev.optimizer_ms or 0.0) > limits.max_duration_ms:
                raise ValueError(f"devices[{d}].optimizer_ms exceeds the limit {limits.max_duration_ms}")

    def canonical_json(self) -> str:
        """Canonical form (docs/formats.md, "The key"): defaults filled, every number a float, sorted, compact.

        Fields added after v1 appear only when set (see _drop_unset_additions)."""
        doc = _drop_unset_additions(self.model_dump(mode="json"))
        return json.dumps(_floats(doc), sort_keys=True, separators=(",", ":"))

    def key(self) -> str:
        """SHA-256 hex of the canonical JSON: the cache key of this configuration."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


ADDED_DEVICE_FIELDS = ("host_memory_limit_mib", "optimizer_ms")
ADDED_STAGE_FIELDS = ("reduce_ms", "output_grad_mib")
ADDED_PROBLEM_FIELDS = ("workload",)


def _drop_unset_additions(doc: dict[str, Any]) -> dict[str, Any]:
    """Leave fields added after v1 out of the canonical form while they are unset (null).

    Cached plans are keyed by Problem.key(): a problem that does not use a new field must keep the key
    it had before the field existed, or every stored plan would be orphaned.
    """
    for items, names in ((doc.get("devices", []), ADDED_DEVICE_FIELDS),
                         (doc.get("stages", []), ADDED_STAGE_FIELDS), ([doc], ADDED_PROBLEM_FIELDS)):
        for item in items:
            for name in names:
                if item.get(name) is None:
                    item.pop(name, None)
    return doc


def _floats(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


OpKindName = Literal["F", "B", "W", "BW", "OFFLOAD", "RELOAD", "RECOMPUTE"]


class PlanOp(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: OpKindName
    stage: int = Field(ge=0)
    mb: int = Field(ge=0)
    start_ms: float
    end_ms: float


class DevicePlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: int = Field(ge=0)
    ops: list[PlanOp]


class Plan(BaseModel):
    """A timed schedule (`pipeplan.plan/v1`)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["pipeplan.plan/v1"] = PLAN_FORMAT
    problem_key: str
    revision: int = Field(default=1, ge=1)
    status: Literal["feasible", "optimal"] = "feasible"
    makespan_ms: float
    lower_bound_ms: float
    bubble_ratio: float
    peak_memory_mib: list[float]
    method: str
    devices: list[DevicePlan]
    solver_bound_ms: float | None = Field(
        default=None, description="The solver's own proven bound, when a solver produced the plan."
    )
    # Transfer costs (docs/transfers.md). None = not reported (plans stored before these existed).
    offloaded_mib: float | None = Field(
        default=None, description="Device-to-host MiB per iteration: offloadable_mib summed over offloads."
    )
    recompute_ms: float | None = Field(default=None, description="Compute time spent on RECOMPUTE ops.")
    host_memory_mib: list[float] | None = Field(
        default=None,
        description="Per device: peak pinned host memory, each offload held from its OFFLOAD's start"
                    " to its RELOAD's end.",
    )
    # The whole iteration (planner/iteration.py). None = not reported (plans stored before these).
    iteration_ms: float | None = Field(
        default=None, description="The pipeline plus what follows it: each stage's gradient reduction"
        " after its last weight gradient, then each device's optimizer step.")
    iteration_bound_ms: float | None = Field(
        default=None, description="A proven lower bound of iteration_ms: lower_bound_ms plus the least"
        " time any plan's iteration lasts beyond its makespan (planner.iteration.tail_floor).")
    tokens_per_s_per_gpu: float | None = Field(
        default=None, description="Workload tokens per second of iteration_ms, per GPU.")
    mfu: float | None = Field(
        default=None, description="Model FLOPs per second of iteration_ms over the GPUs' 16-bit peak.")

    @property
    def end_ms(self) -> float:
        """When the iteration ends: `iteration_ms` when something follows the pipeline (gradient
        reductions, optimizer steps), else the makespan."""
        return self.iteration_ms if self.iteration_ms is not None else self.makespan_ms

    @property
    def gap(self) -> float:
        """Relative distance to the best known lower bound (0 = proven optimal)."""
        bound = max(self.lower_bound_ms, self.solver_bound_ms or 0.0)
        return 0.0 if self.makespan_ms <= 0 else max(0.0, self.makespan_ms - bound) / self.makespan_ms


def error_messages(exc: Exception) -> list[str]:
    """Readable 'field: reason' lines for a pydantic ValidationError (or any other error)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return [str(exc)]
    lines = []
    for err in errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "problem"
        msg = err.get("msg", "").removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return lines
