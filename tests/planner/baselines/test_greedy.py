"""The greedy's attempts and passes (planner/baselines/attempts.py, passes.py, treatments.py): typed
attempts whose labels and engine settings are derived, and each pass of PASSES on a case it was
built for."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from core_schedules import at_least_memory_times, make_problem, problem_doc
from pipeplan.planner.baselines import best_heuristic, greedy
from pipeplan.planner.baselines.attempts import Attempt, Await, engine_variants
from pipeplan.planner.baselines.engine import run_engine
from pipeplan.planner.baselines.passes import (
    PASSES,
    Search,
    exclusive_orders,
    forward_pipe_depths,
    paces,
)
from pipeplan.planner.baselines.treatments import (
    PLAIN,
    Reduce,
    Treatment,
    crowded,
    reducing_treatments,
    stage_treat,
)
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.validator import validate_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for bench/

from bench.model_suite import find
from bench.models import rows_of


def attempts_of(name: str, problem: Problem, **state) -> list[Attempt]:
    """The attempts pass `name` makes from `state` (Search's fields), where it applies."""
    search = Search(problem, greedy.treatments(problem, False), **state)
    step = next(p for p in PASSES if p.name == name)
    return step.attempts(search) if step.applies(search) else []


def variant(problem: Problem, label: str):
    return next(v for v in engine_variants(problem) if v.label == label)


# -- attempts ----------------------------------------------------------------------------------------
def test_labels_are_derived_from_the_attempt():
    problem = make_problem(4, 16, chunks=2, placement="v", offload=True, recompute=True, limit=500.0)
    tight = variant(problem, "mid,fill,late,tight")
    offload = Treatment(Reduce.OFFLOAD, lambda k, i: "offload", eager=True)
    attempt = Attempt(offload, tight, pace=paces(problem)[0], awaits=Await.AND_LATER_FORWARD, yields=True)
    assert attempt.label == "greedy(mid,fill,late,tight,pace 2x,await B+F,W yields, offload, eager)"
    assert Attempt(PLAIN, tight, held=True).label == "greedy(mid,fill,late,tight,held)"
    assert Treatment(Reduce.FRACTIONAL, slack=0.4).label == "fractional 0.4"
    one = make_problem(4, 8, offload=True, limit=500.0)
    assert Attempt(PLAIN, variant(one, "1f1b,lean"), busiest=(1, 5)).label == "greedy(1f1b, busiest 2x,lean)"
    unsplit = make_problem(4, 8, split=False)
    assert [v.label for v in engine_variants(unsplit)] == ["1f1b", "2x"]


def test_the_engine_settings_are_derived_from_the_attempt():
    problem = make_problem(4, 8, offload=True, limit=500.0)
    base = variant(problem, "1f1b,lean")
    treat = Treatment(Reduce.OFFLOAD, lambda k, i: "offload", eager=True)
    cfg = Attempt(treat, base, busiest=(1, 5), awaits=Await.FIRST_BACKWARD, yields=True).config(problem)
    assert list(cfg.forwards.cap) == [4, 5, 2, 1]
    assert cfg.forwards.await_first_backward and not cfg.forwards.await_later_forward
    assert cfg.weights.yields and cfg.weights.lag == (10**9,) * 4
    assert cfg.memory.treat is treat.treat and cfg.memory.reserve_after_copies and cfg.memory.reload_in_turn
    assert list(cfg.memory.limits) == [500.0] * 4 and cfg.fixed is None
    plain = Attempt(PLAIN, base).config(problem)
    assert not (plain.weights.yields or plain.forwards.await_first_backward)
    assert not plain.memory.reserve_after_copies


def test_the_passes_run_in_their_order_and_the_inline_run_skips_the_solvers():
    assert [p.name for p in PASSES] == ["grid", "await", "paced", "await", "held", "await", "busiest",
                                        "exclusive", "yielding"]
    assert [p.name for p in PASSES if not p.solver_only] == ["grid", "await", "await", "await"]


# -- treatments -------------------------------------------------------------------------------------
def head_heavy_v(m: int = 8) -> Problem:
    """V placement on 4 devices; the last stage (device 0) holds 4x the others' activation, and
    device 0 has just room for it and checkpoints: stage 0's activation cannot sit beside it. Copies
    take 3 forwards, so an offloaded activation of stage 0 crowds out the head."""
    doc = problem_doc(p=4, m=m, chunks=2, placement="v", offload=True, recompute=True)
    last = doc["stages"][-1]
    last["activation_mib"] *= 4
    last["offloadable_mib"] = last["activation_mib"]
    for s in doc["stages"]:
        s["offload_ms"] = 3.0 * s["forward_ms"]
        s["reload_ms"] = 3.0 * s["forward_ms"]
    return at_least_memory_times(doc, [1.05, 2.0, 2.0, 2.0])


def test_crowded_names_only_the_stage_beside_the_head():
    problem = head_heavy_v()
    assert [k for k in range(problem.num_stages) if crowded(problem, k)] == [0]
    treat = stage_treat(problem, Reduce.CROWDED)
    assert treat is not None
    assert treat(0, 3) == "recompute"
    assert treat(1, 3) == "offload"


def test_no_crowded_treatment_where_nothing_is_crowded():
    doc = problem_doc(p=4, m=8, chunks=2, placement="v", offload=True, recompute=True)
    problem = Problem.model_validate(doc)
    assert not any(crowded(problem, k) for k in range(problem.num_stages))
    assert all(t.reduce is not Reduce.CROWDED for t in reducing_treatments(problem))


def test_crowded_treatment_is_valid_and_beats_offloading_everything():
    problem = head_heavy_v()

    def best_of(reduce: Reduce) -> float:
        spans = []
        for eager in (False, True):
            for v in engine_variants(problem):
                treatment = Treatment(reduce, stage_treat(problem, reduce), eager)
                out = greedy.run_try(problem, Attempt(treatment, v))
                if out is not None:
                    plan = out.plan()
                    assert validate_plan(problem, plan) == []
                    spans.append(plan.makespan_ms)
        return min(spans)

    crowd, offload = best_of(Reduce.CROWDED), best_of(Reduce.OFFLOAD)
    assert crowd < offload
    best = best_heuristic(problem)
    assert validate_plan(problem, best) == []
    assert best.makespan_ms <= crowd + 1e-9


# -- await --------------------------------------------------------------------------------------------
def test_await_takes_the_late_attempts_of_the_two_best_treatments_fastest_first():
    problem = make_problem(4, 8, chunks=2, placement="v")
    v1, v2 = (variant(problem, label) for label in ("mid,fill,late,tight", "mem,fill,late,tight"))
    a, b, c = Treatment(Reduce.OFFLOAD), Treatment(Reduce.OFFLOAD, eager=True), PLAIN
    late = [(12.0, Attempt(a, v1)), (10.0, Attempt(b, v1)), (11.0, Attempt(c, v1)),
            (math.inf, Attempt(b, v2)), (9.5, Attempt(a, v2))]
    tries = attempts_of("await", problem, late=late)
    assert [(t.treatment, t.variant, t.awaits) for t in tries] == [
        (a, v2, Await.FIRST_BACKWARD), (a, v2, Await.AND_LATER_FORWARD),
        (b, v1, Await.FIRST_BACKWARD), (b, v1, Await.AND_LATER_FORWARD),
        (a, v1, Await.FIRST_BACKWARD), (a, v1, Await.AND_LATER_FORWARD),
        (b, v2, Await.FIRST_BACKWARD), (b, v2, Await.AND_LATER_FORWARD)]


# -- paced ---------------------------------------------------------------------------------------------
def test_forward_pipe_depths_count_periods_from_first_to_last_stage():
    # V, P=4, F=B=W=1, 0.1-ms links: a device's period is 2 x 3 = 6 ms; device 0's pipe runs stages
    # 1..6 (6 ms of forwards, 7 links = 6.7 ms), device 3 holds stages 3 and 4 back to back (0 ms)
    problem = make_problem(4, 16, chunks=2, placement="v", p2p=0.1)
    assert forward_pipe_depths(problem) == [2, 1, 1, 1]
    assert [(p.label, list(p.per_device)) for p in paces(problem)] == [
        ("pace 2x", [4, 2, 2, 2]), ("pace 3x", [6, 3, 3, 3]), ("pace 2x deepest", [4, 4, 4, 4])]


def test_paced_attempts_only_where_memory_needs_offload_or_recompute():
    v = make_problem(4, 16, chunks=2, placement="v", offload=True, recompute=True, limit=500.0)
    tries = attempts_of("paced", v)
    assert tries and all(t.treatment.treat is not None and t.pace is not None for t in tries)
    assert all(t.variant.w.name == "fill" and not t.variant.reserve and t.variant.late for t in tries)
    assert len({t.label for t in tries}) == len(tries)
    unlimited = make_problem(4, 16, chunks=2, placement="v", offload=True, recompute=True)
    assert attempts_of("paced", unlimited) == []
    assert attempts_of("paced", make_problem(4, 16, offload=True, recompute=True, limit=300.0)) == []


def test_the_solvers_greedy_finds_a_paced_plan_the_unpaced_attempts_miss():
    """V, P=4, M=16 at 1.3x the least memory each device needs: activations must be offloaded or
    recomputed, and unpaced the devices fill up with first-chunk forwards."""
    doc = problem_doc(p=4, m=16, chunks=2, placement="v", offload=True, recompute=True, p2p=0.1, b=1.3, w=0.7)
    for s in doc["stages"]:
        s["offload_ms"] = 1.0
    problem = at_least_memory_times(doc, [1.3] * 4)
    grid = greedy.greedy_tries(problem, greedy.treatments(problem, False))
    unpaced = [greedy.run_try(problem, a) for a in grid]
    best_unpaced = min((o.makespan for o in unpaced if o is not None), default=math.inf)
    inline = greedy.greedy_outcome(problem)
    solver = greedy.greedy_outcome(problem, inline=False)
    assert "pace" in solver.method and "pace" not in inline.method
    assert solver.makespan < 0.7 * min(best_unpaced, inline.makespan), (solver.makespan, best_unpaced)


# -- held ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_v_half() -> Problem:
    """Llama-3-8B in V placement over 8 GPUs at half 1F1B's memory: the LM head's activation fills
    97% of device 0's free memory beside the embedding stage."""
    [row] = [r for r in rows_of(replace(find("llama3-8b-p8-v"), one_gpu_per_stage=True)) if r.share == 0.5]
    return row.problem()


def crowded_attempt(problem: Problem, held: bool) -> Attempt:
    [treatment] = [t for t in reducing_treatments(problem) if t.reduce is Reduce.CROWDED and not t.eager]
    return Attempt(treatment, variant(problem, "mem,fill,late,tight"), held=held)


def allocations_while_the_head_waits(problem: Problem, held: bool) -> int:
    """Recomputes and reloads on the head's device that start after a head forward's input has
    arrived and before that forward starts (each then holds memory the head needs)."""
    schedule = run_engine(problem, crowded_attempt(problem, held).config(problem))
    assert schedule is not None
    times = schedule.engine_timing.times  # type: ignore[attr-defined]
    z = problem.num_stages - 1
    head_device = problem.stages[z].device
    count = 0
    for i in range(problem.num_microbatches):
        arrival = times[Op(Kind.F, z - 1, i)][1] + problem.link_ms(z - 1, z)
        start = times[Op(Kind.F, z, i)][0]
        count += sum(1 for op, (begin, _) in times.items()
                     if op.kind in (Kind.RECOMPUTE, Kind.RELOAD)
                     and problem.stages[op.stage].device == head_device and arrival <= begin < start - 1e-9)
    return count


def test_nothing_takes_the_heads_room_while_its_forward_waits(llama_v_half):
    assert allocations_while_the_head_waits(llama_v_half, held=True) == 0
    assert allocations_while_the_head_waits(llama_v_half, held=False) > 0  # what the hold prevents


def test_the_held_attempt_fits_where_the_plain_one_does_not(llama_v_half):
    assert greedy.run_try(llama_v_half, crowded_attempt(llama_v_half, held=False)) is None
    held = greedy.run_try(llama_v_half, crowded_attempt(llama_v_half, held=True))
    assert held is not None and held.makespan < 6_450.0  # the first plan is 6,563 ms


def test_held_only_where_the_head_is_a_large_share_of_its_devices_memory(llama_v_half):
    tries = attempts_of("held", llama_v_half)
    assert tries and all(t.held and t.variant.late for t in tries)
    roomy = llama_v_half.devices[0].model_copy(update={"memory_limit_mib": 4 * llama_v_half.limit_of(0)})
    bigger = llama_v_half.model_copy(update={"devices": [roomy, *llama_v_half.devices[1:]]})
    assert attempts_of("held", bigger) == []


# -- busiest -------------------------------------------------------------------------------------------
def heavy_middle(heavy: float = 1.5, stage: int = 1) -> Problem:
    """P=6, M=8, one stage `heavy` times the others, its device at 1.6x its least memory."""
    doc = problem_doc(p=6, m=8, offload=True, recompute=True, offload_ms=1.5)
    for name in ("forward_ms", "backward_input_ms", "backward_weight_ms"):
        doc["stages"][stage][name] *= heavy
    return at_least_memory_times(doc, [1.6 if d == stage else 3.2 for d in range(6)])


def test_only_the_busiest_stage_gets_twice_one_f_one_b_cap():
    problem = heavy_middle()
    tries = attempts_of("busiest", problem)
    assert tries and all("busiest 2x" in t.label for t in tries)
    one_f_one_b = [6 - k for k in range(6)]
    for t in tries:
        cap = list(t.config(problem).forwards.cap)
        assert cap == [2 * 5 - 1 if k == 1 else c for k, c in enumerate(one_f_one_b)]


def test_no_busiest_attempts_without_a_clear_middle_bottleneck():
    for problem in (heavy_middle(heavy=1.02), heavy_middle(stage=5),
                    make_problem(4, 16, chunks=2, placement="v", offload=True, limit=500.0)):
        assert attempts_of("busiest", problem) == []


def test_the_solvers_greedy_takes_a_busiest_attempt_where_it_is_faster():
    problem = heavy_middle()
    solver = greedy.greedy_outcome(problem, inline=False)
    assert "busiest 2x" in solver.method
    assert solver.makespan < greedy.greedy_outcome(problem).makespan


# -- exclusive -----------------------------------------------------------------------------------------
def one_tight_device(share: float, p: int = 4, m: int = 8) -> Problem:
    """Uniform P, M (F=1, B=1.5, W=0.5, activations of 100 MiB, checkpoints of 10, recompute allowed);
    device P-2 at `share` x its least memory, the others roomy."""
    doc = problem_doc(p=p, m=m, recompute=True, p2p=0.05, b=1.5, w=0.5, weight_grad_mib=60.0)
    shares = [10.0] * p
    shares[p - 2] = share
    return at_least_memory_times(doc, shares)


def test_groups_of_one_kept_and_q_recomputed_microbatches_only_where_one_activation_fits():
    problem = one_tight_device(1.3)
    orders = exclusive_orders(problem)
    # stage 2's round trip (the last stage's F and B, two links) is 2.6 forwards: q = 2, then 3
    assert [o.label for o in orders] == ["exclusive q=2", "exclusive q=3"]
    assert orders[0].orders[2][:5] == [Op(Kind.F, 2, 0), Op(Kind.F, 2, 1), Op(Kind.F, 2, 2), Op(Kind.B, 2, 0),
                                       Op(Kind.W, 2, 0)]
    assert orders[0].recomputed == {(2, i) for i in range(8) if i % 3}
    assert exclusive_orders(one_tight_device(2.5)) == []  # two activations fit
    options = problem.options.model_copy(update={"recompute": False})
    no_recompute = problem.model_copy(update={"options": options})
    assert exclusive_orders(no_recompute) == []


def test_the_solvers_greedy_fills_the_kept_round_trip_with_recomputed_forwards():
    problem = one_tight_device(1.3)
    inline = greedy.greedy_outcome(problem)  # no fixed orders there
    solver = greedy.greedy_outcome(problem, inline=False)
    assert "exclusive" in solver.method
    assert solver.makespan == pytest.approx(35.2)
    assert inline.makespan >= 38.0


# -- yielding -----------------------------------------------------------------------------------------
def test_yielding_reruns_the_fastest_attempts():
    problem = make_problem(4, 8)
    attempts = [Attempt(PLAIN, variant(problem, "1f1b,lean"), busiest=(1, n)) for n in range(12)]
    ranked = [(float(100 - n), a) for n, a in enumerate(attempts)]
    tries = attempts_of("yielding", problem, ranked=ranked)
    assert [t.busiest for t in tries] == [(1, n) for n in range(11, 3, -1)]
    assert all(t.yields for t in tries)
