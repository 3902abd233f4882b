"""The engine gives up once it starts an op after `give_up_after`: the greedy drops any variant whose
own timing ends past the best plan's (plus its slack), so the rest of such a run is wasted time."""

from __future__ import annotations

from core_schedules import make_problem
from pipeplan.planner.baselines.engine import EngineConfig, run_engine


def test_the_engine_gives_up_only_past_its_horizon():
    problem = make_problem(4, 8, p2p=0.1, b=1.3, w=0.7)
    cfg = EngineConfig(split=True, cap=[4, 3, 2, 1])
    full = run_engine(problem, cfg)
    assert full is not None
    end = full.engine_timing.makespan
    last_start = max(start for start, _ in full.engine_timing.times.values())
    assert run_engine(problem, cfg, give_up_after=last_start - 1e-6) is None
    same = run_engine(problem, cfg, give_up_after=end)
    assert same is not None
    assert [d.compute for d in same.devices] == [d.compute for d in full.devices]
    assert same.engine_timing.times == full.engine_timing.times
