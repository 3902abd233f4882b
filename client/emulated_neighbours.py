"""One rank of a plan in one process, its pipeline neighbours emulated: receives arrive when planned.

What a single GPU can check of a multi-rank plan is one rank's part of it: its compute, its copy
lanes, its memory. The other ranks are replaced by `EmulatedNeighbours`, which the executor's sends
and receives go through instead of torch.distributed:

- a receive (RECV_F / RECV_B) completes at its planned arrival: the planned end of the producing op
  on the neighbour (F of the stage before, B or BW of the stage after) plus the problem's link time,
  counted from the iteration's start (on CUDA the iteration starts from a synchronized device, so
  host and GPU clocks start together); the buffer is then filled with fixed random data (its values
  only need to be finite and the same every run). On CPU the host waits for the arrival. On CUDA
  the wait is the GPU's, as a NCCL receive's `wait()` orders the compute stream behind the receive
  and lets the host go on: the host is let go up to `LEAD_S` before the arrival (a stream that has
  drained by then gets a spin kernel lasting until the arrival), so it queues what follows while
  the GPU waits. A host that waited instead would start the kernels late by its own launch work
  (torch walks B's autograd graph before B's first kernel: 3 ms of a 19.5-ms B at width 4096 on
  an H200, docs/torch.md "On a GPU");
- a send completes at once (the neighbour takes whatever we send, whenever we send it).

So a rank whose own ops keep to the plan meets every receive where the plan put it, and a rank that
runs late shows its own lateness, not a neighbour's. `one_rank_schedule` builds such a rank: a
one-process gloo group, `PipelineStage`s with static shapes (no metadata exchange with neighbours),
and `build_schedule` with the emulated neighbours. Needs the `torch` extra; works on CPU and CUDA.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pipeplan.planner.contract import Plan, Problem
from torch import nn

from .emulation import Emulation, wait_until
from .torch_internals import assume_static_neighbours
from .torch_runtime import PlannedSchedule, build_schedule

Label = tuple[str, int, int]  # ("RECV_F" | "RECV_B" | "SEND_F" | "SEND_B", stage, mb)


def arrivals(problem: Problem, plan: Plan, rank: int) -> dict[Label, float]:
    """When each receive of `rank` arrives in the plan (ms from the iteration's start)."""
    ends = {(p.kind, p.stage, p.mb): p.end_ms for d in plan.devices for p in d.ops}
    out: dict[Label, float] = {}
    last = problem.num_stages - 1
    for k in problem.stages_of(rank):
        for mb in range(problem.num_microbatches):
            if k > 0 and problem.stages[k - 1].device != rank:
                out[("RECV_F", k, mb)] = ends[("F", k - 1, mb)] + problem.link_ms(k - 1, k)
            if k < last and problem.stages[k + 1].device != rank:
                producer = ends.get(("B", k + 1, mb), ends.get(("BW", k + 1, mb)))
                if producer is None:
                    raise ValueError(f"the plan has no B or BW of stage {k + 1} mb {mb}")
                out[("RECV_B", k, mb)] = producer + problem.link_ms(k + 1, k)
    return out


def predicted_rank_end(problem: Problem, plan: Plan, rank: int, *, synchronous_copies: bool = False) -> float:
    """When `rank`'s last op ends if its neighbours keep to the plan (receives at `arrivals`) and
    its own ops start as early as they can in the order the executor issues them.

    With copy lanes each copy starts when it is issued (the end of the compute op before it: the
    executor issues a RELOAD before its anchor op, an OFFLOAD after its F), its lane is free and its
    own OFFLOAD has ended; with `synchronous_copies` the copies run in compute's order instead. The
    difference between the two is the overlap this rank's copies buy it.
    """
    from pipeplan.planner.ops import Kind, Op, choices_from_ops, deps, duration, op_of

    from .torch_runtime import side_op_positions

    planned = {op_of(p): p for d in plan.devices for p in d.ops}
    choices, _ = choices_from_ops(problem, list(planned))
    torch_ops, before, after = side_op_positions(plan, rank)
    sequence: list[tuple[Kind, int, int]] = []
    for op in torch_ops:
        sequence += [*before.get(op, ()), op, *after.get(op, ())]
    mine = set(problem.stages_of(rank))
    end: dict[Op, float] = {}
    compute_free = 0.0
    lane_free = {Kind.OFFLOAD: 0.0, Kind.RELOAD: 0.0}
    for kind, k, mb in sequence:
        op = Op(kind, k, mb)
        ready = 0.0
        for dep in deps(problem, op, choices):
            if dep.before.stage in mine:
                ready = max(ready, end[dep.before] + dep.lag_ms)
            else:  # a neighbour's op: as planned
                ready = max(ready, planned[dep.before].end_ms + dep.lag_ms)
        copy = kind in lane_free
        start = max(ready, compute_free, lane_free[kind] if copy else 0.0)
        end[op] = start + duration(problem, op)
        if copy and not synchronous_copies:
            lane_free[kind] = end[op]
        else:
            compute_free = end[op]
    return max(end.values())


@dataclass
class _Posted:
    """What a posted batch of sends or receives stands for (the executor keys waits by identity)."""

    label: Label | None
    buffers: list[torch.Tensor]


LEAD_S = 0.005  # CUDA: how long before an arrival the host may go on to queue what follows
# CUDA: a spin's cycles over the measured rate's, so that an arrival comes late by a little, never
# early: on an H200 spins after a burst of compute ran up to 7% shorter than the rate measured on an
# idle GPU (a 4.3-ms spin, 0.3 ms short)
SPIN_MARGIN = 1.1


class EmulatedNeighbours:
    """The ranks around one rank: receives arrive at their planned times, sends complete at once."""

    def __init__(self, problem: Problem, plan: Plan, rank: int, device: torch.device, *, seed: int = 0):
        self.arrival_ms = arrivals(problem, plan, rank)
        self.device = torch.device(device)
        self.seed = seed
        self.waited_ms: dict[Label, float] = {}  # how long each receive of the last iteration waited
        self._t0 = time.perf_counter()
        self._payloads: dict[tuple, torch.Tensor] = {}
        self._spin_hz = 0.0  # CUDA: the spin kernel's cycles per second, measured as each iteration begins

    def begin_iteration(self) -> None:
        """Start the iteration's clock (on CUDA once the device has finished the previous one)."""
        if self.device.type == "cuda":  # CUDA only: host and GPU start the iteration together
            self._spin_hz = _spin_hz(self.device)  # each time: the clock of an idle GPU differs
            torch.cuda.synchronize(self.device)
        self.waited_ms = {}
        self._t0 = time.perf_counter()

    def post(self, label: Label | None, p2p_ops: list) -> _Posted:
        """Stand in for torch's batched isend/irecv: nothing leaves this process."""
        receive = label is not None and label[0].startswith("RECV")
        return _Posted(label, [op.tensor for op in p2p_ops] if receive else [])

    def wait(self, posted: _Posted) -> None:
        """A receive returns at its planned arrival, its buffers filled; a send at once."""
        if posted.label is None or not posted.buffers:
            return
        at = self.arrival_ms.get(posted.label)
        if at is not None:
            before = time.perf_counter()
            if self.device.type == "cuda":  # CUDA only: the GPU waits, the host goes on
                self._arrive_on_gpu(self._t0 + at / 1000.0)
            else:
                wait_until(self._t0 + at / 1000.0)
            self.waited_ms[posted.label] = (time.perf_counter() - before) * 1000.0
        for buffer in posted.buffers:
            with torch.no_grad():
                buffer.copy_(self._payload(buffer, gradient=posted.label[0] == "RECV_B"))

    def _arrive_on_gpu(self, deadline: float) -> None:
        """Return once the compute stream cannot start what follows before `deadline`: the host
        waits until LEAD_S before it, then until the stream drains (it gets a spin kernel lasting
        until the deadline) or the deadline passes (the data is there before the GPU could use it)."""
        wait_until(deadline - LEAD_S)
        stream = torch.cuda.current_stream(self.device)
        while (now := time.perf_counter()) < deadline:
            if stream.query():
                with torch.cuda.device(self.device):
                    torch.cuda._sleep(int((deadline - now) * SPIN_MARGIN * self._spin_hz))
                return
            time.sleep(0)

    def _payload(self, like: torch.Tensor, *, gradient: bool) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype, str(like.device), gradient)
        if key not in self._payloads:
            g = torch.Generator().manual_seed(self.seed + int(gradient))
            scale = 1e-3 if gradient else 1.0  # gradients small, as a loss's are; activations unit-scale
            self._payloads[key] = (torch.randn(like.shape, generator=g) * scale).to(like.dtype).to(like.device)
        return self._payloads[key]


