"""Small hand-written problems and schedules for the core tests (independent of planner.baselines).

They use only the lead's simulator, so the core modules are tested without the heuristics built on
them: a serialized schedule (one microbatch at a time, every activation at its residue), and plain
1F1B / GPipe orders.
"""

from __future__ import annotations

import random
from typing import Any

from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import DeviceOrder, Gate, Schedule, build_plan, simulate


def stage(device: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, **extra: Any) -> dict:
    return {"device": device, "forward_ms": f, "backward_input_ms": b, "backward_weight_ms": w,
            "activation_mib": extra.pop("activation_mib", 100.0), **extra}


def problem_doc(p: int = 2, m: int = 2, *, chunks: int = 1, placement: str = "loop", p2p: float = 0.0,
                split: bool = True, offload: bool = False, recompute: bool = False,
                limit: float | None = None, static: float = 0.0, **stage_fields: Any) -> dict:
    """A uniform problem v1 document; 'v' placement puts stage k and 2P-1-k on one device."""
    devices = []
    for k in range(p * chunks):
        c, r = divmod(k, p)
        devices.append(p - 1 - r if placement == "v" and c % 2 else r)
    fields = dict(stage_fields)
    if offload:
        fields.setdefault("offload_ms", 0.5)
        fields.setdefault("offloadable_mib", 80.0)
    if recompute:
        fields.setdefault("checkpoint_mib", 10.0)
    return {
        "format": "pipeplan.problem/v1", "num_devices": p, "num_microbatches": m, "p2p_ms": p2p,
        "options": {"split_backward": split, "offload": offload, "recompute": recompute},
        "stages": [stage(d, **fields) for d in devices],
        "devices": [{"memory_limit_mib": limit, "static_mib": static} for _ in range(p)],
    }


def make_problem(*args: Any, **kw: Any) -> Problem:
    """`problem_doc(...)` validated; make_problem(4, 8) is P=4, M=8."""
    return Problem.model_validate(problem_doc(*args, **kw))


def uneven_forwards(rng: random.Random) -> Problem:
    """A small random problem whose forwards differ by stage, so upstream stages can starve a device
    (the arrival argument's family, planner/bounds/arrivals.py); no memory limit."""
    doc = problem_doc(p=rng.choice([2, 3]), m=rng.choice([2, 3, 4]), chunks=rng.choice([1, 2, 2]),
                      placement=rng.choice(["loop", "v"]), split=rng.random() < 0.8,
                      b=rng.choice([1.0, 1.5]), w=rng.choice([0.5, 1.0]), p2p=rng.choice([0.0, 0.1]))
    for stage_doc in doc["stages"]:
        stage_doc["forward_ms"] = rng.choice([0.5, 1.0, 2.0, 3.0])
    return Problem.model_validate(doc)


def slow_copies_chunked(rng: random.Random) -> Problem:
    """A small random problem with two stages per device, copies slower than forwards and a heavy
    last stage that cannot be offloaded, at 1-2x the least memory: where the copies that have ended
    by a device's last forward before its first backward decide how many forwards fit
    (planner/bounds/chunk_warmup.py's family)."""
    p = rng.choice([2, 3])
    doc = problem_doc(p, rng.choice([3, 4, 5]), chunks=2, placement=rng.choice(["v", "loop"]),
                      offload=True, recompute=rng.random() < 0.5, split=rng.random() < 0.7,
                      offload_ms=rng.choice([1.0, 1.5, 2.0, 3.0]))
    for stage_doc in doc["stages"]:
        stage_doc["forward_ms"] = rng.choice([0.5, 1.0, 1.5])
        stage_doc["activation_mib"] = rng.choice([60.0, 100.0, 150.0])
        stage_doc["offloadable_mib"] = stage_doc["activation_mib"] * rng.choice([0.8, 1.0])
    doc["stages"][-1].update(activation_mib=rng.choice([200.0, 300.0]), offloadable_mib=0.0)
    return at_least_memory_times(doc, [rng.choice([1.0, 1.2, 1.5, 2.0]) for _ in range(p)])


def one_activation_at_a_time(rng: random.Random) -> Problem:
    """A small random problem with one stage per device, some devices holding one activation at a
    time beside checkpoints or weight gradients, recompute and offload on or off: where every
    schedule recomputes or copies most microbatches there (planner/bounds/backward_stretches.py's
    family)."""
    p = rng.choice([2, 3, 4])
    doc = problem_doc(p, rng.choice([3, 4, 5, 6]), split=rng.random() < 0.8, offload=rng.random() < 0.5,
                      recompute=rng.random() < 0.8, w=rng.choice([0.5, 1.0]), p2p=rng.choice([0.0, 0.1]),
                      weight_grad_mib=rng.choice([0.0, 40.0, 80.0]), checkpoint_mib=rng.choice([0.0, 5.0]),
                      offload_ms=rng.choice([0.5, 1.0, 2.0]))
    for stage_doc in doc["stages"]:
        stage_doc["forward_ms"] = rng.choice([0.5, 1.0, 1.5])
        stage_doc["recompute_ms"] = stage_doc["forward_ms"] * rng.choice([0.5, 1.0])
    shares = [rng.choice([1.0, 1.2, 1.5]) if rng.random() < 0.6 else 3.0 for _ in range(p)]
    return at_least_memory_times(doc, shares)


