"""/v1/configurations: every scored candidate an ordinary cached plan, the ranking, 4xx naming the
field, and -- with two real `pipeplan worker` processes on PostgreSQL and Redis -- the refinement of
the top candidates shared between them, the ranking following their plans (SSE included)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.validator import validate_plan
from pipeplan.service import create_app
from pipeplan.service.repository import Repository
from service_support import (
    REDIS_URL,
    drop_queue,
    migrated_engine,
    pg_available,
    pg_schema,
    start_server,
    start_worker,
)

from pipeplan.settings import Settings

SPEC = {"model": {"name": "small", "layers": 8, "hidden": 1024, "ffn": 4096, "heads": 16, "kv_heads": 4,
                  "vocab": 32000, "seq_len": 2048},
        "hardware": "H100-80GB", "cluster": "DGX-H100", "precision": "bf16",
        "training": {"devices": 2, "microbatches": 4}}
BODY = {"spec": SPEC, "gpus": 8, "gpus_per_node": 8, "global_batch": 16, "top": 3, "micro_batch_sizes": [1, 2]}


def test_a_search_stores_every_candidate_as_an_ordinary_plan_and_answers_4xx_naming_the_field(tmp_path):
    app = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=0, solver_workers=1))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/configurations", json=BODY)
        assert r.status_code == 201, r.text
        key, doc = r.json()["configuration_key"], r.json()["configurations"]
        assert doc["format"] == "pipeplan.configurations/v1" and len(doc["candidates"]) == 3
        assert [e["rank"] for e in doc["candidates"]] == [1, 2, 3]
        for e in doc["scored"]:  # every scored candidate: a valid plan under its own problem key
            plan = Plan.model_validate(c.get(f"/v1/plans/{e['problem_key']}").json())
            problem = Problem.model_validate(c.get(f"/v1/plans/{e['problem_key']}/problem").json())
            assert plan.problem_key == problem.key() == e["problem_key"] and validate_plan(problem, plan) == []
        assert problem_from_document(doc["best_spec"]).key() == doc["candidates"][0]["problem_key"]
        refined = [e for e in doc["scored"] if e["refined"]]
        assert len(refined) == 3 and all(e["job_state"] in ("queued", "done") for e in refined)
        assert all(e["job_state"] == "cancelled" for e in doc["scored"] if not e["refined"])
        again = c.post("/v1/configurations", json=BODY)
        assert again.status_code == 200 and again.json()["configuration_key"] == key
        got = c.get(f"/v1/configurations/{key}").json()
        assert got["candidates"] == doc["candidates"] and got["links"]["dashboard"].endswith(key)
        page = c.get(f"/dashboard/configurations/{key}")
        assert page.status_code == 200 and page.text.count('<a class="candidate') == len(doc["scored"])
        assert c.get("/dashboard/configurations/" + "0" * 64).status_code == 404

        bad = c.post("/v1/configurations", json={**BODY, "global_batch": 7, "micro_batch_sizes": [2]})
        assert bad.status_code == 422 and bad.json()["field"] == "global_batch", bad.text
        assert bad.json()["nearest_global_batch"] == [6, 8] and "nearest valid: 6 or 8" in bad.json()["message"]
        huge = {**SPEC, "model": {**SPEC["model"], "hidden": 16384, "ffn": 65536, "heads": 128, "kv_heads": 8,
                                  "vocab": 256000}}
        oom = c.post("/v1/configurations", json={**BODY, "spec": huge, "gpus": 1, "global_batch": 1})
        assert oom.status_code == 422 and oom.json()["field"] == "gpus" and oom.json()["least_memory_mib"] > 80000
        field = c.post("/v1/configurations", json={**BODY, "gpus": 0})
        assert field.status_code == 422 and "gpus" in field.text
        spec_err = c.post("/v1/configurations", json={**BODY, "spec": {**SPEC, "hardware": "B900"}})
        assert spec_err.status_code == 422 and "hardware" in spec_err.json()["message"], spec_err.text
        assert c.get("/v1/configurations/" + "0" * 64).status_code == 404
        assert c.get("/v1/configurations/nope").status_code == 404


@pytest.mark.integration
def test_two_workers_share_the_refinement_and_the_ranking_follows(tmp_path):
    if not pg_available():
        pytest.fail("PostgreSQL is needed for the worker tests")
    redis.Redis.from_url(REDIS_URL).ping()
    queue = f"pp-test-{uuid.uuid4().hex[:8]}"
    # a larger microbatch count than the first test: the first plans are not all proven optimal
    body = {**BODY, "global_batch": 64, "top": 3, "time_budget_s": 2}
    with pg_schema() as (url, _):
        engine = migrated_engine(url)
        settings = {"database_url": url, "redis_url": REDIS_URL, "queue_name": queue, "solver_workers": 1,
                    "default_time_budget_s": 2, "configure_refine_top": 3}
        server, base = start_server(tmp_path, **settings)
        workers = [start_worker(tmp_path, f"cfg-w{i}", **settings) for i in range(2)]  # idle until jobs come
        try:
            r = httpx.post(f"{base}/v1/configurations", json=body, timeout=120)
            assert r.status_code == 201, r.text
            key = r.json()["configuration_key"]
            refined = [e["problem_key"] for e in r.json()["configurations"]["scored"] if e["refined"]]
            assert len(refined) == 3
            events = []
            with httpx.stream("GET", f"{base}/v1/configurations/{key}/events", timeout=90) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:]))
                        states = {e["problem_key"]: e["job_state"] for e in events[-1]["scored"]}
                        if all(states[k] == "done" for k in refined):
                            break
            repo = Repository(engine)
            # "name@host/pid=..." (each job runs in a forked process); a plan proven optimal at revision 1
            # has no run and no worker
            ran_on = {k: repo.job(k).worker.split("@")[0] for k in refined if repo.job(k).worker}
            assert len(ran_on) >= 2 and len(set(ran_on.values())) == 2, (ran_on, [w.output() for w in workers])
            final = httpx.get(f"{base}/v1/configurations/{key}").json()
            for e in final["scored"]:  # the ranking reads each candidate's best plan now
                best = httpx.get(f"{base}/v1/plans/{e['problem_key']}").json()
                assert e["revision"] == best["revision"]
                assert abs(e["tokens_per_s_per_gpu"] - round(best["tokens_per_s_per_gpu"], 2)) < 1e-6
            tokens = [e["tokens_per_s_per_gpu"] for e in final["candidates"]]
            assert tokens == sorted(tokens, reverse=True) and len(events) >= 2
        finally:
            for w in workers:
                w.stop()
            server.stop()
            engine.dispose()
            drop_queue(queue)
