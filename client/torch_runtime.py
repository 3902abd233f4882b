"""Run a pipeplan plan in `torch.distributed.pipelining` (needs the `torch` extra), as planned.

The compute order goes through torch's own loader: `planner.exports.torch_csv` ->
`_PipelineScheduleRuntime._load_csv(path, "compute_only")`, which lowers it to send/recv actions and
infers stage -> rank from the CSV (so V and interleaved placements need no rank map). Every private
torch name this takes (the loader, the loss bookkeeping, the sends and receives) is reached through
`client.torch_internals`, which checks them against the installed torch once.

torch has no OFFLOAD, RELOAD or RECOMPUTE action, so `PlanExecutor` carries them out around the
runtime's compute actions, at the places the plan puts them on this rank:

- OFFLOAD(k, i): F(k, i) runs under saved-tensor hooks that hand autograd a handle instead of each
  activation it saves (parameters and stage inputs, which stay resident anyway, are not touched, nor
  are views of them, such as the transposed weights a linear layer on 3-d input saves; saved views of
  one block of memory share one handle, copied once); right after F the offload is handed to the
  device->host copy lane, which copies the tensors to host memory and drops the device copies while
  compute goes on.
- RELOAD(k, i): handed to the host->device copy lane when the compute op that was running when the
  plan starts the reload begins (as `planner.simulator.schedule_from_plan` gates it); it waits for
  its own OFFLOAD to end. B(k, i) (or BW) waits for RELOAD(k, i) and for nothing else on the lanes.
- RECOMPUTE(k, i): F(k, i) keeps only the stage's inputs (the checkpoint); every activation autograd
  would save is dropped. At the RECOMPUTE's place in the compute order the stage's forward is re-run
  on the same inputs with the same RNG state, and the activations it saves are given to autograd in
  the same order (the mechanism of torch's non-reentrant checkpoint, but run where the plan says and
  kept until W, which torch's split backward needs after I).

Copy lanes (`client.copy_lanes`) run the copies in the plan's order per lane, beside compute:
on CUDA, a dedicated stream per lane, pinned host buffers, and events (the d2h stream waits for the
F's end, the h2d stream for the offload's end and the anchor op's start, the compute stream for the
reload's end before the backward); on CPU, a worker thread per lane with the same ordering and waits.

Should the runtime need an activation before its planned reload/recompute was issued (a plan/runtime
mismatch), it is reloaded/recomputed on demand and counted in `stats.late`, so training stays correct
and the mismatch is visible.

With `trace=True` every op's measured start and end (and the pipeline's sends/receives and memory
high-water marks, `client.tracing`) is recorded; `PlannedSchedule.collect_trace()` gathers a
`pipeplan.trace/v1` document on rank 0. With an `Emulation` (`client.emulation`, CPU only) ops take
the durations a problem gives them. With `neighbours` (`client.emulated_neighbours`) the sends and
receives never reach torch.distributed: one rank runs alone, its receives arriving when planned.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.exports import torch_csv
from pipeplan.planner.ops import Kind
from pipeplan.planner.trace import Trace
from torch import nn

from .copy_lanes import CopyJob, OrderedLane
from .emulation import Emulation
from .torch_internals import KeyedLossRuntime, ScheduleRuntime, load_csv_text, p2p_hooks
from .tracing import OpRecorder, assemble_trace

TORCH_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)


# -- per-(stage, microbatch) saved state ------------------------------------------------------------
def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _dense(tensor: torch.Tensor) -> bool:
    """Its elements fill one block of memory, in some order (contiguous, transposed, permuted)."""
    expected = 1
    dims = sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] != 1), key=lambda d: d[1])
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _region(tensor: torch.Tensor) -> tuple:
    """The memory a saved tensor covers: saved tensors over one block (attention's output and the
    reshaped view of it the next linear layer saves) are one activation, counted and copied once. A
    tensor with gaps between its elements (a strided slice) is a region of its own."""
    where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel(), tensor.dtype)
    return where if _dense(tensor) else (*where, tuple(tensor.shape), tuple(tensor.stride()))


class _Offloaded:
    """A saved activation that can live on the device or on the host.

    A dense tensor is kept as its block of memory (`dev` a 1-d view of it), so every saved view of
    the block is rebuilt from the one copy (`view`); another tensor is kept, and copied, as it is."""

    __slots__ = ("dense", "dev", "device", "host", "nbytes", "saved")

    def __init__(self, tensor: torch.Tensor):
        self.dense = _dense(tensor)
        self.dev: torch.Tensor | None = (tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
                                         if self.dense else tensor)
        self.saved: torch.Tensor | None = tensor  # the first saved tensor (whether memory is freed)
        self.host: torch.Tensor | None = None
        self.device = tensor.device
        self.nbytes = _nbytes(tensor)

    def view_of(self, tensor: torch.Tensor) -> tuple | None:
        """How to rebuild `tensor` (one of this block's views) from `dev`: (shape, strides, offset)."""
        if not self.dense:
            return None
        start = self.saved.storage_offset() if self.saved is not None else tensor.storage_offset()
        return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset() - start

    def view(self, how: tuple | None) -> torch.Tensor:
        if how is None:
            return self.dev
        shape, stride, offset = how
        return self.dev.as_strided(shape, stride, self.dev.storage_offset() + offset)

    def to_host(self, stream: Any = None) -> int:
        """Copy to host and drop the device copy; on CUDA asynchronously on `stream` (pinned buffer)."""
        if self.dev is None:
            return 0
        dev = self.dev
        if dev.is_cuda:  # CUDA only: pinned buffer, non-blocking copy on the d2h stream
            self.host = torch.empty(dev.size(), dtype=dev.dtype, layout=dev.layout, device="cpu", pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(dev, non_blocking=True)
            dev.record_stream(stream)  # the allocator keeps the block until the copy has read it
        else:
            self.host = torch.empty(dev.size(), dtype=dev.dtype, layout=dev.layout, device="cpu").copy_(dev)
        self.dev = self.saved = None
        return self.nbytes

    def to_device(self, stream: Any = None, consumer: Any = None) -> int:
        """Copy back; on CUDA on `stream`, the result marked as used by the `consumer` stream."""
        if self.dev is not None or self.host is None:
            return 0
        if self.device.type == "cuda":  # CUDA only
            with torch.cuda.stream(stream):
                dev = torch.empty(self.host.size(), dtype=self.host.dtype, layout=self.host.layout,
                                  device=self.device)
                dev.copy_(self.host, non_blocking=True)
            dev.record_stream(consumer)
            self.dev = dev
        else:
            self.dev = self.host.to(self.device, copy=True)
        self.host = None
        return self.nbytes


@dataclass
class _Record:
    mode: str  # "plain" | "offload" | "recompute"
    handles: dict[tuple, _Offloaded] = field(default_factory=dict)  # offload: _region(tensor) -> handle
    inputs: tuple[tuple, dict] | None = None  # recompute: the stage's forward inputs (the checkpoint)
    rng: Any = None
    packed: int = 0  # recompute: how many tensors autograd asked to save
    saved: list[torch.Tensor] | None = None  # recompute: the recomputed activations, in pack order
    counted: set[tuple] = field(default_factory=set)  # plain: regions of the saved tensors counted
    resident: int = 0  # bytes of saved activations on the device now (the memory trace counts them)
    offload_done: Any = None  # CUDA: event on the d2h stream
    reload_done: Any = None  # CUDA: event on the h2d stream

    def drop(self) -> None:
        """Let go of every tensor this record keeps: the copy lanes' jobs outlive the backward that
        released it (until the next iteration), and would keep a reloaded activation on the device."""
        self.handles.clear()
        self.inputs = self.saved = self.rng = None


@dataclass
class ExecutorStats:
    """What the executor did, for tests and logs (bytes are per (stage, mb))."""

    offloaded_bytes: dict[tuple[int, int], int] = field(default_factory=Counter)
    freed_bytes: dict[tuple[int, int], int] = field(default_factory=Counter)
    reloads: set[tuple[int, int]] = field(default_factory=set)
    recomputes: set[tuple[int, int]] = field(default_factory=set)
    late: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # issued ops in order, e.g. "F(0,3)", "OFFLOAD(0,3)"

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
    """Carries out one rank's OFFLOAD/RELOAD/RECOMPUTE around torch's compute actions.

    `emulation` (CPU only) pads every op to the duration it gives; `trace` records every op's
    measured start, end and memory (see `client.tracing`). `synchronous_copies` runs the copies
    inline, in compute's order (CPU: on the compute thread; CUDA: on the compute stream), the old
    behaviour, to measure what overlap saves. `neighbours` (`client.emulated_neighbours`) stands in
    for the other ranks' sends and receives.
    """

    def __init__(self, stages: list, rank: int, *, emulation: Emulation | None = None, trace: bool = False,
                 synchronous_copies: bool = False, neighbours: Any = None):
        self.rank = rank
        self.stages = {s.stage_index: s for s in stages}
        self.device = torch.device(getattr(stages[0], "device", "cpu"))
        self.cuda = self.device.type == "cuda"
        if emulation is not None and self.cuda:
            raise ValueError("emulated time runs on CPU stages only; on CUDA the real kernels take their time")
        self.emulation = emulation
        self.neighbours = neighbours
        self.synchronous_copies = synchronous_copies
        self.stats = ExecutorStats()
        self._records: dict[tuple[int, int], _Record] = {}
        self._recording: _Record | None = None
        self._offload: set[tuple[int, int]] = set()
        self._recompute: set[tuple[int, int]] = set()
        self._before: dict[tuple, list] = {}
        self._after: dict[tuple, list] = {}
        self._d2h_order: list[tuple[int, int]] = []
        self._backward_kind: dict[tuple[int, int], Kind] = {}
        self._ran_before: set[tuple] = set()
        self._h2d_order: list[tuple[int, int]] = []
        self._resident: set[int] = set()  # storages of the running forward's parameters and inputs
        self._held = 0
        self._held_lock = threading.Lock()
        self._module_hooks: list[Any] = []  # removed at close(): the modules may outlive this executor
        # CPU: a worker thread per lane; CUDA: issued from this thread onto a stream per lane
        threaded = not self.cuda and not synchronous_copies
        self.d2h = OrderedLane("d2h", threaded=threaded)
        self.h2d = OrderedLane("h2d", threaded=threaded)
        self._streams: dict[str, Any] = {}
        if self.cuda and synchronous_copies:  # CUDA only: the copies queue up behind compute
            compute = torch.cuda.current_stream(self.device)
            self._streams = {"d2h": compute, "h2d": compute}
        elif self.cuda:  # CUDA only: dedicated copy streams
            self._streams = {"d2h": torch.cuda.Stream(self.device), "h2d": torch.cuda.Stream(self.device)}
        self.recorder = OpRecorder(self.device, self.held_bytes) if trace else None
        for stage in stages:
            self._wrap(stage)

    # -- plan ----------------------------------------------------------------------------------------
    def load(self, plan: Plan) -> None:
        """Adopt a plan's memory actions for this rank (between iterations only)."""
        if self._records:
            raise RuntimeError(f"rank {self.rank}: cannot change plans mid-iteration"
                               f" ({len(self._records)} activations still held)")
        torch_ops, self._before, self._after = side_op_positions(plan, self.rank)
        self._backward_kind = {(k, mb): kind for kind, k, mb in torch_ops if kind in (Kind.B, Kind.BW)}
        mine = set(self.stages)
        dp = next(d for d in plan.devices if d.device == self.rank)
        ordered = sorted(dp.ops, key=lambda p: p.start_ms)
        self._offload = {(p.stage, p.mb) for p in dp.ops if p.kind == Kind.OFFLOAD.value and p.stage in mine}
        self._recompute = {(p.stage, p.mb) for p in dp.ops if p.kind == Kind.RECOMPUTE.value
                           and p.stage in mine}
        self._d2h_order = [(p.stage, p.mb) for p in ordered if p.kind == Kind.OFFLOAD.value]
        self._h2d_order = [(p.stage, p.mb) for p in ordered if p.kind == Kind.RELOAD.value]

    def begin_iteration(self) -> None:
        self.d2h.set_order(self._d2h_order)
        self.h2d.set_order(self._h2d_order)
        if self.neighbours is not None:
            self.neighbours.begin_iteration()
        if self.recorder is not None:
            self.recorder.begin_iteration()

    def end_iteration(self) -> None:
        """Wait for the copy lanes (every copy of the iteration has been issued by now)."""
        self.d2h.drain()
        self.h2d.drain()

    def close(self) -> None:
        self.d2h.close()
        self.h2d.close()
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks.clear()

    def held_bytes(self) -> int:
        """Saved-activation bytes the hooks hold on the device now (CPU memory trace)."""
        return self._held

    def _hold(self, record: _Record, delta: int) -> None:
        with self._held_lock:
            record.resident += delta
            self._held += delta

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
            self._run_before(op)
            self.stats.log.append(f"F({k},{fwd_chunk_id})")
            out = self._timed(Kind.F, k, fwd_chunk_id,
                              lambda: self._forward(k, fwd_chunk_id, forward, args, kwargs))
            self._run(self._after.get(op, ()))
            return out

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, full_backward: bool = True, **kwargs: Any):
            kind = Kind.BW if full_backward else Kind.B
            self._run_before((kind, k, bwd_chunk_id))
            self._ensure_ready(k, bwd_chunk_id, kind)
            self.stats.log.append(f"{kind.value}({k},{bwd_chunk_id})")
            self._timed(kind, k, bwd_chunk_id,
                        lambda: backward(bwd_chunk_id, *args, full_backward=full_backward, **kwargs))
            if full_backward:
                self._release(k, bwd_chunk_id)

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any):
            self._run_before((Kind.W, k, bwd_chunk_id))
            self._ensure_ready(k, bwd_chunk_id, Kind.W)
            self.stats.log.append(f"W({k},{bwd_chunk_id})")
            self._timed(Kind.W, k, bwd_chunk_id, lambda: backward_weight(bwd_chunk_id, *args, **kwargs))
            self._release(k, bwd_chunk_id)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        self._module_hooks.append(stage.submod.register_forward_pre_hook(self._capture_inputs, with_kwargs=True))

    def _timed(self, kind: Kind, k: int, mb: int, work: Callable[[], Any]) -> Any:
        """Run a compute op: measured (when tracing) and padded to its emulated duration."""
        recorder = self.recorder
        if recorder is not None:
            recorder.reset_peak()
            start = recorder.mark()
        started = time.perf_counter()
        out = work()
        if self.emulation is not None:
            self.emulation.pad(kind, k, started)
        if recorder is not None:
            recorder.add(kind.value, k, mb, start, recorder.mark())
        return out

    def _release(self, k: int, mb: int) -> None:
        record = self._records.pop((k, mb), None)
        if record is not None:
            self._hold(record, -record.resident)
            record.drop()

    def _capture_inputs(self, module: nn.Module, args: tuple, kwargs: dict):
        self._resident = _storages(module.parameters()) | _storages((*args, *kwargs.values()))
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
        record = _Record("plain")
        with torch.autograd.graph.saved_tensors_hooks(self._pack_counted(record), _identity):
            out = forward(mb, *args, **kwargs)
        if record.resident:
            self._records[(k, mb)] = record
        return out

    def _pack_counted(self, record: _Record) -> Callable[[torch.Tensor], Any]:
        def pack(tensor: torch.Tensor) -> Any:
            region = _region(tensor)
            if tensor.untyped_storage().data_ptr() not in self._resident and region not in record.counted:
                record.counted.add(region)
                self._hold(record, _nbytes(tensor))
            # not the tensor itself: a saved output handed back as itself links autograd's C++ graph
            # to itself through Python, a cycle the collector cannot see (the graph would outlive W)
            return tensor.detach()
        return pack

    # -- offload ---------------------------------------------------------------------------------------
    def _pack_offload(self, record: _Record) -> Callable[[torch.Tensor], Any]:
        def pack(tensor: torch.Tensor) -> Any:
            # parameters and the stage's inputs, and views of them (a linear layer on 3-d input saves
            # its weight transposed), stay resident anyway
            if tensor.untyped_storage().data_ptr() in self._resident:
                return tensor
            region = _region(tensor)
            handle = record.handles.get(region)
            if handle is None:
                handle = record.handles[region] = _Offloaded(tensor)
                self._hold(record, handle.nbytes)
            return handle, handle.view_of(tensor)
        return pack

    def _offload_job(self, k: int, mb: int) -> CopyJob:
        record = self._records[(k, mb)]
        stream = self._streams.get("d2h")
        ready = None
        if self.cuda:  # CUDA only: the d2h stream starts after F's kernels (this point on compute)
            ready = torch.cuda.current_stream(self.device).record_event()

        def run() -> None:
            if ready is not None:
                stream.wait_event(ready)
            start = self.recorder.mark(stream) if self.recorder is not None else None
            started = time.perf_counter()
            alive = [(weakref.ref(h.saved), h.nbytes) for h in record.handles.values() if h.saved is not None]
            moved = sum(h.to_host(stream) for h in record.handles.values())
            self._hold(record, -moved)
            self.stats.offloaded_bytes[(k, mb)] += moved
            # device memory really released: copies nothing else (e.g. the stage's output) still holds
            self.stats.freed_bytes[(k, mb)] += sum(n for ref, n in alive if ref() is None)
            record.offload_done = self._copy_done(Kind.OFFLOAD, k, mb, stream, start, started)
        return CopyJob((k, mb), run)

    def _reload_job(self, k: int, mb: int) -> CopyJob:
        record = self._records[(k, mb)]
        stream = self._streams.get("h2d")
        anchor = None
        if self.cuda:  # CUDA only: the plan starts the reload with the compute op about to run
            anchor = torch.cuda.current_stream(self.device).record_event()
        offload = self.d2h.job((k, mb))

        def run() -> None:
            self._wait_copy(offload, f"OFFLOAD({k},{mb})")
            if self.cuda:  # CUDA only: after its own offload and the anchor op's start, nothing else
                stream.wait_event(record.offload_done)
                stream.wait_event(anchor)
            start = self.recorder.mark(stream) if self.recorder is not None else None
            started = time.perf_counter()
            consumer = torch.cuda.current_stream(self.device) if self.cuda else None
            moved = sum(h.to_device(stream, consumer) for h in record.handles.values())
            self._hold(record, moved)
            record.reload_done = self._copy_done(Kind.RELOAD, k, mb, stream, start, started)
            self.stats.reloads.add((k, mb))
        return CopyJob((k, mb), run)

    def _copy_done(self, kind: Kind, k: int, mb: int, stream: Any, start: Any, started: float) -> Any:
        """A copy's end on its lane: pad it to its emulated duration, record it in the trace; its CUDA
        event on `stream` (None off CUDA)."""
        if self.emulation is not None:
            self.emulation.pad(kind, k, started)
        done = stream.record_event() if self.cuda else None  # CUDA only
        if self.recorder is not None:
            self.recorder.add(kind.value, k, mb, start, self.recorder.mark(stream))
        return done

    def _wait_copy(self, job: CopyJob | None, what: str) -> None:
        if job is None:
            raise RuntimeError(f"rank {self.rank}: {what} was never issued")
        if not self.d2h.threaded and not job.done.is_set():  # issued in this thread: nothing else will
            raise RuntimeError(f"rank {self.rank}: {what} is not issued yet; the plan's copy-lane order"
                               " does not match its compute order")
        job.wait()

    def _reload_now(self, k: int, mb: int) -> None:
        """Late path: reload on the compute stream / thread, after the offload finished."""
        record = self._records[(k, mb)]
        self._wait_copy(self.d2h.job((k, mb)), f"OFFLOAD({k},{mb})")
        stream = None
        if self.cuda:  # CUDA only
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(record.offload_done)
        self._hold(record, sum(h.to_device(stream, stream) for h in record.handles.values()))
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
        resident = _storages(self.stages[k].submod.parameters()) | _storages((*args, *kwargs.values()))
        activations = {_region(t): t for t in saved if t.untyped_storage().data_ptr() not in resident}
        self._hold(record, sum(_nbytes(t) for t in activations.values()))
        self.stats.recomputes.add((k, mb))

    # -- running the side ops --------------------------------------------------------------------------
    def _run(self, side_ops) -> None:
        for kind, k, mb in side_ops:
            if (k, mb) not in self._records:
                # nothing saved (e.g. the stage has no backward): keep the lane's order moving
                if kind is Kind.OFFLOAD:
                    self.d2h.submit(CopyJob((k, mb), _nothing))
                elif kind is Kind.RELOAD:
                    self.h2d.submit(CopyJob((k, mb), _nothing))
                continue
            self.stats.log.append(f"{kind.value}({k},{mb})")
            if kind is Kind.OFFLOAD:
                self.d2h.submit(self._offload_job(k, mb))
            elif kind is Kind.RELOAD:
                self.h2d.submit(self._reload_job(k, mb))
            elif kind is Kind.RECOMPUTE:
                self._timed(Kind.RECOMPUTE, k, mb, lambda k=k, mb=mb: self._recompute_now(k, mb))

    def _ensure_ready(self, k: int, mb: int, kind: Kind) -> None:
        """Before a backward: wait for this (k, mb)'s own reload (and nothing else on the lanes)."""
        record = self._records.get((k, mb))
        if record is None:
            return
        if record.mode == "offload" and self.d2h.job((k, mb)) is not None:
            reload = self.h2d.job((k, mb))
            if reload is None:
                self.stats.late.append(f"RELOAD({k},{mb}) before {kind.value}")
                self._reload_now(k, mb)
            else:
                self._wait_copy(reload, f"RELOAD({k},{mb})")
                if self.cuda:  # CUDA only: the compute stream waits for this reload's event alone
                    torch.cuda.current_stream(self.device).wait_event(record.reload_done)
        if record.mode == "recompute" and record.saved is None:
            self.stats.late.append(f"RECOMPUTE({k},{mb}) before {kind.value}")
            self._recompute_now(k, mb)

    # -- the pipeline's sends and receives -------------------------------------------------------------
    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """For one step: run each compute op's planned side ops before torch waits on the op's
        receive (not after: a RECOMPUTE or RELOAD the plan runs while the input is in flight must not
        wait for it), and, when tracing, record SEND_F/RECV_F/SEND_B/RECV_B.

        A receive runs from when it is posted to when its wait returns; a send from when it is
        issued to when the issue returns (its completion is only awaited at the end of the step).
        """
        recorder = self.recorder
        neighbours = self.neighbours
        pending: list[tuple[str, int, int]] = []
        posted: dict[int, tuple[str, int, int, Any]] = {}
        self._ran_before = set()

        def batch_p2p(batch, p2p_ops, desc):
            start = recorder.mark() if recorder is not None else None
            label = pending.pop() if pending else None
            works = neighbours.post(label, p2p_ops) if neighbours is not None else batch(p2p_ops, desc=desc)
            if label is not None:
                kind, k, mb = label
                if kind.startswith("SEND"):
                    if recorder is not None:
                        recorder.add(kind, k, mb, start, recorder.mark())
                else:
                    posted[id(works)] = (kind, k, mb, start)
            return works

        def wait_batch_p2p(wait, works):
            entry = posted.pop(id(works), None)
            if entry is not None:
                kind, k, mb, _start = entry
                consumer = (Kind.F, k, mb) if kind == "RECV_F" else (self._backward_kind.get((k, mb), Kind.B), k, mb)
                self._run_before(consumer)
            if neighbours is not None:
                neighbours.wait(works)
            else:
                wait(works)
            if entry is not None and recorder is not None:
                recorder.add(entry[0], entry[1], entry[2], entry[3], recorder.mark())

        originals = []
        for stage in self.stages.values():
            for name, kind in (("get_fwd_send_ops", "SEND_F"), ("get_bwd_send_ops", "SEND_B"),
                               ("get_fwd_recv_ops", "RECV_F"), ("get_bwd_recv_ops", "RECV_B")):
                method = getattr(stage, name)
                originals.append((stage, name, stage.__dict__.get(name)))

                def labelled(mb, *a, _m=method, _kind=kind, _k=stage.stage_index, **kw):
                    pending[:] = [(_kind, _k, mb)]
                    return _m(mb, *a, **kw)
                setattr(stage, name, labelled)
        try:
            with p2p_hooks(batch_p2p, wait_batch_p2p):
                yield
        finally:
            for stage, name, own in originals:
                if own is None:
                    del stage.__dict__[name]
                else:
                    setattr(stage, name, own)

    def _run_before(self, op: tuple) -> None:
        """The side ops planned before compute op `op`, once per iteration."""
        if op not in self._ran_before:
            self._ran_before.add(op)
            self._run(self._before.get(op, ()))


