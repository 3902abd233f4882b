"""The HTTP API against a real embedded SQLite cache: submit, cache hit, ETag/304, long-poll, SSE with
resume, revisions, refine/cancel, listing, exports, errors (422/413/401/404/503), metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pipeplan.service import create_app
from service_support import LiveServer, gpipe_plan, hard_problem, make_problem, problem_doc, wait_for

from pipeplan.settings import Settings


def app_for(tmp_path, **overrides):
    base = dict(data_dir=tmp_path / "data", embedded_workers=0, default_time_budget_s=2.0)
    return create_app(Settings(**{**base, **overrides}))


@pytest.fixture
def client(tmp_path):
    with TestClient(app_for(tmp_path), raise_server_exceptions=False) as c:
        yield c


def test_submit_miss_then_hit_and_etag(client):
    problem = make_problem(devices=4, microbatches=8, limit_mib=3100)  # zb-h1, above the bound: refined
    r = client.post("/v1/plans", json={"problem": problem_doc(problem), "time_budget_s": 1.5})
    assert r.status_code == 201, r.text
    body = r.json()
    key = problem.key()
    assert body["problem_key"] == key and body["revision"] == 1 and body["cached"] is False
    assert body["plan"]["format"] == "pipeplan.plan/v1" and body["plan"]["problem_key"] == key
    assert body["job"]["state"] == "queued" and body["job"]["budget_s"] == 1.5
    assert body["job"]["outcome"] is None and body["job"]["outcome_text"] is None  # nothing searched yet
    assert body["links"]["events"] == f"/v1/plans/{key}/events"
    # same problem spelled differently (ints, defaults omitted): same key, cache hit
    doc = problem_doc(problem)
    doc["p2p_ms"] = 0.05
    doc["stages"] = [{k: v for k, v in s.items() if k not in ("recompute_ms", "offloadable_mib")} for s in doc["stages"]]
    hit = client.post("/v1/plans", json={"problem": doc})
    assert hit.status_code == 200 and hit.json()["cached"] is True and hit.json()["problem_key"] == key
    got = client.get(f"/v1/plans/{key}")
    assert got.status_code == 200 and got.json() == body["plan"]
    etag = got.headers["etag"]
    assert got.headers["x-pipeplan-revision"] == "1"
    assert client.get(f"/v1/plans/{key}", headers={"If-None-Match": etag}).status_code == 304
    assert client.get(f"/v1/plans/{key}", headers={"If-None-Match": '"other"'}).status_code == 200
    assert client.get(f"/v1/plans/{key}/problem").json()["num_devices"] == 4
    revs = client.get(f"/v1/plans/{key}/revisions").json()["revisions"]
    assert [r["revision"] for r in revs] == [1]
    assert client.get(f"/v1/plans/{key}/revisions/1").json() == body["plan"]


def test_spec_is_turned_into_a_problem_by_the_cost_model(client):
    from pipeplan.planner.documents import problem_from_document

    spec = _small_spec()
    expected = problem_from_document(spec)
    r = client.post("/v1/plans", json={"spec": spec, "time_budget_s": 1})
    assert r.status_code in (200, 201), r.text
    assert r.json()["problem_key"] == expected.key()
    bad = client.post("/v1/plans", json={"spec": {**spec, "training": {"devices": 2, "microbatches": -3}}})
    assert bad.status_code == 422 and bad.json()["message"].startswith("spec")


def test_spec_with_automatic_partition_uses_the_adaptive_search_once(client):
    spec = json.loads((Path(__file__).resolve().parent.parent / "examples/specs/llama7b_8xh100.json").read_text())
    spec["partition"] = "auto"
    spec["training"]["microbatches"] = 16
    first = client.post("/v1/plans", json={"spec": spec, "time_budget_s": 1})
    assert first.status_code == 201, first.text
    assert first.json()["plan"]["format"] == "pipeplan.plan/v1"
    t0 = time.monotonic()
    again = client.post("/v1/plans", json={"spec": spec})
    assert again.json()["cached"] is True and again.json()["problem_key"] == first.json()["problem_key"]
    assert time.monotonic() - t0 < 2.0  # the partition search is not repeated


def _small_spec() -> dict:
    return {"format": "pipeplan.spec/v1",
            "model": {"name": "tiny", "layers": 4, "hidden": 256, "ffn": 1024, "heads": 4, "vocab": 1000,
                      "seq_len": 128},
            "hardware": "H100-80GB", "training": {"devices": 2, "microbatches": 4}}


def test_validation_errors_name_field_and_reason(client):
    doc = problem_doc(make_problem())
    doc["stages"][1]["forward_ms"] = -1
    r = client.post("/v1/plans", json={"problem": doc})
    assert r.status_code == 422
    assert any(line.startswith("problem.stages.1.forward_ms") for line in r.json()["detail"]), r.json()
    r = client.post("/v1/plans", json={})
    assert r.status_code == 422 and "exactly one of problem or spec" in r.json()["message"]
    r = client.post("/v1/plans", json={"problem": problem_doc(make_problem()), "time_budget_s": 10**6})
    assert r.status_code == 422 and r.json()["message"].startswith("time_budget_s")
    r = client.post("/v1/plans", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "Traceback" not in r.text
    assert client.get("/v1/plans/" + "0" * 64).status_code == 404
    assert client.get("/v1/plans/not-a-key").json()["error"] == "not_found"


def test_infeasible_budget_reports_min_memory_per_device(client):
    problem = make_problem(devices=2, microbatches=4, limit_mib=1100.0)  # static 1000 + one 512 activation > 1100
    r = client.post("/v1/plans", json={"problem": problem_doc(problem)})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "infeasible"
    assert len(body["min_memory_mib"]) == 2 and all(m > 1100.0 for m in body["min_memory_mib"])


def test_size_limits_and_body_limit(tmp_path):
    app = app_for(tmp_path, max_body_bytes=5_000, limits={"max_microbatches": 16})
    with TestClient(app, raise_server_exceptions=False) as c:
        big = c.post("/v1/plans", json={"problem": problem_doc(make_problem(devices=40, microbatches=8))})
        assert big.status_code == 413 and big.json()["error"] == "payload_too_large"
        r = c.post("/v1/plans", json={"problem": problem_doc(make_problem(microbatches=32))})
        assert r.status_code == 422 and r.json()["message"] == "problem.num_microbatches: 32 exceeds the limit 16"

        def chunks():
            yield b'{"problem": '
            for _ in range(100):
                yield b" " * 100
        assert c.post("/v1/plans", content=chunks(), headers={"content-type": "application/json"}).status_code == 413


def test_api_keys_gate_writes_and_optionally_reads(tmp_path):
    with TestClient(app_for(tmp_path, api_keys="k1,k2"), raise_server_exceptions=False) as c:
        doc = {"problem": problem_doc(make_problem())}
        assert c.post("/v1/plans", json=doc).status_code == 401
        assert c.post("/v1/plans", json=doc, headers={"Authorization": "Bearer nope"}).status_code == 401
        r = c.post("/v1/plans", json=doc, headers={"Authorization": "Bearer k2"})
        assert r.status_code == 201
        key = r.json()["problem_key"]
        assert c.get(f"/v1/plans/{key}").status_code == 200  # reads open by default
        assert c.post(f"/v1/plans/{key}/cancel", headers={"X-API-Key": "k1"}).status_code == 202
        assert c.post(f"/v1/plans/{key}/refine").status_code == 401
    with TestClient(app_for(tmp_path, api_keys="k1", read_requires_key=True), raise_server_exceptions=False) as c:
        assert c.get("/v1/plans").status_code == 401
        assert c.get("/v1/plans", headers={"X-API-Key": "k1"}).status_code == 200
        assert c.get("/healthz").status_code == 200


def test_listing_refine_cancel_and_exports(client):
    keys = []
    for m in (4, 5, 6):
        r = client.post("/v1/plans", json={"problem": problem_doc(make_problem(microbatches=m, limit_mib=2100))})
        keys.append(r.json()["problem_key"])
    page = client.get("/v1/plans", params={"limit": 2, "sort": "num_microbatches", "order": "asc"}).json()
    assert page["total"] == 3 and [i["num_microbatches"] for i in page["items"]] == [4, 5]
    assert page["items"][0]["job_state"] == "queued" and page["items"][0]["gap"] >= 0
    assert client.get("/v1/plans", params={"sort": "bogus"}).status_code == 422
    key = keys[0]
    cancelled = client.post(f"/v1/plans/{key}/cancel").json()
    assert cancelled["job"]["state"] == "cancelled"
    again = client.post(f"/v1/plans/{key}/refine", json={"time_budget_s": 3}).json()
    assert again["queued"] is True and again["job"]["state"] == "queued" and again["job"]["budget_s"] == 3
    assert client.post(f"/v1/plans/{key}/refine").json()["queued"] is False  # one active run per key
    assert client.get(f"/v1/plans/{key}/job").json()["runs"] == 2
    csv = client.get(f"/v1/plans/{key}/export/torch.csv")
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    assert len(csv.text.strip().splitlines()) == 2  # one row per rank
    trace = client.get(f"/v1/plans/{key}/export/chrome-trace.json")
    assert trace.status_code == 200 and trace.json()
    assert client.post("/v1/plans/" + "f" * 64 + "/refine").status_code == 404


def test_health_readiness_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["database"] == "ok" and ready["queue"] == "ok" and ready["queue_kind"] == "local"
    client.post("/v1/plans", json={"problem": problem_doc(make_problem(limit_mib=2100))})  # not optimal: queued
    text = client.get("/metrics").text
    assert 'pipeplan_http_requests_total{method="POST",route="/v1/plans",status="201"} 1.0' in text
    assert "pipeplan_http_request_duration_seconds_bucket" in text
    assert 'pipeplan_jobs{state="queued"} 1.0' in text
    assert "pipeplan_queue_depth" in text and "pipeplan_solver_improvements_total" in text
    doc = client.get("/openapi.json").json()
    job = doc["components"]["schemas"]["JobView"]["properties"]
    assert job["state"]["enum"] == ["queued", "solving", "done", "failed", "cancelled"]
    outcome = next(s for s in job["outcome"]["anyOf"] if "enum" in s)
    assert outcome["enum"] == ["optimal", "budget", "stalled", "stopped"]
    assert "budget" in job["outcome"]["description"] and "percent" in job["gap_pct"]["description"]


def test_long_poll_and_sse_follow_new_revisions_with_resume(tmp_path):
    """A revision stored by a writer (as a worker does) reaches long-pollers and SSE subscribers."""
    app = app_for(tmp_path)
    problem = make_problem(tag="sse")
    key = problem.key()
    with LiveServer(app) as srv:
        st = app.state.pipeplan
        st.repo.store_first(problem, gpipe_plan(problem, delay_ms=30), 5.0, key=key)

        def improve(delay: float) -> int:
            revision = st.repo.store_if_better(key, gpipe_plan(problem, delay_ms=delay), problem)
            st.events.publish_revision(key, revision)
            return revision

        # long-poll: returns as soon as revision 2 exists
        threading.Timer(0.5, improve, args=(20.0,)).start()
        t0 = time.monotonic()
        r = httpx.get(f"{srv.base}/v1/plans/{key}", params={"min_revision": 2, "wait": 10}, timeout=15)
        assert r.status_code == 200 and r.json()["revision"] == 2 and time.monotonic() - t0 < 5
        # long-poll that times out returns the current plan
        r = httpx.get(f"{srv.base}/v1/plans/{key}", params={"min_revision": 9, "wait": 0.3}, timeout=5)
        assert r.json()["revision"] == 2

        received: list[tuple[str, dict]] = []
        with httpx.stream("GET", f"{srv.base}/v1/plans/{key}/events", timeout=15) as stream:
            lines = stream.iter_lines()
            received.append(_next_event(lines))  # the current best first
            improve(10.0)
            received.append(_next_event(lines))
        assert [(i, d["revision"]) for i, d in received] == [("2", 2), ("3", 3)]
        # resume: a client that saw revision 1 gets 2 and 3 replayed, then live 4
        with httpx.stream("GET", f"{srv.base}/v1/plans/{key}/events", headers={"Last-Event-ID": "1"},
                          params={"summary": "true"}, timeout=15) as stream:
            lines = stream.iter_lines()
            replay = [_next_event(lines), _next_event(lines)]
            improve(5.0)
            live = _next_event(lines)
        assert [i for i, _ in replay] == ["2", "3"] and live[0] == "4"
        assert set(live[1]) >= {"problem_key", "revision", "makespan_ms"} and "devices" not in live[1]
        assert httpx.get(f"{srv.base}/v1/plans/{'e' * 64}/events").status_code == 404


def _next_event(lines) -> tuple[str, dict]:
    event_id, data, name = None, None, None
    for line in lines:
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data = json.loads(line[5:].strip())
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line == "" and data is not None:
            if name == "revision":
                return event_id, data
            event_id, data, name = None, None, None
    raise AssertionError("stream ended")


def test_embedded_worker_refines_and_cancel_stops_it(tmp_path):
    """Embedded mode end to end: the in-process pool solves, stores better revisions, honours cancel."""
    app = app_for(tmp_path, embedded_workers=1, solver_workers=1)
    with TestClient(app, raise_server_exceptions=False) as c:
        problem = hard_problem()
        r = c.post("/v1/plans", json={"problem": problem_doc(problem), "time_budget_s": 30})
        key = r.json()["problem_key"]
        wait_for(lambda: c.get(f"/v1/plans/{key}/job").json()["state"] == "solving", 10, what="solving")
        wait_for(lambda: c.get(f"/v1/plans/{key}").json()["revision"] >= 2, 15, what="an improvement")
        t0 = time.monotonic()
        c.post(f"/v1/plans/{key}/cancel")
        job = wait_for(lambda: (j := c.get(f"/v1/plans/{key}/job").json())["state"] == "cancelled" and j, 20,
                       what="cancel")
        # well before the 30-s budget ends (a run that ignored the cancel would take ~25 s more); 3-8 s
        # seen here, SQLite writes of the API and the pool's heartbeat taking turns
        assert time.monotonic() - t0 < 12
        # the embedded pool reports the run's end like the RQ workers: stopped, with its gap
        assert job["outcome"] == "stopped" and job["gap_pct"] > 0 and job["run_improvements"] >= 1, job
        assert job["outcome_text"].startswith("stopped after ") and f"gap {job['gap_pct']:.1f}%" in job["outcome_text"]
        revs = c.get(f"/v1/plans/{key}/revisions").json()["revisions"]
        spans = [r["makespan_ms"] for r in revs]
        assert all(b < a for a, b in zip(spans, spans[1:]))
        assert c.get(f"/v1/plans/{key}").json()["makespan_ms"] == spans[-1] < r.json()["plan"]["makespan_ms"]


def test_embedded_restart_resumes_an_interrupted_job(tmp_path):
    """Shutting the embedded server down mid-solve hands the run back; the next start re-runs it
    warm from the best stored plan (the SQLite file is the source of truth)."""
    problem = hard_problem()
    key = problem.key()
    with TestClient(app_for(tmp_path, embedded_workers=1, solver_workers=1), raise_server_exceptions=False) as c:
        c.post("/v1/plans", json={"problem": problem_doc(problem), "time_budget_s": 60})
        wait_for(lambda: c.get(f"/v1/plans/{key}/job").json()["state"] == "solving", 10, what="solving")
        time.sleep(1.5)
    app = app_for(tmp_path, embedded_workers=1, solver_workers=1)
    assert app.state.pipeplan.settings.data_dir == tmp_path / "data"
    with TestClient(app, raise_server_exceptions=False) as c:
        job = c.get(f"/v1/plans/{key}/job").json()
        assert job["state"] in ("queued", "solving") and job["used_s"] > 1.0
        wait_for(lambda: c.get(f"/v1/plans/{key}/job").json()["attempts"] == 2, 15, what="the re-run")
        c.post(f"/v1/plans/{key}/cancel")
        wait_for(lambda: c.get(f"/v1/plans/{key}/job").json()["state"] == "cancelled", 20, what="cancel")
