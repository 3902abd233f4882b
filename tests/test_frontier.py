"""planner.frontier: budgets, monotonicity by construction, peers dominated, queries, the CLI."""

from __future__ import annotations

import json
import subprocess

from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Plan
from pipeplan.planner.frontier import compute_frontier, monotone, rekey, scaled, view_of
from pipeplan.planner.validator import validate_plan
from service_support import BIN, make_problem, problem_doc


def _solve_nothing(problem, time_limit_s, on_improvement=None, stop=None, hint=None, problem_key=None, **_):
    """A real solve with no search time: seeds only (keeps the test fast and its curve weak)."""
    from pipeplan.planner.solver import solve

    return solve(problem, 0.0, on_improvement=on_improvement, stop=stop, hint=hint, problem_key=problem_key,
                 workers=1)


def test_frontier_is_monotone_valid_and_dominates_every_peer():
    problem = make_problem(devices=4, microbatches=8, offload=True, limit_mib=8000.0, tag="frontier")
    fr = compute_frontier(problem, points=6, time_limit_s=0.0, solve_fn=_solve_nothing)
    assert len(fr.points) == 6
    factors = [p.factor for p in fr.points]
    assert factors == sorted(factors) and factors[0] == fr.factor_min and factors[-1] == fr.factor_max
    # the low end is the least memory any schedule needs on the tightest device
    assert abs(max(l - m for l, m in zip(fr.points[0].limits_mib, min_memory(problem)))) < 1e-3
    spans = [p.makespan_ms for p in fr.points]
    assert all(b <= a + 1e-9 for a, b in zip(spans, spans[1:])), spans
    assert spans[-1] == fr.unlimited_makespan_ms
    for p in fr.points:  # each plan is a plan of its own point's problem, under its own key
        sub = scaled(problem, fr.free_mib, p.factor)
        assert p.key == sub.key() == p.plan.problem_key and validate_plan(sub, p.plan, p.key) == []
        assert p.bound_ms <= p.makespan_ms + 1e-9
    assert fr.peers and all(d["dominated"] for d in fr.dominance()), fr.dominance()


def test_every_peer_is_dominated_even_with_fewer_points_than_peers():
    """--points is a minimum: each peer's memory gets a point hinted with its plan."""
    problem = make_problem(devices=4, microbatches=8, offload=True, limit_mib=8000.0, tag="frontier")
    fr = compute_frontier(problem, points=2, time_limit_s=0.0, solve_fn=_solve_nothing)
    peer_budgets = {round(p.factor, 6) for p in fr.peers if fr.factor_min < p.factor < fr.factor_max}
    assert len(fr.points) >= 2 + len(peer_budgets) > 2
    assert all(d["dominated"] for d in fr.dominance()), fr.dominance()


def test_a_smaller_budgets_plan_is_rekeyed_into_larger_points_but_not_smaller():
    problem = make_problem(devices=4, microbatches=8, offload=True, limit_mib=8000.0, tag="rekey")
    free = [7000.0] * 4
    small, large = scaled(problem, free, 0.2), scaled(problem, free, 0.6)
    from pipeplan.planner.baselines import best_heuristic

    plan = best_heuristic(small)
    moved = rekey(large, plan)
    assert isinstance(moved, Plan) and moved.problem_key == large.key() and not validate_plan(large, moved)
    wide = best_heuristic(scaled(problem, free, 10.0))
    if max(wide.peak_memory_mib) > max(small.devices[0].memory_limit_mib, 0):
        assert rekey(small, wide) is None  # does not fit the smaller budget


def test_monotone_envelope_and_queries():
    ms, bd = monotone([10.0, 11.0, 8.0, 9.0], [7.0, 6.0, 7.5, 5.0])
    assert ms == [10.0, 10.0, 8.0, 8.0] and bd == [7.5, 7.5, 7.5, 5.0]
    doc = {"problem_key": "k", "free_mib": [1.0], "static_mib": [0.0], "factor_min": 1, "factor_max": 3,
           "unlimited_makespan_ms": 5.0, "peers": [],
           "points": [{"factor": f, "budget_mib": b, "makespan_ms": m} for f, b, m in
                      [(1, 1024.0, 9.0), (2, 2048.0, 7.0), (3, 3072.0, 5.0)]]}
    view = view_of(doc)
    assert view.least_memory(7.5).doc["budget_mib"] == 2048.0
    assert view.least_memory(4.0) is None
    assert view.fastest(2.5 * 1024).doc["makespan_ms"] == 7.0 and view.fastest(512.0) is None


def test_cli_writes_frontier_plot_and_answers_both_queries(tmp_path):
    problem = make_problem(devices=2, microbatches=4, offload=True, limit_mib=4000.0, tag="cli")
    src = tmp_path / "p.json"
    src.write_text(json.dumps(problem_doc(problem)))
    out, png = tmp_path / "f.json", tmp_path / "f.png"
    r = subprocess.run([str(BIN / "pipeplan"), "frontier", str(src), "--points", "4", "--time-limit", "0.5",
                        "--workers", "1", "--out", str(out), "--plot", str(png)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == "pipeplan.frontier/v1" and len(doc["points"]) == 4
    assert png.read_bytes()[:4] == b"\x89PNG" and "point 4:" in r.stderr
    target = doc["points"][1]["makespan_ms"]
    q = subprocess.run([str(BIN / "pipeplan"), "frontier", str(out), "--target-ms", str(target),
                        "--budget-gib", "100"], capture_output=True, text=True, timeout=60)
    assert q.returncode == 0, q.stderr
    assert "least memory for" in q.stdout and doc["points"][1]["problem_key"] in q.stdout or \
        doc["points"][0]["problem_key"] in q.stdout
    assert f"{doc['points'][-1]['makespan_ms']:.2f} ms" in q.stdout.splitlines()[1]
    bad = subprocess.run([str(BIN / "pipeplan"), "frontier", str(out), "--budget-gib", "0.001"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "below the least any schedule needs" in bad.stderr
