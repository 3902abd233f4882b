"""The op table of docs/formats.md as code: durations, lanes, dependencies and memory deltas.

The validator, the simulator, the heuristics and the solvers all read the contract through this one
module, so a rule lives in exactly one place.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from .contract import PlanOp, Problem


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    RECOMPUTE = "RECOMPUTE"


KIND_BY_NAME = {kind.value: kind for kind in Kind}  # a dict lookup, not Enum.__call__ (hot in validation)


class Lane(str, Enum):
    COMPUTE = "compute"
    D2H = "d2h"
    H2D = "h2d"


LANES = (Lane.COMPUTE, Lane.D2H, Lane.H2D)
COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW, Kind.RECOMPUTE})
BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})


class Op(NamedTuple):
    """Identity of one op: (kind, stage, microbatch)."""

    kind: Kind
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.value}(stage {self.stage}, mb {self.mb})"


def op_of(pop: PlanOp) -> Op:
    """The identity of a plan document's op."""
    return Op(KIND_BY_NAME[pop.kind], pop.stage, pop.mb)


class Dep(NamedTuple):
    """`op` may start only after `before` ends plus `lag_ms` (a link transfer, or 0)."""

    before: Op
    lag_ms: float


def lane_of(kind: Kind) -> Lane:
    if kind is Kind.OFFLOAD:
        return Lane.D2H
    if kind is Kind.RELOAD:
        return Lane.H2D
    return Lane.COMPUTE


def duration(problem: Problem, op: Op) -> float:
    s = problem.stages[op.stage]
    match op.kind:
        case Kind.F:
            return s.forward_ms
        case Kind.B:
            return s.backward_input_ms
        case Kind.W:
            return s.backward_weight_ms
        case Kind.BW:
            return s.backward_input_ms + s.backward_weight_ms
        case Kind.OFFLOAD:
            return s.offload_ms
        case Kind.RELOAD:
            return s.reload_ms
        case Kind.RECOMPUTE:
            return s.recompute_ms
    raise ValueError(op.kind)


class Choice(NamedTuple):
    """How one (stage, microbatch) is executed: split backward? offloaded? recomputed?"""

    split: bool
    offload: bool = False
    recompute: bool = False


def ops_of(stage: int, mb: int, choice: Choice) -> list[Op]:
    """The ops one (stage, microbatch) consists of under `choice`."""
    ops = [Op(Kind.F, stage, mb)]
    ops += [Op(Kind.B, stage, mb), Op(Kind.W, stage, mb)] if choice.split else [Op(Kind.BW, stage, mb)]
    if choice.offload:
        ops += [Op(Kind.OFFLOAD, stage, mb), Op(Kind.RELOAD, stage, mb)]
    if choice.recompute:
        ops.append(Op(Kind.RECOMPUTE, stage, mb))
    return ops


def backward_op(stage: int, mb: int, choice: Choice) -> Op:
    return Op(Kind.B if choice.split else Kind.BW, stage, mb)


def deps(problem: Problem, op: Op, choices: dict[tuple[int, int], Choice]) -> list[Dep]:
    """Every op that must end before `op` may start (docs/formats.md, 'starts after')."""
    k, i = op.stage, op.mb
    choice = choices[(k, i)]
    out: list[Dep] = []
    match op.kind:
        case Kind.F:
            if k > 0:
                out.append(Dep(Op(Kind.F, k - 1, i), problem.link_ms(k - 1, k)))
        case Kind.B | Kind.BW:
            out.append(Dep(Op(Kind.F, k, i), 0.0))
            if k + 1 < problem.num_stages:
                out.append(Dep(backward_op(k + 1, i, choices[(k + 1, i)]), problem.link_ms(k + 1, k)))
            if choice.offload:
                out.append(Dep(Op(Kind.RELOAD, k, i), 0.0))
            if choice.recompute:
                out.append(Dep(Op(Kind.RECOMPUTE, k, i), 0.0))
        case Kind.W:
            out.append(Dep(Op(Kind.B, k, i), 0.0))
        case Kind.OFFLOAD | Kind.RECOMPUTE:
            out.append(Dep(Op(Kind.F, k, i), 0.0))
        case Kind.RELOAD:
            out.append(Dep(Op(Kind.OFFLOAD, k, i), 0.0))
    return out


class MemoryDelta(NamedTuple):
    at_start: float  # allocation when the op starts (>= 0)
    at_end: float  # release when the op ends (<= 0)


