"""Run a pipeplan plan in `torch.distributed.pipelining` (needs the `torch` extra).

The compute order goes through torch's own loader: `planner.exports.torch_csv` ->
`_PipelineScheduleRuntime._load_csv(path, "compute_only")`, which lowers it to send/recv actions and
infers stage -> rank from the CSV (so V and interleaved placements need no rank map).

torch has no OFFLOAD, RELOAD or RECOMPUTE action, so `PlanExecutor` carries them out around the
runtime's compute actions, at the places the plan puts them on this rank:

- OFFLOAD(k, i): F(k, i) runs under saved-tensor hooks that hand autograd a handle instead of each
  activation it saves (parameters and stage inputs, which stay resident anyway, are not touched);
  right after F the handles copy their tensors to host memory and drop the device copies.
- RELOAD(k, i): issued before the compute op that was running when the plan starts the reload (as
  `planner.simulator.schedule_from_plan` gates it), copying the tensors back before B(k, i) needs them.
- RECOMPUTE(k, i): F(k, i) keeps only the stage's inputs (the checkpoint); every activation autograd
  would save is dropped. At the RECOMPUTE's place in the compute order the stage's forward is re-run
  on the same inputs with the same RNG state, and the activations it saves are given to autograd in
  the same order (the mechanism of torch's non-reentrant checkpoint, but run where the plan says and
  kept until W, which torch's split backward needs after I).

Should the runtime need an activation before its planned reload/recompute ran (a plan/runtime
mismatch), it is reloaded/recomputed on demand and counted in `stats.late`, so training stays correct
and the mismatch is visible.

On CPU the host copies are real copies, so the mechanism and its correctness are the same as on GPU;
on CUDA the host buffers are pinned. Copies are synchronous (the lanes of the plan are not overlapped
with compute here).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

from planner.contract import Plan, Problem
from planner.exports import torch_csv
from planner.ops import Kind

TORCH_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)


def parse_torch_csv(csv_text: str, num_ranks: int, num_stages: int, n_microbatches: int
                    ) -> tuple[dict[int, list[_Action]], dict[int, list[_Action]], dict[int, int]]:
    """Load a schedule CSV with torch's own `_load_csv`, without a process group or stages.

    Returns (compute-only order, order lowered with send/recv, stage -> rank). Raises whatever torch
    raises for a malformed schedule, so a CSV that passes here is one the runtime accepts.
    """
    runtime = _PipelineScheduleRuntime.__new__(_PipelineScheduleRuntime)
    runtime.pipeline_order = {}
    runtime.pp_group_size = num_ranks
    runtime._num_stages = num_stages
    runtime._n_microbatches = n_microbatches
    runtime._stages = []
    runtime._defer_pp_recv = False
    _load_csv_text(runtime, csv_text)
    return runtime.pipeline_order, runtime.pipeline_order_with_comms, runtime.stage_index_to_group_rank


def _load_csv_text(runtime: _PipelineScheduleRuntime, csv_text: str) -> None:
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(csv_text)
        runtime._load_csv(path, format="compute_only")
    finally:
        os.unlink(path)


# -- per-(stage, microbatch) saved state ------------------------------------------------------------
class _Offloaded:
    """A saved activation that can live on the device or on the host."""

    __slots__ = ("dev", "device", "host")

    def __init__(self, tensor: torch.Tensor):
        self.dev: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.device = tensor.device

    def to_host(self) -> int:
        if self.dev is None:
            return 0
        pin = self.dev.is_cuda
        self.host = torch.empty(self.dev.size(), dtype=self.dev.dtype, layout=self.dev.layout,
                                device="cpu", pin_memory=pin).copy_(self.dev)
        nbytes = self.dev.numel() * self.dev.element_size()
        self.dev = None
        return nbytes

    def to_device(self) -> None:
        if self.dev is None and self.host is not None:
            self.dev = self.host.to(self.device, copy=True)
            self.host = None


@dataclass
class _Record:
    mode: str  # "offload" | "recompute"
    handles: dict[int, _Offloaded] = field(default_factory=dict)  # offload: id(tensor) -> handle
    inputs: tuple[tuple, dict] | None = None  # recompute: the stage's forward inputs (the checkpoint)
    rng: Any = None
    packed: int = 0  # recompute: how many tensors autograd asked to save
    saved: list[torch.Tensor] | None = None  # recompute: the recomputed activations, in pack order
    offloaded: bool = False
    reloaded: bool = False


@dataclass
class ExecutorStats:
    """What the executor did, for tests and logs (bytes are per (stage, mb))."""

    offloaded_bytes: dict[tuple[int, int], int] = field(default_factory=Counter)
    freed_bytes: dict[tuple[int, int], int] = field(default_factory=Counter)
    reloads: set[tuple[int, int]] = field(default_factory=set)
    recomputes: set[tuple[int, int]] = field(default_factory=set)
    late: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # executed ops in order, e.g. "F(0,3)", "OFFLOAD(0,3)"

    def reset(self) -> None:
        self.offloaded_bytes.clear()
        self.freed_bytes.clear()
        self.reloads.clear()
        self.recomputes.clear()
        self.late.clear()
        self.log.clear()


def side_op_positions(plan: Plan, rank: int) -> tuple[list[tuple[Kind, int, int]],
                                                        dict[tuple, list[tuple[Kind, int, int]]],
                                                        dict[tuple, list[tuple[Kind, int, int]]]]:
    """This rank's torch-visible compute ops in order, and the side ops to run before/after each.

    OFFLOAD goes right after its F; RECOMPUTE before the next torch compute op after it in the
    compute order; RELOAD before the compute op running when the plan starts it (after the F's
    offload when that op is the F itself).
    """
    dp = next(d for d in plan.devices if d.device == rank)
    ops = sorted(dp.ops, key=lambda p: p.start_ms)
    compute = [p for p in ops if Kind(p.kind) in TORCH_KINDS or p.kind == Kind.RECOMPUTE.value]
    torch_ops = [(Kind(p.kind), p.stage, p.mb) for p in compute if Kind(p.kind) in TORCH_KINDS]
    before: dict[tuple, list] = defaultdict(list)
    after: dict[tuple, list] = defaultdict(list)

    def next_torch_op(index: int) -> tuple[Kind, int, int]:
        for p in compute[index:]:
            if Kind(p.kind) in TORCH_KINDS:
                return (Kind(p.kind), p.stage, p.mb)
        raise ValueError(f"rank {rank}: a RECOMPUTE is planned after the last compute op")

    timed_before: dict[tuple, list[tuple[float, tuple]]] = defaultdict(list)
    for index, p in enumerate(compute):
        if p.kind == Kind.RECOMPUTE.value:
            timed_before[next_torch_op(index)].append((p.start_ms, (Kind.RECOMPUTE, p.stage, p.mb)))
    for p in ops:
        if p.kind == Kind.OFFLOAD.value:
            after[(Kind.F, p.stage, p.mb)].append((Kind.OFFLOAD, p.stage, p.mb))
    for p in ops:
        if p.kind != Kind.RELOAD.value:
            continue
        started = [i for i, c in enumerate(compute) if c.start_ms <= p.start_ms + 1e-9]
        anchor_index = started[-1] if started else 0
        anchor = compute[anchor_index]
        op = (Kind.RELOAD, p.stage, p.mb)
        if (anchor.kind, anchor.stage, anchor.mb) == (Kind.F.value, p.stage, p.mb):
            after[(Kind.F, p.stage, p.mb)].append(op)
        else:  # before the running op (or, for a RECOMPUTE, the torch op it precedes)
            timed_before[next_torch_op(anchor_index)].append((p.start_ms, op))
    for target, entries in timed_before.items():
        before[target] = [op for _, op in sorted(entries, key=lambda e: e[0])]
    return torch_ops, before, after


class PlanExecutor:
    """Carries out one rank's OFFLOAD/RELOAD/RECOMPUTE around torch's compute actions."""

    def __init__(self, stages: list, rank: int):
        self.rank = rank
        self.stages = {s.stage_index: s for s in stages}
        self.stats = ExecutorStats()
        self._records: dict[tuple[int, int], _Record] = {}
        self._recording: _Record | None = None
        self._offload: set[tuple[int, int]] = set()
        self._recompute: set[tuple[int, int]] = set()
        self._before: dict[tuple, list] = {}
        self._after: dict[tuple, list] = {}
        for stage in stages:
            self._wrap(stage)

    # -- plan ----------------------------------------------------------------------------------------
    def load(self, plan: Plan) -> None:
        """Adopt a plan's memory actions for this rank (between iterations only)."""
        if self._records:
            raise RuntimeError(f"rank {self.rank}: cannot change plans mid-iteration"
                               f" ({len(self._records)} activations still held)")
        _, self._before, self._after = side_op_positions(plan, self.rank)
        mine = {k for k in self.stages}
        dp = next(d for d in plan.devices if d.device == self.rank)
        self._offload = {(p.stage, p.mb) for p in dp.ops if p.kind == Kind.OFFLOAD.value and p.stage in mine}
        self._recompute = {(p.stage, p.mb) for p in dp.ops if p.kind == Kind.RECOMPUTE.value
                           and p.stage in mine}

    # -- wrapping torch's stage methods --------------------------------------------------------------
    def _wrap(self, stage) -> None:
        if getattr(stage, "_pipeplan_executor", None) is not None:
            raise RuntimeError(f"stage {stage.stage_index} already runs a plan; change plans with"
                               " PlannedSchedule.swap() instead of building a second schedule on it")
        stage._pipeplan_executor = self
        k = stage.stage_index
        forward, backward, backward_weight = (stage.forward_one_chunk, stage.backward_one_chunk,
                                              stage.backward_weight_one_chunk)

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any):
            op = (Kind.F, k, fwd_chunk_id)
            self._run(self._before.get(op, ()))
            self.stats.log.append(f"F({k},{fwd_chunk_id})")
            out = self._forward(k, fwd_chunk_id, forward, args, kwargs)
            self._run(self._after.get(op, ()))
            return out

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, full_backward: bool = True, **kwargs: Any):
            kind = Kind.BW if full_backward else Kind.B
            self._run(self._before.get((kind, k, bwd_chunk_id), ()))
            self._ensure_ready(k, bwd_chunk_id, kind)
            self.stats.log.append(f"{kind.value}({k},{bwd_chunk_id})")
            backward(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)
            if full_backward:
                self._records.pop((k, bwd_chunk_id), None)

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any):
            self._run(self._before.get((Kind.W, k, bwd_chunk_id), ()))
            self._ensure_ready(k, bwd_chunk_id, Kind.W)
            self.stats.log.append(f"W({k},{bwd_chunk_id})")
            backward_weight(bwd_chunk_id, *args, **kwargs)
            self._records.pop((k, bwd_chunk_id), None)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        stage.submod.register_forward_pre_hook(self._capture_inputs, with_kwargs=True)

    def _capture_inputs(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._recording is not None and self._recording.mode == "recompute":
            self._recording.inputs = (args, kwargs)
            self._recording.rng = _rng_state(args)

    def _forward(self, k: int, mb: int, forward: Callable, args: tuple, kwargs: dict):
        if (k, mb) in self._offload:
            record = self._records[(k, mb)] = _Record("offload")
            with torch.autograd.graph.saved_tensors_hooks(self._pack_offload(record), _unpack_offload(self, k, mb)):
                return forward(mb, *args, **kwargs)
        if (k, mb) in self._recompute:
            record = self._records[(k, mb)] = _Record("recompute")
            self._recording = record
            try:
                with torch.autograd.graph.saved_tensors_hooks(_pack_index(record), self._unpack_recomputed(k, mb)):
                    return forward(mb, *args, **kwargs)
            finally:
                self._recording = None
        return forward(mb, *args, **kwargs)

    # -- offload ---------------------------------------------------------------------------------------
    @staticmethod
    def _pack_offload(record: _Record) -> Callable[[torch.Tensor], Any]:
        def pack(tensor: torch.Tensor) -> Any:
            if tensor.is_leaf:  # parameters and the stage's inputs stay resident anyway
                return tensor
            handle = record.handles.get(id(tensor))
            if handle is None or handle.dev is not tensor:
                handle = record.handles[id(tensor)] = _Offloaded(tensor)
            return handle
        return pack

    def _offload_now(self, k: int, mb: int) -> None:
        record = self._records[(k, mb)]
        alive = [(weakref.ref(h.dev), h.dev.numel() * h.dev.element_size())
                 for h in record.handles.values() if h.dev is not None]
        self.stats.offloaded_bytes[(k, mb)] += sum(h.to_host() for h in record.handles.values())
        # device memory really released: copies nothing else (e.g. the stage's output) still holds
        self.stats.freed_bytes[(k, mb)] += sum(n for ref, n in alive if ref() is None)
        record.offloaded = True

    def _reload_now(self, k: int, mb: int) -> None:
        record = self._records[(k, mb)]
        for handle in record.handles.values():
            handle.to_device()
        record.reloaded = True
        self.stats.reloads.add((k, mb))

    # -- recompute -------------------------------------------------------------------------------------
    def _unpack_recomputed(self, k: int, mb: int) -> Callable[[Any], torch.Tensor]:
        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            record = self._records.get((k, mb))
            if record is None:
                raise RuntimeError(f"stage {k} mb {mb}: activations were released before their backward")
            if record.saved is None:
                self.stats.late.append(f"RECOMPUTE({k},{mb})")
                self._recompute_now(k, mb)
            return record.saved[packed]
        return unpack

    def _recompute_now(self, k: int, mb: int) -> None:
        record = self._records[(k, mb)]
        if record.inputs is None:
            raise RuntimeError(f"stage {k} mb {mb}: no inputs were captured to recompute from")
        args, kwargs = record.inputs
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> int:
            saved.append(tensor)
            return len(saved) - 1

        with torch.random.fork_rng(devices=_cuda_devices(args)):
            _set_rng_state(record.rng)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda i: saved[i]):
                self.stages[k].submod(*args, **kwargs)
        if len(saved) != record.packed:
            raise RuntimeError(f"stage {k} mb {mb}: the recomputed forward saved {len(saved)} tensors but"
                               f" the original saved {record.packed}; is the stage's forward deterministic?")
        record.saved = saved
        self.stats.recomputes.add((k, mb))

    # -- running the side ops --------------------------------------------------------------------------
    def _run(self, side_ops) -> None:
        for kind, k, mb in side_ops:
            if (k, mb) not in self._records:
                continue  # nothing saved (e.g. the stage has no backward)
            self.stats.log.append(f"{kind.value}({k},{mb})")
            if kind is Kind.OFFLOAD:
                self._offload_now(k, mb)
            elif kind is Kind.RELOAD:
                self._reload_now(k, mb)
            elif kind is Kind.RECOMPUTE:
                self._recompute_now(k, mb)

    def _ensure_ready(self, k: int, mb: int, kind: Kind) -> None:
        record = self._records.get((k, mb))
        if record is None:
            return
        if record.mode == "offload" and record.offloaded and not record.reloaded:
            self.stats.late.append(f"RELOAD({k},{mb}) before {kind.value}")
            self._reload_now(k, mb)
        if record.mode == "recompute" and record.saved is None:
            self.stats.late.append(f"RECOMPUTE({k},{mb}) before {kind.value}")
            self._recompute_now(k, mb)