def _nothing() -> None:
    return None


def _identity(x: Any) -> Any:
    return x


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
        handle, how = packed
        if handle.dev is None:
            executor.stats.late.append(f"RELOAD({k},{mb}) on demand")
            executor._ensure_ready(k, mb, Kind.W)
            if handle.dev is None:
                executor._reload_now(k, mb)
        return handle.view(how)
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
def same_shape(a: Problem, b: Problem) -> list[str]:
    """Why a plan of `b` cannot run on stages built for `a` (empty when it can)."""
    out = []
    if (a.num_devices, a.num_stages, a.num_microbatches) != (b.num_devices, b.num_stages, b.num_microbatches):
        out.append(f"devices/stages/microbatches {a.num_devices}/{a.num_stages}/{a.num_microbatches} vs"
                   f" {b.num_devices}/{b.num_stages}/{b.num_microbatches}")
    if [s.device for s in a.stages] != [s.device for s in b.stages]:
        out.append("stage placement differs")
    return out


@dataclass
class PlannedSchedule:
    """torch's runtime schedule loaded from a plan, plus the executor of its memory actions."""

    schedule: ScheduleRuntime
    executor: PlanExecutor
    problem: Problem
    plan: Plan
    iterations: int = 0

    def step(self, *args: Any, **kwargs: Any):
        """One iteration. When tracing, every rank first meets at a barrier, so the ranks' clocks
        start together (one host: the same monotonic clock; several hosts: to a barrier's skew)."""
        executor = self.executor
        if executor.recorder is not None:
            _barrier()
        executor.begin_iteration()
        try:
            with executor.around_step():
                return self.schedule.step(*args, **kwargs)
        finally:
            executor.end_iteration()
            self.iterations += 1

    def local_trace(self):
        """This rank's measurements of the last iteration (`planner.trace.DeviceTrace`)."""
        if self.executor.recorder is None:
            raise RuntimeError("build the schedule with trace=True to record traces")
        return self.executor.recorder.device_trace(self.executor.rank)

    def collect_trace(self, dst: int = 0, group=None, metadata: dict | None = None) -> Trace | None:
        """Gather the last iteration's measurements: the trace on rank `dst`, None elsewhere.

        Collective: call it on every rank after the same `step()`."""
        import torch.distributed as dist

        local = self.local_trace()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered: list | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
            dist.gather_object(local.model_dump(), gathered, dst=dst, group=group)
            if gathered is None:
                return None
            from pipeplan.planner.trace import DeviceTrace

            devices = [DeviceTrace.model_validate(d) for d in gathered]
        else:
            devices = [local]
        return assemble_trace(devices, self.plan.problem_key, self.plan.revision,
                              iteration=self.iterations - 1, cuda=self.executor.cuda,
                              emulated=self.executor.emulation is not None, metadata=metadata)

    def swap(self, plan: Plan, problem: Problem | None = None) -> None:
        """Switch to another plan; call at an iteration boundary on EVERY rank.

        Without `problem`, the plan must be of this schedule's problem; with one (e.g. a problem
        calibrated from traces, `planner.fidelity.calibrated_problem`), it must have the same shape.
        """
        target = problem if problem is not None else self.problem
        if problem is not None:
            if (why := same_shape(self.problem, problem)):
                raise ValueError("the new problem does not fit these stages: " + "; ".join(why))
            if plan.problem_key != problem.key():
                raise ValueError(f"plan is for {plan.problem_key[:12]}…, not the given problem")
        elif plan.problem_key != self.plan.problem_key:
            raise ValueError(f"plan is for {plan.problem_key[:12]}…, not {self.plan.problem_key[:12]}…")
        self.executor.load(plan)
        load_csv_text(self.schedule, torch_csv(target, plan))
        self.plan, self.problem = plan, target


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def build_schedule(problem: Problem, plan: Plan, stages: list, loss_fn: Callable | None,
                   *, scale_grads: bool = True, trace: bool = False,
                   emulation: Emulation | None = None, synchronous_copies: bool = False,
                   neighbours: Any = None) -> PlannedSchedule:
    """torch's `_PipelineScheduleRuntime` running `plan` on this rank's `stages`.

    `stages` are this rank's `PipelineStage`s (the plan's stages on device = this rank). The compute
    order is loaded through torch's own `_load_csv`; offload/recompute run through `PlanExecutor`.
    `trace=True` records every iteration (`collect_trace()`); `emulation` pads ops to given durations;
    `neighbours` (`client.emulated_neighbours.EmulatedNeighbours`) replaces the other ranks.
    """
    rank = stages[0].group_rank
    expected = set(problem.stages_of(rank))
    have = {s.stage_index for s in stages}
    if have != expected:
        raise ValueError(f"rank {rank} holds stages {sorted(have)} but the plan puts {sorted(expected)} here")
    if stages[0].num_stages != problem.num_stages:
        raise ValueError(f"the model has {stages[0].num_stages} stages; the problem has {problem.num_stages}")
    schedule = KeyedLossRuntime(stages=stages, n_microbatches=problem.num_microbatches,
                                loss_fn=loss_fn, scale_grads=scale_grads)
    executor = PlanExecutor(stages, rank, emulation=emulation, trace=trace,
                            synchronous_copies=synchronous_copies, neighbours=neighbours)
    executor.load(plan)
    load_csv_text(schedule, torch_csv(problem, plan))
    return PlannedSchedule(schedule, executor, problem, plan)


def agree_on_plan(candidate: Plan | None, src: int = 0, group=None) -> Plan | None:
    """Every rank gets rank `src`'s candidate plan (or None): swaps must happen on all ranks at once."""
    import torch.distributed as dist

    box = [candidate.model_dump_json() if candidate is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return Plan.model_validate_json(box[0]) if box[0] is not None else None