def memory_delta(problem: Problem, op: Op, choice: Choice) -> MemoryDelta:
    s = problem.stages[op.stage]
    match op.kind:
        case Kind.F:
            return MemoryDelta(s.checkpoint_mib if choice.recompute else s.activation_mib, 0.0)
        case Kind.B:
            return MemoryDelta(problem.output_grad_of(op.stage), -(s.activation_mib - s.weight_grad_mib))
        case Kind.W:
            return MemoryDelta(0.0, -(s.weight_grad_mib + problem.output_grad_of(op.stage)))
        case Kind.BW:
            return MemoryDelta(0.0, -s.activation_mib)
        case Kind.OFFLOAD:
            return MemoryDelta(0.0, -s.offloadable_mib)
        case Kind.RELOAD:
            return MemoryDelta(s.offloadable_mib, 0.0)
        case Kind.RECOMPUTE:
            return MemoryDelta(s.activation_mib - s.checkpoint_mib, 0.0)
    raise ValueError(op.kind)


def residue_mib(problem: Problem, stage: int) -> float:
    """The least memory an activation of `stage` can hold while it waits for its backward."""
    s = problem.stages[stage]
    least = s.activation_mib
    if problem.options.offload:
        least = min(least, s.activation_mib - s.offloadable_mib)
    if problem.options.recompute:
        least = min(least, s.checkpoint_mib)
    return least


def choices_from_ops(problem: Problem, ops: list[Op]) -> tuple[dict[tuple[int, int], Choice], list[str]]:
    """Derive each (stage, mb)'s Choice from the ops present; report every inconsistency found.

    The problem's op set is not fixed in advance (B+W or BW, offload, recompute are choices), so it is
    read back from what a plan or a schedule contains and checked against docs/formats.md's rules.
    """
    present: dict[tuple[int, int], dict[Kind, int]] = {}
    errors: list[str] = []
    stages, microbatches = range(problem.num_stages), range(problem.num_microbatches)
    for op in ops:
        if not (op.stage in stages and op.mb in microbatches):
            errors.append(f"{op}: no such stage or microbatch in the problem")
            continue
        kinds = present.setdefault((op.stage, op.mb), {})
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    opts = problem.options
    # the common shapes, checked by one set comparison each (the full rules run only for the rest)
    from_kinds = {frozenset(op.kind for op in ops_of(0, 0, c)): c for c in _choices_allowed(opts)}
    choices: dict[tuple[int, int], Choice] = {}
    for k in stages:
        for i in microbatches:
            kinds = present.get((k, i), {})
            choice = from_kinds.get(frozenset(kinds)) if len(kinds) == sum(kinds.values()) else None
            choices[(k, i)] = choice if choice is not None else _checked_choice(k, i, kinds, opts, errors)
    return choices, errors


def _choices_allowed(opts) -> list[Choice]:
    """Every choice the options permit."""
    splits = (True, False) if opts.split_backward else (False,)
    out = []
    for split in splits:
        out.append(Choice(split))
        if opts.offload:
            out.append(Choice(split, offload=True))
        if opts.recompute:
            out.append(Choice(split, recompute=True))
    return out


def _checked_choice(k: int, i: int, kinds: dict[Kind, int], opts, errors: list[str]) -> Choice:
    """The choice of an op set that is not one of the allowed shapes, with every reason appended."""
    where = f"stage {k}, mb {i}"
    for kind, count in kinds.items():
        if count > 1:
            errors.append(f"{kind.value}({where}) appears {count} times")
    split = Kind.B in kinds or Kind.W in kinds
    offload = Kind.OFFLOAD in kinds or Kind.RELOAD in kinds
    recompute = Kind.RECOMPUTE in kinds
    if Kind.F not in kinds:
        errors.append(f"F({where}) is missing")
    if split and Kind.BW in kinds:
        errors.append(f"({where}) has both BW and B/W")
    if split and not (Kind.B in kinds and Kind.W in kinds):
        errors.append(f"({where}) has only one of B and W")
    if not split and Kind.BW not in kinds:
        errors.append(f"({where}) has no backward (B+W or BW)")
    if split and not opts.split_backward:
        errors.append(f"({where}) splits B and W but options.split_backward is false")
    if offload and not (Kind.OFFLOAD in kinds and Kind.RELOAD in kinds):
        errors.append(f"({where}) has OFFLOAD without RELOAD or the reverse")
    if offload and not opts.offload:
        errors.append(f"({where}) offloads but options.offload is false")
    if recompute and not opts.recompute:
        errors.append(f"({where}) recomputes but options.recompute is false")
    if offload and recompute:
        errors.append(f"({where}) both offloads and recomputes")
    return Choice(split=split, offload=offload, recompute=recompute)