def _pack_index(record: _Record) -> Callable[[torch.Tensor], Any]:
    def pack(tensor: torch.Tensor) -> Any:
        index = record.packed
        record.packed += 1
        return index
    return pack


def _unpack_offload(executor: PlanExecutor, k: int, mb: int) -> Callable[[Any], torch.Tensor]:
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.dev is None:
            executor.stats.late.append(f"RELOAD({k},{mb}) on demand")
            packed.to_device()
        return packed.dev
    return unpack


def _cuda_devices(args: tuple) -> list[int]:
    return sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})


def _rng_state(args: tuple) -> tuple:
    cuda = {d: torch.cuda.get_rng_state(d) for d in _cuda_devices(args)}
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, s in cuda.items():
        torch.cuda.set_rng_state(s, device)


# -- the public entry points -----------------------------------------------------------------------
@dataclass
class PlannedSchedule:
    """torch's runtime schedule loaded from a plan, plus the executor of its memory actions."""

    schedule: _PipelineScheduleRuntime
    executor: PlanExecutor
    problem: Problem
    plan: Plan

    def step(self, *args: Any, **kwargs: Any):
        return self.schedule.step(*args, **kwargs)

    def swap(self, plan: Plan) -> None:
        """Switch to another plan of the same problem; call at an iteration boundary on EVERY rank."""
        if plan.problem_key != self.plan.problem_key:
            raise ValueError(f"plan is for {plan.problem_key[:12]}…, not {self.plan.problem_key[:12]}…")
        self.executor.load(plan)
        _load_csv_text(self.schedule, torch_csv(self.problem, plan))
        self.plan = plan


