"""The calibration loop end to end (issue 13, item 5): a training job posts a measured iteration to
a real `pipeplan serve` (SQLite, embedded worker), the service stores it and plans the problem
calibrated to it, and the job's OnlinePlan swaps to that plan and follows its refinement.

What calibration can honestly do here: it works on the problem (the stage partition and placement
are fixed), so a slow stage is not given fewer layers; the calibrated problem carries the measured
costs (the slowed stage's about 2x), its plan predicts the slowed run instead of the healthy one, and
no plan of it is slower on that hardware than the plan that ran (the solver fits the other devices'
work around the slow one). The work a plan adds does move off the slow stage: under a memory limit,
the plan that ran recomputed 7 microbatches there (280 ms at the slowed cost), the calibrated one 1
(one run; the test asserts fewer).
"""

from __future__ import annotations

import time

import httpx
import pytest
from pipeplan.client import OnlinePlan, PlanClient, PlanRequestError
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.fidelity import retime
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import schedule_from_plan, simulate
from pipeplan.planner.trace import Trace
from pipeplan.planner.validator import validate_plan
from service_proc import Service
from service_support import pg_url  # noqa: F401
from sqlalchemy import text

pytestmark = pytest.mark.integration

FIELDS = ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms")


def uniform(m: int, unit_ms: float = 20.0) -> Problem:
    """4 devices, one stage each, F = B = W = `unit_ms`, 1-ms links (tests/torch_ranks.emulated_problem)."""
    return Problem.model_validate({
        "num_devices": 4, "num_microbatches": m, "p2p_ms": 1.0,
        "options": {"split_backward": True},
        "stages": [{"device": d, **{f: unit_ms for f in FIELDS}, "activation_mib": 1.0} for d in range(4)],
        "devices": [{"memory_limit_mib": None} for _ in range(4)]})


def slowed(problem: Problem, stage: int, factor: float) -> Problem:
    doc = problem.model_dump(mode="json")
    for f in FIELDS:
        doc["stages"][stage][f] *= factor
    return Problem.model_validate(doc)


def replay(truth: Problem, plan: Plan) -> Trace:
    """A 'measurement' of `plan`: its orders timed under `truth`'s costs, as a trace document."""
    timing = simulate(truth, schedule_from_plan(plan))
    devices = [{"device": dp.device, "memory_source": "none", "ops": [
        {"kind": p.kind, "stage": p.stage, "mb": p.mb,
         "start_ms": timing.times[Op(Kind(p.kind), p.stage, p.mb)][0],
         "end_ms": timing.times[Op(Kind(p.kind), p.stage, p.mb)][1]} for p in dp.ops]} for dp in plan.devices]
    return Trace.model_validate({"problem_key": plan.problem_key, "revision": plan.revision, "clock": "monotonic",
                                 "device_kind": "emulated", "makespan_ms": timing.makespan, "devices": devices})


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    # First plans wait for the whole greedy (milliseconds here): what a test's plans recompute must not
    # depend on how far a time-boxed greedy got on a loaded machine.
    svc = Service(tmp_path_factory.mktemp("serve"), inline_greedy_s=60, inline_greedy_max_s=60).start()
    yield svc
    svc.stop()


def check_calibration_loop(service: Service, problem: Problem, measure, tmp_path) -> dict:
    """The job's side of the loop: plan, run (measure), post the trace, swap to the calibrated plan,
    follow its refinement. Returns what the caller checks further."""
    key = problem.key()
    with OnlinePlan(PlanClient(service.url), problem, time_budget_s=2, store=tmp_path / "plans",
                    poll_interval_s=0.2) as online:
        ran = online.current()
        trace = measure(ran)
        posted = online.post_trace(trace)
        assert posted.created and posted.key == key and posted.calibrated_key != key
        assert posted.predicted_ms == pytest.approx(ran.makespan_ms)
        assert posted.measured_ms == pytest.approx(trace.makespan_ms)
        newer = online.poll_swap()  # the calibrated plan is offered as the better plan at once
        assert newer is not None and newer.problem_key == posted.calibrated_key
        calibrated = online.current_problem()
        assert calibrated.key() == posted.calibrated_key
        assert calibrated.metadata["calibrated_from"]["problem_key"] == key
        assert validate_plan(calibrated, newer, problem_key=calibrated.key()) == []
        # what PlannedSchedule.swap(newer, problem=calibrated) checks: same shape, plan of that problem
        assert (calibrated.num_devices, calibrated.num_stages, calibrated.num_microbatches) == \
            (problem.num_devices, problem.num_stages, problem.num_microbatches)
        assert [s.device for s in calibrated.stages] == [s.device for s in problem.stages]
        # its refine job runs (queued like any POST /v1/plans) and the follower picks up what it finds
        deadline = time.monotonic() + 60
        while True:
            job = httpx.get(f"{service.url}/v1/plans/{posted.calibrated_key}/job").json()
            if job["state"] not in ("queued", "solving") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert job["state"] == "done", job
        best = PlanClient(service.url).get(posted.calibrated_key)
        if best.revision > newer.revision:  # the solver improved it: the job follows the calibrated key
            better = online.wait_newer(newer.revision, timeout=30)
            assert better is not None and better.problem_key == posted.calibrated_key
            swapped = online.poll_swap()  # (or a later revision that arrived meanwhile)
            assert swapped.problem_key == posted.calibrated_key and swapped.revision >= better.revision
        return {"trace": trace, "ran": ran, "posted": posted, "calibrated": calibrated, "best": best,
                "online_plan": online.current()}


