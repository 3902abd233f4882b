"""Exports: torch's schedule CSV (checked by torch's own loader) and Chrome traces."""

from __future__ import annotations

import json

import pytest
from core_schedules import gpipe, make_problem, one_f_one_b, plan_of, problem_doc, serialized
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.exports import chrome_trace, torch_actions, torch_csv, torch_memory_actions
from pipeplan.planner.ops import Kind
from pipeplan.planner.validator import assert_valid


def _plan(problem, schedule) -> Plan:
    return assert_valid(problem, plan_of(problem, schedule))


@pytest.fixture
def one_f_one_b_case():
    problem = make_problem(p=4, m=8, p2p=0.1)
    return problem, _plan(problem, one_f_one_b(problem))


@pytest.fixture
def v_memory_case():
    """V placement (stage k and 2P-1-k share a device) with offload and recompute both planned."""
    doc = problem_doc(p=2, m=3, chunks=2, placement="v", offload=True, recompute=True, limit=260.0)
    doc["stages"][0]["checkpoint_mib"] = 90.0  # offloading leaves 20 MiB, recomputing 90: offload
    doc["stages"][1]["checkpoint_mib"] = 5.0  # recomputing leaves 5 MiB: recompute
    problem = Problem.model_validate(doc)
    return problem, _plan(problem, serialized(problem))


def test_csv_rows_are_ranks_and_kinds_map_to_torch_actions(one_f_one_b_case):
    problem, plan = one_f_one_b_case
    rows = torch_csv(problem, plan).splitlines()
    assert len(rows) == problem.num_devices
    assert rows[3].split(",")[:3] == ["3F0", "3I0", "3W0"]  # last stage: B -> I, W -> W
    for d, row in enumerate(rows):
        cells = row.split(",")
        compute = [p for p in plan.devices[d].ops if p.kind in ("F", "B", "W", "BW")]
        assert len(cells) == len(compute) == 3 * problem.num_microbatches
        assert all(c.startswith(str(d)) for c in cells)


def test_full_backward_becomes_torch_b():
    problem = make_problem(p=2, m=2, split=False)
    plan = _plan(problem, gpipe(problem))
    assert torch_actions(plan) == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]


def test_csv_rejects_a_plan_for_another_device_count(one_f_one_b_case):
    problem, plan = one_f_one_b_case
    other = make_problem(p=2, m=8)
    with pytest.raises(ValueError, match="devices"):
        torch_csv(other, plan)


def test_memory_actions_list_exactly_the_planned_pairs(v_memory_case):
    _, plan = v_memory_case
    side = torch_memory_actions(plan)
    planned = {(p.kind, p.stage, p.mb) for d in plan.devices for p in d.ops}
    assert {tuple(x) for x in side["offload"]} == {(k, i) for kind, k, i in planned if kind == "OFFLOAD"}
    assert {tuple(x) for x in side["recompute"]} == {(k, i) for kind, k, i in planned if kind == "RECOMPUTE"}
    assert side["offload"] and side["recompute"], "the fixture must exercise both mechanisms"
    assert not {tuple(x) for x in side["offload"]} & {tuple(x) for x in side["recompute"]}
    json.dumps(side)


@pytest.mark.torch
@pytest.mark.parametrize("case", ["one_f_one_b_case", "v_memory_case"])
def test_torch_own_loader_accepts_the_csv(case, request):
    pytest.importorskip("torch")
    from pipeplan.client.torch_internals import parse_torch_csv

    problem, plan = request.getfixturevalue(case)
    order, with_comms, stage_to_rank = parse_torch_csv(
        torch_csv(problem, plan), problem.num_devices, problem.num_stages, problem.num_microbatches)
    assert stage_to_rank == {k: s.device for k, s in enumerate(problem.stages)}
    for d in range(problem.num_devices):
        assert [str(a) for a in order[d]] == torch_actions(plan)[d]
        # the lowering added the sends/receives a multi-device plan needs
        assert any("SEND" in str(a) for a in with_comms[d])


