"""The solver's widened greedy streams its bests (planner/solver/api.py `_widen_greedy`), on the row
that caught a filter on the wrong makespan: DeepSeek-like V on 8 GPUs at 70% of 1F1B's memory, where
a plan re-timed once its unneeded recomputes are dropped is far faster than its engine run said."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.model_suite import find  # noqa: E402
from bench.models import rows_of  # noqa: E402
from planner.baselines.greedy import greedy_outcome, inline_runs  # noqa: E402
from planner.solver.api import _widen_greedy  # noqa: E402
from planner.solver.incumbent import Incumbent  # noqa: E402


def test_the_incumbent_gets_every_streamed_plan_at_its_own_makespan():
    [row] = [r for r in rows_of(find("deepseek-small-mtp-p8-v")) if r.share == 0.7]
    problem = row.problem()
    key = problem.key()
    streamed = []
    final = greedy_outcome(problem, inline=False, skip=inline_runs(problem), on_better=streamed.append)
    best_plan = min(o.plan(key).makespan_ms for o in streamed)
    assert best_plan < final.makespan - 1.0  # the engine's own timing overstates it here
    inc = Incumbent(problem, key, None)
    notes: list[str] = []
    _widen_greedy(problem, key, inc, lambda: True, notes)
    assert not notes
    assert inc.makespan <= best_plan + 1e-6
