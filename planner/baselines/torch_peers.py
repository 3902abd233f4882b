"""torch.distributed.pipelining's own schedule generators as peers, re-timed by our simulator.

Each peer asks a torch schedule class for its per-rank compute actions (the `pipeline_order` every
class builds in its constructor, for all ranks, without a process group), maps them to our op orders
and lets `evaluate` time, memory-check and validate them like any baseline. torch is an optional
extra (`pip install pipeplan[torch]`): it is imported inside the functions, and without it every peer
raises NotApplicable("torch is not installed").

Action mapping (torch's `{stage}{type}{mb}`): F -> F, I (input gradient) -> B, W -> W, B (full
backward) -> BW; DualPipeV's OVERLAP_F_B runs its two sub-actions one after the other (our devices
have one compute lane, so the overlap it aims for is not modelled).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ..contract import Problem
from ..ops import Kind, Op
from ..simulator import ScheduleError
from .common import (
    NotApplicable,
    Outcome,
    evaluate,
    is_loop_placement,
    is_v_placement,
    require_split,
    schedule_of,
)

Orders = list[list[Op]]
_KINDS = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.BW}


def _schedules() -> Any:
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        raise NotApplicable("torch is not installed") from None
    return schedules


def _stage_stand_in(problem: Problem, stage: int) -> SimpleNamespace:
    """A stage as far as torch 2.13's schedule constructors read it: `num_stages`, `group_size`,
    `group_rank` (the base classes' __init__), `submod` (_check_torch_compile_compatibility; None is
    "not a compiled module"); `stage_index_to_group_rank` is written by the constructors. Every rank's
    order is built by every rank, so rank 0's stand-ins give the whole pipeline_order."""
    return SimpleNamespace(num_stages=problem.num_stages, group_size=problem.num_devices, group_rank=0,
                           submod=None, stage_index=stage, stage_index_to_group_rank={})


def pipeline_order(problem: Problem, class_name: str) -> dict[int, list[Any]]:
    """torch's per-rank action lists for this problem's P, S and M (None = an idle step)."""
    schedules = _schedules()
    cls = getattr(schedules, class_name, None)
    if cls is None:
        raise NotApplicable(f"this torch has no {class_name}")
    try:
        if issubclass(cls, schedules.PipelineScheduleSingle):
            schedule = cls(_stage_stand_in(problem, 0), problem.num_microbatches)
        else:  # rank 0's stages: 0, P, 2P, ... in loop placement; 0 and 2P-1 in V placement
            local = problem.stages_of(problem.stages[0].device)
            schedule = cls([_stage_stand_in(problem, s) for s in local], problem.num_microbatches)
    except ValueError as exc:  # torch's own applicability rules (M against stages, rounds)
        raise NotApplicable(f"torch {class_name}: {exc}") from None
    return schedule.pipeline_order


def to_orders(problem: Problem, order: dict[int, list[Any]]) -> Orders:
    """Per-device compute orders from torch's per-rank actions (idle steps and non-compute actions
    such as REDUCE_GRAD dropped; each action lands on the device of its stage)."""
    orders: Orders = [[] for _ in range(problem.num_devices)]
    for rank in sorted(order):
        for action in order[rank]:
            if action is None:
                continue
            for act in action.sub_actions or (action,):
                kind = _KINDS.get(act.computation_type.value)
                if kind is not None:
                    orders[problem.stages[act.stage_index].device].append(
                        Op(kind, act.stage_index, act.microbatch_index))
    return orders


def _renumber_last_rank_forwards(problem: Problem, orders: Orders) -> bool:
    """torch 2.13's Schedule1F1B IR numbers the last rank's forwards 1..M instead of 0..M-1 (its
    training loop, which does not read the IR, is right). Put them back, and say so (True)."""
    last = problem.num_stages - 1
    device = orders[problem.stages[last].device]
    mbs = [op.mb for op in device if op.kind is Kind.F]
    if mbs != list(range(1, problem.num_microbatches + 1)):
        return False
    for j, op in enumerate(device):
        if op.kind is Kind.F:
            device[j] = Op(Kind.F, op.stage, op.mb - 1)
    return True


def _peer(name: str, class_name: str, check: Callable[[Problem], None]) -> Callable[[Problem], Outcome]:
    def run(problem: Problem) -> Outcome:
        _schedules()  # "torch is not installed" before any placement reason
        check(problem)
        orders = to_orders(problem, pipeline_order(problem, class_name))
        method = name
        if class_name == "Schedule1F1B" and _renumber_last_rank_forwards(problem, orders):
            method += " (torch IR's last-rank forwards renumbered 0..M-1: off by one in torch)"
        try:
            return evaluate(problem, schedule_of(problem, orders), method)
        except ScheduleError as exc:
            raise NotApplicable(f"{name}: torch's order does not run on this problem: {exc}") from None
    return run


def _one_stage_per_rank(problem: Problem) -> None:
    if problem.chunks != 1:
        raise NotApplicable(f"torch-1f1b needs one stage per device; this problem has {problem.chunks}")


def _loop(name: str, split: bool) -> Callable[[Problem], None]:
    def check(problem: Problem) -> None:
        if split:
            require_split(problem, name)
        if not is_loop_placement(problem):
            raise NotApplicable(f"{name} needs loop placement (stage k on device k mod P)")
    return check


def _v(name: str) -> Callable[[Problem], None]:
    def check(problem: Problem) -> None:
        require_split(problem, name)
        if not is_v_placement(problem):
            raise NotApplicable(f"{name} needs V placement: 2 stages per device, stage k and 2P-1-k together")
    return check


TORCH_PEERS: dict[str, Callable[[Problem], Outcome]] = {
    "torch-1f1b": _peer("torch-1f1b", "Schedule1F1B", _one_stage_per_rank),
    "torch-interleaved-1f1b": _peer("torch-interleaved-1f1b", "ScheduleInterleaved1F1B",
                                    _loop("torch-interleaved-1f1b", split=False)),
    "torch-interleaved-zb": _peer("torch-interleaved-zb", "ScheduleInterleavedZeroBubble",
                                  _loop("torch-interleaved-zb", split=True)),
    "torch-zbv": _peer("torch-zbv", "ScheduleZBVZeroBubble", _v("torch-zbv")),
    "torch-dualpipev": _peer("torch-dualpipev", "ScheduleDualPipeV", _v("torch-dualpipev")),
}