def build_schedule(problem: Problem, plan: Plan, stages: list, loss_fn: Callable | None,
                   *, scale_grads: bool = True) -> PlannedSchedule:
    """torch's `_PipelineScheduleRuntime` running `plan` on this rank's `stages`.

    `stages` are this rank's `PipelineStage`s (the plan's stages on device = this rank). The compute
    order is loaded through torch's own `_load_csv`; offload/recompute run through `PlanExecutor`.
    """
    rank = stages[0].group_rank
    expected = set(problem.stages_of(rank))
    have = {s.stage_index for s in stages}
    if have != expected:
        raise ValueError(f"rank {rank} holds stages {sorted(have)} but the plan puts {sorted(expected)} here")
    if stages[0].num_stages != problem.num_stages:
        raise ValueError(f"the model has {stages[0].num_stages} stages; the problem has {problem.num_stages}")
    schedule = _PipelineScheduleRuntime(stages=stages, n_microbatches=problem.num_microbatches,
                                        loss_fn=loss_fn, scale_grads=scale_grads)
    executor = PlanExecutor(stages, rank)
    executor.load(plan)
    _load_csv_text(schedule, torch_csv(problem, plan))
    return PlannedSchedule(schedule, executor, problem, plan)


def agree_on_plan(candidate: Plan | None, src: int = 0, group=None) -> Plan | None:
    """Every rank gets rank `src`'s candidate plan (or None): swaps must happen on all ranks at once."""
    import torch.distributed as dist

    box = [candidate.model_dump_json() if candidate is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return Plan.model_validate_json(box[0]) if box[0] is not None else None