def _spin_hz(device: torch.device, cycles: int = 10_000_000) -> float:
    """Cycles per second of `torch.cuda._sleep`'s spin kernel on `device` (the SM clock), timed with
    CUDA events over ~5 ms alone on the GPU, as it later runs, after one spin that lets the clock
    rise (on an H200 a first iteration's arrivals came 5.6% early when timed on a cold GPU)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def ensure_process_group() -> bool:
    """A one-process gloo group, which `PipelineStage` needs (nothing is ever sent through it);
    True when this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """Within the block, the one-process group exists (destroyed at the end if the block made it):
    the stages look their (absent) neighbours up in it at every step."""
    import torch.distributed as dist

    created = ensure_process_group()
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


@dataclass
class OneRank:
    """One rank of a plan, ready to step: its schedule, its emulated neighbours, its inputs."""

    schedule: PlannedSchedule
    neighbours: EmulatedNeighbours
    first: bool  # the rank holds stage 0: it is fed the batch
    last: bool  # the rank holds the last stage: it computes the loss
    inputs: torch.Tensor
    targets: torch.Tensor

    def step(self) -> None:
        args = (self.inputs,) if self.first else ()
        if self.last:
            self.schedule.step(*args, target=self.targets)
        else:
            self.schedule.step(*args)

    def close(self) -> None:
        self.schedule.executor.close()