def test_trace_round_trip_calibrates_and_the_client_swaps(service, tmp_path):
    """A run where stage 2 took twice its planned time (its trace timed by the simulator, so exact)."""
    problem = uniform(8)
    truth = slowed(problem, 2, 2.0)
    out = check_calibration_loop(service, problem, lambda plan: replay(truth, plan), tmp_path)
    posted, calibrated, ran, best = out["posted"], out["calibrated"], out["ran"], out["best"]
    assert posted.error_pct > 50
    for k, stage in enumerate(calibrated.stages):
        assert stage.forward_ms == pytest.approx(40.0 if k == 2 else 20.0)
    assert posted.retimed_ms == pytest.approx(posted.measured_ms)  # the calibrated costs explain the run
    # the calibrated plan predicts the slow hardware, and is no slower there than the plan that ran
    assert abs(best.makespan_ms - posted.measured_ms) <= 0.02 * posted.measured_ms
    assert best.makespan_ms <= retime(truth, ran) + 1e-6
    assert out["online_plan"].problem_key == calibrated.key()

    key = problem.key()
    client = PlanClient(service.url)
    listed = client.traces(key)
    assert [(t["revision"], t["calibrated_key"]) for t in listed] == [(ran.revision, posted.calibrated_key)]
    assert listed[0]["error_pct"] == pytest.approx(posted.error_pct)
    stored = httpx.get(f"{service.url}{listed[0]['links']['self']}").json()
    assert Trace.model_validate(stored) == out["trace"]
    again = client.post_trace(key, out["trace"])  # a retried POST: stored once, same answer
    assert not again.created and again.calibrated_key == posted.calibrated_key and len(client.traces(key)) == 1

    # a trace of something else is refused, naming the field
    wrong = out["trace"].model_copy(update={"revision": 99})
    with pytest.raises(PlanRequestError, match="revision"):
        client.post_trace(key, wrong)
    short = out["trace"].model_dump(mode="json")
    short["devices"][0]["ops"] = short["devices"][0]["ops"][1:]
    with pytest.raises(PlanRequestError, match="devices.ops: ops missing"):
        client.post_trace(key, short)
    r = httpx.post(f"{service.url}/v1/plans/{'0' * 64}/traces", json=out["trace"].model_dump(mode="json"))
    assert r.status_code == 404 and r.json()["error"] == "not_found"

    # the dashboard: predicted vs measured on the plan page, a marker on the overview
    page = httpx.get(f"{service.url}/dashboard/plans/{key}").text
    assert "Measured runs" in page and f"/dashboard/plans/{posted.calibrated_key}" in page
    assert f"{posted.error_pct:+.1f}%" in page
    calibrated_page = httpx.get(f"{service.url}/dashboard/plans/{posted.calibrated_key}").text
    assert f"/dashboard/plans/{key}" in calibrated_page and "calibrated from" in calibrated_page
    overview = httpx.get(f"{service.url}/dashboard/", params={"q": key[:12]}).text
    assert 'class="traced"' in overview


