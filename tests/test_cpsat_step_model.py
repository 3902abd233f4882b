"""The CP-SAT model a large-neighbourhood step builds: pairs outside the neighbourhood get only the
mode they keep (no literals for presolve to delete), and `tighten` narrows every start to its
precedence window without cutting off any solution no longer than the horizon."""

from __future__ import annotations

from core_schedules import make_problem
from ortools.sat.python import cp_model
from pipeplan.planner.baselines import best_heuristic
from pipeplan.planner.solver import cpsat
from pipeplan.planner.solver.convert import ticks_of_plan
from pipeplan.planner.solver.cpsat_model import CpsatModel, ModelOptions
from pipeplan.planner.solver.scaling import scale_for


def tight_problem():
    return make_problem(p=4, m=8, limit=250.0, offload=True, recompute=True, weight_grad_mib=100.0,
                        b=1.2, w=0.8, p2p=0.05)


def widths(built: CpsatModel) -> int:
    return sum(v.domain[1] - v.domain[0] for v in built.model.proto.variables)


def test_kept_pairs_get_only_their_mode_and_the_hint_stays_feasible():
    problem = tight_problem()
    scale = scale_for(problem)
    starts, choices = ticks_of_plan(problem, best_heuristic(problem), scale)
    moved = {pair for pair, ch in choices.items() if ch.offload or ch.recompute}
    assert moved, "the seed must offload or recompute something for this test to mean anything"
    free = {(k, i) for k in range(problem.num_stages) for i in range(2)}
    kept = {pair: ch for pair, ch in choices.items() if pair not in free}
    horizon = max(starts.values()) + 100
    full = CpsatModel(problem, scale, horizon)
    built = CpsatModel(problem, scale, horizon, fixed=kept)
    for pair, ch in kept.items():
        pv = built.v[pair]
        assert pv.off is None and pv.rc is None and pv.plain is None  # no literal to choose with
        assert (pv.o is not None) == ch.offload and (pv.c is not None) == ch.recompute
    assert len(built.model.proto.variables) < len(full.model.proto.variables)
    values = built.assignment(starts, choices)
    assert values is not None
    built.hint(values)
    built.fix_outside(free, starts)
    assert cpsat.hint_is_feasible(built, seconds=3.0)
    # a solution reads back every kept pair's mode
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.num_workers = 1
    assert solver.solve(built.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    read_starts, read_choices = built.read(solver.value, solver.boolean_value)
    assert read_choices == choices
    assert read_starts == starts


def test_a_kept_mode_the_model_does_not_offer_leaves_the_pair_free():
    problem = tight_problem()
    scale = scale_for(problem)
    starts, choices = ticks_of_plan(problem, best_heuristic(problem), scale)
    pair = next(p for p, ch in choices.items() if ch.offload or ch.recompute)
    no_copies = ModelOptions(offload=False, recompute=False)
    built = CpsatModel(problem, scale, max(starts.values()) + 100, options=no_copies, fixed=dict(choices))
    assert built.v[pair].fixed is None
    assert built.assignment(starts, choices) is None  # the hint is refused, as without `fixed`


def test_tightened_windows_hold_the_hint_and_keep_the_optimum():
    """Windows only narrow, every start of the hint stays inside them although the horizon is the
    hint's own end, and the proven optimum of a small problem is the same with them as without."""
    problem = make_problem(p=3, m=4, limit=200.0, weight_grad_mib=100.0, b=1.5)
    scale = scale_for(problem)
    starts, choices = ticks_of_plan(problem, best_heuristic(problem), scale)
    horizon = cpsat._horizon(problem, scale, starts, None)  # the hint's end, as a step has it: no slack
    optima = []
    for tighten in (False, True):
        built = CpsatModel(problem, scale, horizon)
        before = widths(built)
        values = built.assignment(starts, choices)
        if tighten:
            assert built.tighten()
            assert widths(built) < before
            domains = built.model.proto.variables
            for var, value in values.items():
                if isinstance(var, cp_model.IntVar) and not var.is_boolean:
                    assert domains[var.index].domain[0] <= value <= domains[var.index].domain[1]
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = 20.0
        assert solver.solve(built.model) == cp_model.OPTIMAL
        optima.append(solver.objective_value)
    assert optima[0] == optima[1]


def test_an_empty_window_changes_nothing():
    problem = make_problem(p=3, m=4, limit=200.0)
    scale = scale_for(problem)
    built = CpsatModel(problem, scale, 5 * scale.time_scale)  # one microbatch's chain alone takes 7 ms
    before = [list(v.domain) for v in built.model.proto.variables]
    assert not built.tighten()
    assert [list(v.domain) for v in built.model.proto.variables] == before
