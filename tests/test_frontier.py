"""planner.frontier: budgets, monotonicity by construction, peers dominated, queries, the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.frontier import Budgets, compute_frontier, monotone, rekey, view_of
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
    # the low end is the least memory any schedule needs on the tightest device, on every device
    assert set(fr.points[0].limits_mib) == {fr.points[0].budget_mib}
    assert abs(fr.points[0].budget_mib - max(min_memory(problem))) < 1e-3
    spans = [p.makespan_ms for p in fr.points]
    assert all(b <= a + 1e-9 for a, b in zip(spans, spans[1:])), spans
    assert spans[-1] == fr.unlimited_makespan_ms
    for p in fr.points:  # each plan is a plan of its own point's problem, under its own key
        sub = fr.budgets.apply(problem, p.factor)
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
    budgets = Budgets("scaled", [1000.0] * 4, [7000.0] * 4)
    small, large = budgets.apply(problem, 0.2), budgets.apply(problem, 0.6)
    from pipeplan.planner.baselines import best_heuristic

    plan = best_heuristic(small)
    moved = rekey(large, plan)
    assert isinstance(moved, Plan) and moved.problem_key == large.key() and not validate_plan(large, moved)
    wide = best_heuristic(budgets.apply(problem, 10.0))
    if max(wide.peak_memory_mib) > max(small.devices[0].memory_limit_mib, 0):
        assert rekey(small, wide) is None  # does not fit the smaller budget


def test_monotone_envelope_and_queries():
    ms, bd = monotone([10.0, 11.0, 8.0, 9.0], [7.0, 6.0, 7.5, 5.0])
    assert ms == [10.0, 10.0, 8.0, 8.0] and bd == [7.5, 7.5, 7.5, 5.0]
    doc = {"problem_key": "k", "budgets": Budgets("uniform", [0.0], [1024.0]).to_dict(), "static_mib": [0.0],
           "factor_min": 1, "factor_max": 3,
           "unlimited_makespan_ms": 5.0, "peers": [],
           "points": [{"factor": f, "budget_mib": b, "makespan_ms": m} for f, b, m in
                      [(1, 1024.0, 9.0), (2, 2048.0, 7.0), (3, 3072.0, 5.0)]]}
    view = view_of(doc)
    assert view.least_memory(7.5).doc["budget_mib"] == 2048.0
    assert view.least_memory(4.0) is None
    assert view.fastest(2.5 * 1024).doc["makespan_ms"] == 7.0 and view.fastest(512.0) is None


def test_documents_from_before_budget_modes_read_as_scaled():
    """Frontiers stored before budgets had modes carry only free_mib and static_mib."""
    old = {"problem_key": "k", "free_mib": [100.0, 300.0], "static_mib": [50.0, 10.0], "factor_min": 0.5,
           "factor_max": 1.0, "unlimited_makespan_ms": 5.0, "peers": [],
           "points": [{"factor": 1.0, "budget_mib": 310.0, "makespan_ms": 5.0}]}
    view = view_of(old)
    assert view.budgets.mode == "scaled" and view.budgets.limits(0.5) == [100.0, 160.0]
    assert view.fastest(310.0).makespan_ms == 5.0 and view.hbm is None


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


# The two cases of issue 38: a 128k vocabulary puts a heavy embedding and LM head on the first and last
# devices, so per-device free memory is uneven and a factor of it is not a cap per GPU.
SPECS = Path(__file__).resolve().parents[1] / "examples" / "specs"


@pytest.mark.parametrize("spec", ["llama3_8b_8xh100_40gib.json", "phi3_mini_8xh100_15gib.json"])
def test_every_peer_is_dominated_in_gib_per_gpu(spec):
    """Each peer's plan against the frontier's fastest point whose every device limit is at most the
    peer's largest device peak: read from the plans and limits themselves, not from dominance()."""
    from pipeplan.planner.documents import problem_from_document

    problem = problem_from_document(json.loads((SPECS / spec).read_text()))
    fr = compute_frontier(problem, points=2, time_limit_s=0.0, solve_fn=_solve_nothing)
    assert fr.budgets.mode == "uniform" and len({p.factor for p in fr.peers}) > 3
    for p in fr.points:
        assert len(set(p.limits_mib)) == 1 and max(p.plan.peak_memory_mib) <= p.limits_mib[0] + 1e-6
    for peer in fr.peers:
        per_gpu = max(peer.plan.peak_memory_mib)
        within = [p.makespan_ms for p in fr.points if p.limits_mib[0] <= per_gpu + 1e-6]
        assert within and min(within) <= peer.plan.makespan_ms + 1e-6, (peer.name, per_gpu / 1024, within)
    assert all(d["dominated"] for d in fr.dominance())
    if spec.startswith("llama3"):  # the issue's queries: zb-h1 runs 6,957 ms within 73.9 GiB on every GPU
        zb_h1 = next(p for p in fr.peers if p.name == "zb-h1")
        assert fr.fastest(74 * 1024).makespan_ms <= zb_h1.makespan_ms + 1e-6
        assert fr.least_memory(zb_h1.makespan_ms + 3).budget_mib <= 74 * 1024