def test_trace_store_on_postgresql(pg_url, tmp_path):  # noqa: F811
    """The same table and queries on PostgreSQL (an in-process app: the SQL is what differs)."""
    from fastapi.testclient import TestClient
    from pipeplan.service import create_app, schema
    from pipeplan.service.db import make_engine

    from pipeplan.settings import Settings

    engine = make_engine(pg_url, 1)
    schema.upgrade(engine)
    engine.dispose()
    problem = uniform(4)
    with TestClient(create_app(Settings(database_url=pg_url, embedded_workers=0))) as c:
        plan = Plan.model_validate(c.post("/v1/plans", json={"problem": problem.model_dump(mode="json")}).json()["plan"])
        trace = replay(slowed(problem, 1, 1.5), plan).model_dump(mode="json")
        first = c.post(f"/v1/plans/{problem.key()}/traces", json=trace)
        assert first.status_code == 201, first.text
        assert c.post(f"/v1/plans/{problem.key()}/traces", json=trace).status_code == 200
        listed = c.get(f"/v1/plans/{problem.key()}/traces").json()["traces"]
        assert len(listed) == 1 and listed[0]["calibrated_key"] == first.json()["calibrated"]["problem_key"]
        ck = listed[0]["calibrated_key"]
        assert c.get(f"/v1/plans/{ck}/problem").json()["stages"][1]["forward_ms"] == pytest.approx(30.0)
        assert 'class="traced"' in c.get("/dashboard/").text
    engine = make_engine(pg_url, 1)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM plan_traces")).scalar() == 1
    engine.dispose()


def memory_limited(m: int) -> Problem:
    """`uniform` with offload and recompute allowed and limits halfway between the least memory any
    schedule needs and 1F1B's peak: every plan recomputes or offloads somewhere."""
    from pipeplan.planner.baselines import run_baseline
    from pipeplan.planner.bounds import min_memory

    doc = uniform(m).model_dump(mode="json")
    doc["options"].update(offload=True, recompute=True)
    for stage in doc["stages"]:
        stage.update(offload_ms=15.0, activation_mib=100.0, weight_grad_mib=20.0, checkpoint_mib=5.0,
                     offloadable_mib=90.0)
    free = Problem.model_validate(doc)
    peak, floor = run_baseline(free, "1f1b").peak_memory_mib, min_memory(free)
    for d, device in enumerate(doc["devices"]):
        device["memory_limit_mib"] = floor[d] + 0.5 * (peak[d] - floor[d])
    return Problem.model_validate(doc)


def test_the_calibrated_plan_moves_recompute_work_off_a_slowed_stage(service, tmp_path):
    """The partition is fixed, so no layer leaves the slow stage; the work a plan adds (recomputed
    forwards) does: on stage 2 at twice its planned cost, the calibrated plan recomputes fewer of
    its microbatches there (it holds or offloads them instead) than the plan that ran."""
    problem = memory_limited(8)
    truth = slowed(problem, 2, 2.0)
    out = check_calibration_loop(service, problem, lambda plan: replay(truth, plan), tmp_path)

    def recompute_ms(plan: Plan, p: Problem, stage: int) -> float:
        return sum(p.stages[stage].recompute_ms for dp in plan.devices for op in dp.ops
                   if op.kind == "RECOMPUTE" and op.stage == stage)

    ran, best, calibrated = out["ran"], out["best"], out["calibrated"]
    before = recompute_ms(ran, truth, 2)
    after = recompute_ms(best, calibrated, 2)
    assert before > 0, "the plan that ran must recompute on stage 2 for this test to say anything"
    assert after < before, (before, after)
    assert best.makespan_ms <= retime(calibrated, ran) + 1e-6


@pytest.mark.torch
def test_a_slowed_stage_in_emulation_yields_a_calibrated_plan_the_client_swaps_to(service, tmp_path):
    """4 gloo ranks run the service's plan in emulated time with stage 2 twice as slow as planned;
    the posted trace gives a calibrated problem with stage 2 at about 2x, whose plan predicts the
    slowed run (the original prediction is off by ~60%), and the client swaps to it."""
    pytest.importorskip("torch")
    from pipeplan.client.emulated_pipeline import Job, run_emulated

    problem = uniform(6)
    truth = slowed(problem, 2, 2.0)

    def measure(plan: Plan) -> Trace:
        return run_emulated([Job(problem, plan, costs=truth)], iterations=1, warmup=1)[0][-1]

    out = check_calibration_loop(service, problem, measure, tmp_path)
    posted, calibrated, best = out["posted"], out["calibrated"], out["best"]
    assert posted.error_pct > 40, posted
    for k, stage in enumerate(calibrated.stages):
        want = 40.0 if k == 2 else 20.0
        assert abs(stage.forward_ms - want) <= 0.2 * want, (k, stage.forward_ms)
        assert abs(stage.backward_input_ms - want) <= 0.2 * want, (k, stage.backward_input_ms)
    # the calibrated plan's prediction matches the slowed run far better than the original's did
    assert abs(best.makespan_ms - posted.measured_ms) <= 0.15 * posted.measured_ms, (best.makespan_ms, posted)
    assert abs(posted.retimed_ms - posted.measured_ms) <= 0.15 * posted.measured_ms, posted
    assert best.makespan_ms <= retime(calibrated, out["ran"]) + 1e-6