@pytest.mark.torch
def test_torch_loader_rejects_a_backward_before_its_forward(one_f_one_b_case):
    pytest.importorskip("torch")
    from pipeplan.client.torch_internals import parse_torch_csv

    problem, plan = one_f_one_b_case
    rows = torch_csv(problem, plan).splitlines()
    cells = rows[3].split(",")
    cells[0], cells[1] = cells[1], cells[0]  # 3I0 before 3F0
    rows[3] = ",".join(cells)
    with pytest.raises(AssertionError, match="without first running Forward"):
        parse_torch_csv("\n".join(rows), 4, 4, 8)


def test_chrome_trace_structure_durations_and_memory(v_memory_case):
    problem, plan = v_memory_case
    trace = json.loads(json.dumps(chrome_trace(problem, plan)))
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert len(names) == 3 * problem.num_devices
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"device 0", "device 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(d.ops) for d in plan.devices)
    lanes = {"F": 0, "B": 0, "W": 0, "BW": 0, "RECOMPUTE": 0, "OFFLOAD": 1, "RELOAD": 2}
    for e in spans:
        pop = next(p for p in plan.devices[e["pid"]].ops
                   if (p.kind, p.stage, p.mb) == (e["args"]["kind"], e["args"]["stage"], e["args"]["mb"]))
        assert e["tid"] == lanes[pop.kind]
        assert e["ts"] == pytest.approx(pop.start_ms * 1000)
        assert e["dur"] == pytest.approx((pop.end_ms - pop.start_ms) * 1000)
    for d in range(problem.num_devices):
        counter = [e["args"]["used_mib"] for e in events if e["ph"] == "C" and e["pid"] == d]
        assert max(counter) == pytest.approx(plan.peak_memory_mib[d])
        assert counter[0] == problem.devices[d].static_mib
        assert all(c <= 260.0 + 1e-9 for c in counter)
    assert trace["otherData"]["makespan_ms"] == plan.makespan_ms
    assert any(e["cat"] == Kind.OFFLOAD.value for e in spans)


@pytest.mark.torch
@pytest.mark.parametrize("placement,chunks,memory", [("loop", 1, None), ("loop", 2, None), ("v", 2, None),
                                                     ("loop", 1, 0.6)])
def test_every_baseline_plan_loads_in_torch(placement, chunks, memory):
    """Whatever heuristic produced a plan (interleaved, zero-bubble, V, offloading), torch accepts it."""
    pytest.importorskip("torch")
    from pipeplan.client.torch_internals import parse_torch_csv
    from pipeplan.planner.baselines import compare, run_baseline

    doc = problem_doc(p=4, m=8, chunks=chunks, placement=placement, p2p=0.05, offload=True, recompute=True)
    problem = Problem.model_validate(doc)
    if memory is not None:  # between the floor and 1F1B's peak: only offload/recompute schedules fit
        from pipeplan.planner.bounds import min_memory

        peak, floor = run_baseline(problem, "1f1b").peak_memory_mib, min_memory(problem)
        for d, device in enumerate(doc["devices"]):
            device["memory_limit_mib"] = floor[d] + memory * (peak[d] - floor[d])
        problem = Problem.model_validate(doc)
    plans = [r.plan for r in compare(problem) if r.plan is not None]
    assert plans, "no baseline applied"
    if memory is not None:
        assert any(p.kind in ("OFFLOAD", "RECOMPUTE") for plan in plans for d in plan.devices for p in d.ops)
    for plan in plans:
        order, _, stage_to_rank = parse_torch_csv(torch_csv(problem, plan), problem.num_devices,
                                                  problem.num_stages, problem.num_microbatches)
        assert stage_to_rank == {k: s.device for k, s in enumerate(problem.stages)}, plan.method
        assert sum(len(row) for row in order.values()) == sum(
            1 for d in plan.devices for p in d.ops if p.kind in ("F", "B", "W", "BW")), plan.method