def _issue_plot_doc() -> dict:
    """The shape of issue 38's plot: points within 6,950-7,620 ms and 30-88 GiB per GPU (the last
    beyond an H100's 79.6 GiB), GPipe at 314 GiB and 12,000 ms."""
    from pipeplan.planner.frontier import frontier_document

    gib = 1024.0
    points = [{"factor": b / 79.6, "limits_mib": [b * gib] * 8, "budget_mib": b * gib, "makespan_ms": ms,
               "bound_ms": ms - 20, "problem_key": f"{i:064x}", "method": "m"}
              for i, (b, ms) in enumerate([(30.0, 7620.0), (48.8, 7171.3), (73.9, 6960.0), (87.7, 6956.7)])]
    peers = [{"name": name, "method": name, "peak_mib": [b * gib], "budget_mib": b * gib, "makespan_ms": ms,
              "factor": b / 79.6} for name, b, ms in [("gpipe", 314.1, 12000.0), ("zb-h1", 73.9, 6957.0),
                                                      ("1f1b", 61.8, 7619.7)]]
    return frontier_document("k" * 64, Budgets("uniform", [0.0] * 8, [79.6 * gib] * 8), [0.0] * 8,
                             (79.6 * gib, "H100-80GB"), 30 / 79.6, 87.7 / 79.6, points, peers, 6956.7)


def test_the_plot_spans_the_frontier_marks_the_gpu_memory_and_flags_points_beyond_it():
    from pipeplan.planner.frontier import chart_window
    from pipeplan.planner.frontier_render import render_frontier
    from pipeplan.service.dashboard.frontier import frontier_svg

    doc = _issue_plot_doc()
    assert [p["beyond_hbm"] for p in doc["points"]] == [False, False, False, True]
    win = chart_window(doc)
    assert 25 * 1024 < win.x_mib[0] and win.x_mib[1] < 100 * 1024  # not 0-320 GiB for GPipe's point
    assert 6800 < win.y_ms[0] and win.y_ms[1] < 7800  # not 0-12,000 ms
    assert [q["name"] for q in win.off_chart] == ["gpipe"] and win.hbm_mib == 79.6 * 1024
    svg = render_frontier(doc, "svg").decode()
    assert "GPU memory 79.6 GiB (H100-80GB)" in svg and "beyond the GPU" in svg
    assert "off the chart: gpipe 12,000 ms at 314.1 GiB" in svg
    page = frontier_svg(doc)
    assert page.count('class="point beyond-hbm"') == 1 and 'class="hbm"' in page and "GPU memory 79.6 GiB" in page


def test_a_problem_whose_gpus_have_no_memory_gets_a_frontier_not_an_error():
    """A zero memory limit (nothing to hold: every activation and static 0) gives no unit to scale
    budgets by; the unlimited plan's peak stands in, as for a problem with no limit (found by
    schemathesis: the service answered 503)."""
    problem = Problem.model_validate({
        "num_devices": 1, "num_microbatches": 1, "p2p_ms": 0,
        "devices": [{"memory_limit_mib": 0.0, "static_mib": 0}],
        "options": {"offload": False, "recompute": False, "split_backward": True},
        "stages": [{"device": 0, "forward_ms": 1.0, "backward_input_ms": 1.0, "backward_weight_ms": 0.0,
                    "activation_mib": 0.0}]})
    assert Budgets.of(problem, "uniform", peak_mib=[0.0]).unit_mib == [1.0]
    frontier = compute_frontier(problem, points=2, time_limit_s=1.0, workers=1)
    assert frontier.points and all(p.plan.makespan_ms == 2.0 for p in frontier.points)
