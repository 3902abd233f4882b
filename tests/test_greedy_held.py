"""Room held for the last stage's forwards (EngineConfig.hold_last, greedy.held_tries), on the case it
was built for: Llama-3-8B in V placement over 8 GPUs at half 1F1B's memory, where the LM head's
activation fills 97% of device 0's free memory beside the embedding stage."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeplan.planner.baselines import greedy  # noqa: E402
from pipeplan.planner.baselines.engine import run_engine  # noqa: E402
from pipeplan.planner.contract import Problem  # noqa: E402
from pipeplan.planner.ops import Kind, Op  # noqa: E402

from bench.model_suite import find  # noqa: E402
from bench.models import rows_of  # noqa: E402

VARIANT, TREATMENT = "mem,fill,late,tight", "offload, crowded recompute"


@pytest.fixture(scope="module")
def llama_v_half() -> Problem:
    [row] = [r for r in rows_of(replace(find("llama3-8b-p8-v"), one_gpu_per_stage=True)) if r.share == 0.5]
    return row.problem()


def _attempt(problem: Problem, hold: bool) -> greedy.Attempt:
    treat, eager = {name: (t, e) for name, t, e in greedy.treatments(problem, False)}[TREATMENT]
    cfg = dict(greedy.engine_variants(problem))[VARIANT]
    return greedy.Attempt(TREATMENT, treat, eager, VARIANT, replace(cfg, hold_last=hold))


def _allocations_while_the_head_waits(problem: Problem, hold: bool) -> int:
    """Recomputes and reloads on the head's device that start after a head forward's input has
    arrived and before that forward starts (each then holds memory the head needs)."""
    attempt = _attempt(problem, hold)
    schedule = run_engine(problem, replace(attempt.config, treat=attempt.treat, reload_in_turn=True,
                                           reserve_after_copies=attempt.eager))
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
    assert _allocations_while_the_head_waits(llama_v_half, hold=True) == 0
    assert _allocations_while_the_head_waits(llama_v_half, hold=False) > 0  # what the hold prevents


def test_the_held_variant_fits_where_the_plain_one_does_not(llama_v_half):
    held = greedy.run_try(llama_v_half, _attempt(llama_v_half, hold=True))
    plain = greedy.run_try(llama_v_half, _attempt(llama_v_half, hold=False))
    assert plain is None
    assert held is not None and held.makespan < 6_450.0  # the first plan is 6,563 ms


def test_held_tries_only_where_the_head_is_a_large_share_of_its_devices_memory(llama_v_half):
    treats = greedy.treatments(llama_v_half, False)
    tries = greedy.held_tries(llama_v_half, treats)
    assert tries and all(t.config.hold_last and t.config.prefer_late_forward for t in tries)
    roomy = llama_v_half.devices[0].model_copy(update={"memory_limit_mib": 4 * llama_v_half.limit_of(0)})
    bigger = llama_v_half.model_copy(update={"devices": [roomy, *llama_v_half.devices[1:]]})
    assert greedy.held_tries(bigger, greedy.treatments(bigger, False)) == []