def one_rank_schedule(problem: Problem, plan: Plan, rank: int, modules: dict[int, nn.Module],
                      microbatch: torch.Tensor, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                      trace: bool = True, synchronous_copies: bool = False,
                      emulation: Emulation | None = None) -> OneRank:
    """Run `rank`'s part of `plan` in this process: `modules[k]` is stage k (on `microbatch`'s device).
    Step it inside `single_process_group()`.

    Every stage maps a tensor shaped like `microbatch` (one microbatch) to one of the same shape, as
    a stack of residual blocks does; the shapes are given to torch statically, since there is no
    neighbour to exchange them with.
    """
    from torch.distributed.pipelining import PipelineStage

    ensure_process_group()
    device = microbatch.device
    stages = []
    for k in problem.stages_of(rank):
        module = modules[k].to(device)
        with torch.no_grad():
            output = module(microbatch)
        # what flows between stages carries gradients (a received input's goes back to its sender)
        example = microbatch if k == 0 else microbatch.detach().requires_grad_(True)
        stage = PipelineStage(module, k, problem.num_stages, device, input_args=example,
                              output_args=output.detach().requires_grad_(True))
        assume_static_neighbours(stage, rank, problem.num_devices)
        stages.append(stage)
    neighbours = EmulatedNeighbours(problem, plan, rank, device)
    schedule = build_schedule(problem, plan, stages, loss_fn or _mse, trace=trace, emulation=emulation,
                              synchronous_copies=synchronous_copies, neighbours=neighbours)
    g = torch.Generator(device=device).manual_seed(1)  # made where they are used: a GPU batch is large
    shape = (problem.num_microbatches * microbatch.shape[0], *microbatch.shape[1:])
    inputs = torch.randn(shape, generator=g, device=device, dtype=microbatch.dtype)
    targets = torch.randn(shape, generator=g, device=device, dtype=microbatch.dtype)
    last = problem.num_stages - 1
    return OneRank(schedule, neighbours, first=0 in problem.stages_of(rank),
                   last=last in problem.stages_of(rank), inputs=inputs, targets=targets)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target.float()) ** 2).mean()
