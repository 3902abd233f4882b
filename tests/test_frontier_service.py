"""/v1/frontiers against a real SQLite cache and the embedded worker pool (two workers share the
points): every point an ordinary cached plan, the curve monotone, the queries, SSE, 4xx."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.validator import validate_plan
from pipeplan.service import create_app
from pipeplan.service.frontier_store import FrontierStore
from service_support import make_problem, problem_doc, wait_for

from pipeplan.settings import Settings


def test_frontier_points_are_cached_plans_refined_by_two_workers(tmp_path):
    app = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=2, solver_workers=1))
    problem = make_problem(devices=4, microbatches=8, offload=True, limit_mib=8000.0, tag="svc-frontier")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/frontiers", json={"problem": problem_doc(problem), "points": 5, "time_budget_s": 1})
        assert r.status_code == 201, r.text
        key = r.json()["frontier_key"]
        points = r.json()["frontier"]["points"]
        assert len(points) == 5
        spans = [p["makespan_ms"] for p in points]
        assert all(b <= a for a, b in zip(spans, spans[1:])), spans  # monotone from revision 1 on
        done = wait_for(lambda: (d := c.get(f"/v1/frontiers/{key}").json()) and
                        all(p["job_state"] == "done" for p in d["points"]) and d, 60, what="every point refined")
        for p in done["points"]:  # an ordinary plan under its own problem key, valid for its own problem
            plan = Plan.model_validate(c.get(f"/v1/plans/{p['problem_key']}").json())
            sub = Problem.model_validate(c.get(f"/v1/plans/{p['problem_key']}/problem").json())
            assert plan.problem_key == p["problem_key"] == sub.key() and validate_plan(sub, plan) == []
            assert sub.devices[0].memory_limit_mib == p["limits_mib"][0]
            assert "pending_from_smaller_ms" not in p, p  # workers offered smaller points' plans upward
        assert all(d["dominated"] for d in done["dominance"]), done["dominance"]
        target = done["points"][2]["makespan_ms"]
        hit = c.get(f"/v1/frontiers/{key}/least-memory", params={"target_ms": target}).json()
        assert hit["point"]["budget_mib"] <= done["points"][2]["budget_mib"]
        assert hit["point"]["makespan_ms"] <= target
        fast = c.get(f"/v1/frontiers/{key}/fastest", params={"budget_gib": 1000}).json()
        # the curve's fastest value; two points' equal plans may differ in float noise (29.85 vs
        # 29.850000000000005), and the query then returns the smaller budget
        assert fast["point"]["makespan_ms"] == pytest.approx(done["points"][-1]["makespan_ms"], abs=1e-6)
        miss = c.get(f"/v1/frontiers/{key}/fastest", params={"budget_gib": 0.01})
        assert miss.status_code == 404 and "budget_gib" in miss.json()["message"]
        with c.stream("GET", f"/v1/frontiers/{key}/events") as stream:
            lines = stream.iter_lines()
            event = next(line for line in lines if line.startswith("event:"))
            data = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
            assert event == "event: curve" and data["format"] == "pipeplan.frontier/v1"
        page = c.get(f"/dashboard/frontiers/{key}")
        assert page.status_code == 200 and page.text.count('<a class="point" href="/dashboard/plans/') == 5
        assert 'class="frontier-band"' in page.text and 'data-peer="zb-h1"' in page.text
        for point in points:  # whole keys (cut by CSS only), so a copied key is one the API accepts
            assert f'>{point["problem_key"]}</a>' in page.text
        plan_page = c.get(f"/dashboard/plans/{points[0]['problem_key']}")
        assert f'href="/dashboard/frontiers/{key}"' in plan_page.text
        again = c.post("/v1/frontiers", json={"problem": problem_doc(problem), "points": 5})
        assert again.status_code == 200 and again.json()["frontier_key"] == key
        assert FrontierStore(app.state.pipeplan.repo).frontiers_of(points[0]["problem_key"]) == [key]


def test_frontier_requests_are_checked(tmp_path):
    app = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=0))
    problem = make_problem(devices=2, microbatches=4, tag="svc-frontier-bad")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/frontiers", json={"problem": problem_doc(problem), "points": 1})
        assert r.status_code == 422 and "points" in r.text
        r = c.post("/v1/frontiers", json={"points": 4})
        assert r.status_code == 422 and "exactly one of problem or spec" in r.text
        assert c.get("/v1/frontiers/" + "0" * 64).status_code == 404
        assert c.get("/v1/frontiers/nothex").status_code == 404


def test_frontier_specs_meet_the_configured_limits(tmp_path):
    """A spec is sized against the service's limits (PIPEPLAN_LIMITS__*), not the planner's defaults."""
    from pathlib import Path

    from pipeplan.planner.contract import Limits

    spec = json.loads((Path(__file__).parents[1] / "examples/specs/llama7b_8xh100.json").read_text())
    app = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=0, limits=Limits(max_layers=8)))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/frontiers", json={"spec": spec, "points": 3})
        assert r.status_code == 422 and "spec.model.layers" in r.json()["message"], r.text


def test_a_frontier_curve_is_built_once_per_revision_set(tmp_path):
    """GET /v1/frontiers/{key} reads a cached curve until a point's revision or job state changes."""
    app = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=0))
    problem = make_problem(devices=4, microbatches=8, offload=True, limit_mib=8000.0, tag="svc-frontier-cache")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/frontiers", json={"problem": problem_doc(problem), "points": 3})
        assert r.status_code == 201, r.text
        key = r.json()["frontier_key"]
        repo = app.state.pipeplan.repo
        store = FrontierStore.of(repo)
        doc = store.curve(key)
        assert store.curve(key) is doc  # not rebuilt while nothing changed
        assert c.get(f"/v1/frontiers/{key}").json()["points"] == doc["points"]
        queued = next(p for p in doc["points"] if p["job_state"] == "queued")
        job = repo.job(queued["problem_key"])
        assert repo.claim(job.key, job.run_id, "a-worker") is not None  # as a worker starts its run
        again = store.curve(key)
        assert again is not doc
        assert next(p for p in again["points"] if p["problem_key"] == job.key)["job_state"] == "solving"
        assert c.get(f"/v1/frontiers/{key}").json()["points"] == again["points"]