def at_least_memory_times(doc: dict, shares: list[float]) -> Problem:
    """`doc` validated with device d's memory limit at shares[d] x the least it needs (min_memory)."""
    need = min_memory(Problem.model_validate(doc))
    for d, dev in enumerate(doc["devices"]):
        dev["memory_limit_mib"] = shares[d] * need[d]
    return Problem.model_validate(doc)


def _backward(problem: Problem, k: int, i: int) -> list[Op]:
    if problem.options.split_backward:
        return [Op(Kind.B, k, i), Op(Kind.W, k, i)]
    return [Op(Kind.BW, k, i)]


def one_f_one_b(problem: Problem) -> Schedule:
    """1F1B for one stage per device: P-d-1 warm-up forwards, then alternate, then drain."""
    p, m = problem.num_devices, problem.num_microbatches
    assert problem.chunks == 1
    devices = []
    for d in range(p):
        k = problem.stages_of(d)[0]
        warm = min(m, p - d - 1)
        order = [Op(Kind.F, k, i) for i in range(warm)]
        for i in range(m):
            if warm + i < m:
                order.append(Op(Kind.F, k, warm + i))
            order += _backward(problem, k, i)
        devices.append(DeviceOrder(compute=order))
    return Schedule(devices)


def gpipe(problem: Problem) -> Schedule:
    """All forwards, then all backwards, per device (one stage per device)."""
    devices = []
    for d in range(problem.num_devices):
        k = problem.stages_of(d)[0]
        order = [Op(Kind.F, k, i) for i in range(problem.num_microbatches)]
        for i in range(problem.num_microbatches):
            order += _backward(problem, k, i)
        devices.append(DeviceOrder(compute=order))
    return Schedule(devices)


def serialized(problem: Problem) -> Schedule:
    """One microbatch at a time; each stage's activation reduced to its residue while it waits.

    This is the schedule behind bounds.min_memory's tightness claim: a stage that is not the last of
    its device on the way down offloads (gated so the next forward waits for the copy) or
    recomputes, whichever leaves less resident, when the options allow it.
    """
    s, m = problem.num_stages, problem.num_microbatches
    orders = [DeviceOrder() for _ in range(problem.num_devices)]
    gates: list[Gate] = []
    for i in range(m):
        mode: dict[int, str] = {}
        for k in range(s):
            st = problem.stages[k]
            keep = st.activation_mib
            off = st.activation_mib - st.offloadable_mib if problem.options.offload else keep
            rec = st.checkpoint_mib if problem.options.recompute else keep
            mode[k] = "offload" if off < min(keep, rec) else "recompute" if rec < keep else "keep"
        for k in range(s):
            d = problem.stages[k].device
            orders[d].compute.append(Op(Kind.F, k, i))
            if mode[k] == "offload":
                orders[d].d2h.append(Op(Kind.OFFLOAD, k, i))
                if k + 1 < s:  # the next forward waits for the copy, so the freed memory is reused
                    gates.append(Gate(Op(Kind.F, k + 1, i), Op(Kind.OFFLOAD, k, i), at_end=True))
        for k in reversed(range(s)):
            d = problem.stages[k].device
            # reload / recompute only once this device's later stages have freed their memory
            # (and just in time: after the backward it waits for)
            freed = [_backward(problem, j, i)[-1] for j in range(k + 1, s) if problem.stages[j].device == d]
            freed += [_backward(problem, k + 1, i)[0]] if k + 1 < s else []
            if mode[k] == "offload":
                orders[d].h2d.append(Op(Kind.RELOAD, k, i))
                gates += [Gate(Op(Kind.RELOAD, k, i), op, at_end=True) for op in freed]
            if mode[k] == "recompute":
                orders[d].compute.append(Op(Kind.RECOMPUTE, k, i))
                if k + 1 < s:  # just in time, not right after the forward
                    gates.append(Gate(Op(Kind.RECOMPUTE, k, i), _backward(problem, k + 1, i)[0], at_end=True))
            orders[d].compute += _backward(problem, k, i)
        if i + 1 < m:  # the next microbatch starts when this one is completely done
            gates.append(Gate(Op(Kind.F, 0, i + 1), _backward(problem, 0, i)[-1], at_end=True))
    return Schedule(orders, gates)


def plan_of(problem: Problem, schedule: Schedule, method: str = "test") -> Plan:
    return build_plan(problem, schedule, simulate(problem, schedule), method)
