"""The configurations a job may run in: every valid parallel layout, microbatching and placement.

Why a module: the search (planner.configure) ranks layouts; which layouts exist is a question of
divisibility alone (heads, experts, layers, GPUs, the global batch), answered here without costing
anything. A `Layout` becomes a spec with `spec_of`: the request's spec keeps its model, hardware,
cluster links and framework settings (overlaps, optimizer, gradient dtype, recompute policy); only
the degrees, the microbatching, the placement, the partition and the precision are replaced.

Rules (Megatron-LM's, where it has one; decided here where the issue is silent):
* TP divides the attention heads and the key/value heads (whole groups), and fits in a node;
* CP: 2 x cp divides the sequence (load-balanced ring chunks), at most `max_cp`;
* PP divides the GPUs left by tp x cp and is at most the number of blocks;
* DP is the rest; the global batch splits into dp x micro-batch-size x microbatches exactly;
* EP (MoE models) divides the experts and tp x cp x dp (experts fold onto a stage's GPUs, expert
  TP 1, as every published MoE recipe here runs); a dense model has ep 1;
* interleaving (loop placement, vp > 1 stages per device) needs the blocks -- or the blocks plus
  embedding and head, Megatron's account-for-embedding/loss split -- to divide evenly over pp x vp
  stages, as Megatron requires; V placement has 2 stages per device (ZB-V);
* partition: "balanced" (by F+B+W time) always, and the spec's own partition where it applies (a
  strategy name, or a list of layers per stage of the right length), so a user's -- or a published
  run's -- exact layout is in the space.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .spec import PRECISION, Spec

BLOCK_TYPES = ("dense", "moe", "mamba", "attention", "mlp")
PLACEMENTS = ("loop", "v")


class ConfigureRequest(BaseModel):
    """What a configuration search is asked: the cluster, the batch, and optional constraints."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(ge=1, le=65536, description="GPUs the job runs on")
    gpus_per_node: int | None = Field(default=None, ge=1, description="default: the spec's cluster")
    global_batch: int = Field(ge=1, le=10_000_000, description="sequences per iteration")
    seq_len: int | None = Field(default=None, ge=1, description="tokens per sequence; default: the spec's")
    max_tp: int | None = Field(default=None, ge=1)
    max_cp: int = Field(default=8, ge=1, description="largest context-parallel degree tried")
    max_ep: int | None = Field(default=None, ge=1)
    pp: int | None = Field(default=None, ge=1, description="fix the pipeline-parallel degree")
    max_vp: int = Field(default=32, ge=1, description="most stages per device tried with loop placement")
    micro_batch_sizes: list[int] = Field(default=[1, 2, 4], min_length=1, max_length=16, description="sizes tried")
    precisions: list[PRECISION] | None = Field(default=None, min_length=1, description="default: the spec's")
    placements: list[str] = Field(default=list(PLACEMENTS), min_length=1)
    offload: bool | None = Field(default=None, description="schedules may offload; default: the spec's")
    recompute: bool | None = Field(default=None, description="schedules may recompute; default: the spec's")
    memory_headroom_gib: float = Field(default=0.0, ge=0, description="kept free on every GPU")
    top: int = Field(default=10, ge=1, le=1000, description="candidates reported, best first")

    @model_validator(mode="after")
    def _check(self) -> ConfigureRequest:
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad:
            raise ValueError(f"placements: unknown {bad}; use {' or '.join(PLACEMENTS)}")
        if any(not 1 <= b <= 4096 for b in self.micro_batch_sizes):
            raise ValueError("micro_batch_sizes: sizes must be between 1 and 4096")
        return self


@dataclass(frozen=True, order=True)
class Layout:
    """One configuration. Field order is the stated tie-break: equal throughput and memory rank by
    this tuple (less TP, CP, EP, PP first: the simpler layout)."""

    tp: int
    cp: int
    ep: int
    pp: int
    dp: int
    vp: int  # stages per device
    placement: str
    mbs: int
    microbatches: int
    precision: str
    partition: str  # "balanced", "uniform", or "spec" (the spec's own list)

    @property
    def name(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        parts += [f"{k}{v}" for k, v in (("CP", self.cp), ("EP", self.ep)) if v > 1]
        parts.append("V" if self.placement == "v" else (f"VP{self.vp}" if self.vp > 1 else "1F1B-loop"))
        parts += [f"MBS{self.mbs}", f"M{self.microbatches}", self.precision.upper()]
        if self.partition != "balanced":
            parts.append(f"part={self.partition}")
        return " ".join(parts)

    @property
    def family(self) -> str:
        """The degrees without microbatching, placement or partition: what rejected layouts are
        grouped by when the search says why they lost."""
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + [f"{k}{v}" for k, v in (("CP", self.cp), ("EP", self.ep)) if v > 1]
        return " ".join(parts)

    @property
    def stages(self) -> int:
        return self.pp * self.vp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def blocks_of(spec: Spec) -> int:
    return sum(1 for g in spec.model.layer_groups() if g.type in BLOCK_TYPES)


def _chunk_options(pp: int, blocks: int, layers: int, max_vp: int, placements: list[str]) -> list[tuple[str, int]]:
    if pp == 1:
        return [("loop", 1)] if "loop" in placements or "v" in placements else []
    out: list[tuple[str, int]] = []
    if "loop" in placements:
        out.append(("loop", 1))
        out += [("loop", v) for v in range(2, max_vp + 1)
                if pp * v <= layers and (blocks % (pp * v) == 0 or (blocks + 2) % (pp * v) == 0)]
    if "v" in placements and 2 * pp <= layers:
        out.append(("v", 2))
    return out


def _partitions(spec: Spec, stages: int) -> list[str]:
    own = spec.partition
    if isinstance(own, list):
        return ["balanced", "spec"] if len(own) == stages else ["balanced"]
    return ["balanced"] if own in ("balanced", "auto") else ["balanced", own]


def enumerate_layouts(spec: Spec, request: ConfigureRequest, gpus_per_node: int) -> Iterator[Layout]:
    """Every valid layout of `spec` for `request`, in a fixed order (the same input, the same list)."""
    m = spec.model
    seq = request.seq_len or m.seq_len
    kv = m.kv_heads or m.heads
    blocks, layers = blocks_of(spec), len(m.layer_groups())
    precisions = request.precisions or [spec.precision or "bf16"]
    for tp in _divisors(gpus_per_node):
        if (request.gpus % tp or m.heads % tp or (not m.mla and kv % tp)
                or (request.max_tp is not None and tp > request.max_tp)):
            continue
        for cp in _divisors(request.gpus // tp):
            if cp > request.max_cp or (cp > 1 and seq % (2 * cp)):
                continue
            for pp in _divisors(request.gpus // (tp * cp)):
                if pp > blocks or (request.pp is not None and pp != request.pp):
                    continue
                dp = request.gpus // (tp * cp * pp)
                for ep in _expert_degrees(spec, tp * cp * dp, request.max_ep):
                    for mbs in sorted(set(request.micro_batch_sizes)):
                        if request.global_batch % (dp * mbs):
                            continue
                        microbatches = request.global_batch // (dp * mbs)
                        for placement, vp in _chunk_options(pp, blocks, layers, request.max_vp, request.placements):
                            for partition in _partitions(spec, pp * vp):
                                for precision in precisions:
                                    yield Layout(tp, cp, ep, pp, dp, vp, placement, mbs, microbatches,
                                                 precision, partition)


def _expert_degrees(spec: Spec, stage_gpus: int, max_ep: int | None) -> list[int]:
    experts = spec.model.experts
    if experts is None:
        return [1]
    return [ep for ep in _divisors(experts) if stage_gpus % ep == 0 and (max_ep is None or ep <= max_ep)]


def nearest_batches(request: ConfigureRequest, spec: Spec, gpus_per_node: int) -> list[int]:
    """The global batches nearest to the request's (below and above) that some layout accepts: the
    multiples of dp x micro-batch size over the layouts the structure allows (found once, with a
    batch every dp and size divide)."""
    every = request.gpus * math.lcm(*request.micro_batch_sizes)
    trial = request.model_copy(update={"global_batch": every})
    steps = {lay.dp * lay.mbs for lay in enumerate_layouts(spec, trial, gpus_per_node)}
    gbs = request.global_batch
    below = max((gbs // d * d for d in steps if gbs // d > 0), default=None)
    above = min(((gbs // d + 1) * d for d in steps), default=None)
    return [g for g in (below, above) if g is not None and g != gbs]


def spec_of(spec: Spec, layout: Layout, request: ConfigureRequest, cluster: dict[str, Any]) -> dict[str, Any]:
    """The spec document of `layout`: the request's spec with the layout's fields replaced."""
    doc = spec.model_dump(mode="json", exclude_none=True)
    doc["model"]["micro_batch_size"] = layout.mbs
    if request.seq_len:
        doc["model"]["seq_len"] = request.seq_len
    par = {k: v for k, v in doc.get("parallel", {}).items() if k not in ("tp", "cp", "ep", "etp", "dp", "gpus")}
    par.update(tp=layout.tp, cp=layout.cp, ep=layout.ep, gpus=request.gpus)
    if layout.ep > 1:
        par["etp"] = 1
    doc["parallel"] = par
    doc["cluster"] = cluster
    doc["precision"] = layout.precision
    t = doc["training"]
    t.update(devices=layout.pp, microbatches=layout.microbatches, placement=layout.placement, chunks=layout.vp)
    if isinstance(t.get("memory_budget_gib"), list):  # one per device: meaningless for another pp
        t.pop("memory_budget_gib")
    t["reserved_gib"] = t.get("reserved_gib", 0.0) + request.memory_headroom_gib
    t.pop("dp_shards", None)
    if request.offload is not None:
        t["offload"] = request.offload
    if request.recompute is not None:
        t["recompute"] = request.recompute
    doc["partition"] = spec.partition if layout.partition == "spec" else layout.partition
    return doc
