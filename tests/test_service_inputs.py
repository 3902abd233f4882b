"""Inputs that used to crash a real `pipeplan serve` or poison a key (issue 39, points 1 and 2): traces
with infinite or overflowing numbers, deep metadata, lone UTF-16 surrogates anywhere in a body, and
the guarantee behind them: no store writes a document that does not read back (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.trace import Trace
from pipeplan.service.models import ProblemRow, TraceRow
from pipeplan.service.repository import Repository, UnreadableDocument
from pipeplan.service.trace_store import TraceStore
from service_support import any_db_url, gpipe_plan, make_problem, migrated_engine, problem_doc, start_server  # noqa: F401
from sqlalchemy import func, select

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inputs")
    proc, base = start_server(tmp, data_dir=tmp, embedded_workers=0)
    yield base, proc
    proc.stop()


def faithful_trace(plan: dict, iteration: int = 0) -> dict:
    """A trace document that ran exactly as `plan` (plan v1) says."""
    devices = [{"device": dp["device"], "ops": [{k: op[k] for k in ("kind", "stage", "mb", "start_ms", "end_ms")}
                                                for op in dp["ops"]]} for dp in plan["devices"]]
    return {"problem_key": plan["problem_key"], "revision": plan["revision"], "iteration": iteration,
            "clock": "monotonic", "device_kind": "cpu", "makespan_ms": plan["makespan_ms"], "devices": devices}


def post_raw(base: str, path: str, text: str) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=text.encode(), headers={"content-type": "application/json"},
                      timeout=30)


def test_hostile_traces_are_refused_and_never_poison_their_key(server):
    base, proc = server
    created = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem(tag="traces"))}, timeout=30)
    assert created.status_code == 201, created.text
    plan = created.json()["plan"]
    path = f"/v1/plans/{plan['problem_key']}/traces"

    def hostile(**change) -> dict:
        doc = faithful_trace(plan)
        doc.update(change)
        return doc

    overflowing = faithful_trace(plan)
    overflowing["devices"][0]["ops"][0].update(start_ms=-1.7e308, end_ms=1.7e308)
    deep: dict = {}
    for _ in range(400):
        deep = {"x": deep}
    cases = {  # body text -> the field its 422 must name
        json.dumps(hostile(makespan_ms=math.inf)): "makespan_ms",
        json.dumps(hostile(makespan_ms=1e308)): "makespan_ms",
        json.dumps(overflowing): "devices.0.ops.0.start_ms",
        json.dumps(hostile(metadata=deep)): "metadata",
        json.dumps(hostile(metadata={"host": "\ud800"})): "metadata.host",
        json.dumps(hostile(metadata={"nan": math.nan})): "metadata.nan",
    }
    for text, field in cases.items():
        r = post_raw(base, path, text)
        assert r.status_code == 422, (field, r.status_code, r.text[:300])
        assert r.json()["error"] == "invalid_request" and field in r.json()["message"], (field, r.text[:300])
    # the key is not poisoned: good traces of it are stored and answered, and they read back
    for iteration in (1, 2):
        r = httpx.post(f"{base}{path}", json=faithful_trace(plan, iteration), timeout=30)
        assert r.status_code == 201, r.text
    listed = httpx.get(f"{base}{path}", timeout=10).json()["traces"]
    assert sorted(t["iteration"] for t in listed) == [1, 2]
    for t in listed:
        assert Trace.model_validate(httpx.get(f"{base}{t['links']['self']}", timeout=10).json()).iteration == \
            t["iteration"]
    assert "Traceback" not in proc.output()


def test_lone_surrogates_are_refused_at_the_edge_in_every_body(server):
    base, proc = server
    problem = problem_doc(make_problem(tag="surrogates"))
    for metadata, field in (({"model": "llama\ud800"}, "problem.metadata.model"),
                            ({"run": {"owner": "\udfff"}}, "problem.metadata.run.owner"),
                            ({"\ud800": 1}, "problem.metadata")):
        text = json.dumps({"problem": {**problem, "metadata": metadata}})  # ASCII: the surrogate as \\udXXX
        r = post_raw(base, "/v1/plans", text)
        assert r.status_code == 422 and r.json()["message"].startswith(field), r.text
        assert "surrogate" in r.json()["message"]
    # a valid pair (an emoji, escaped) is text, and is stored and read back
    ok = post_raw(base, "/v1/plans", json.dumps({"problem": {**problem, "metadata": {"model": "llama \U0001F999"}}}))
    assert ok.status_code == 201, ok.text
    key = ok.json()["problem_key"]
    assert httpx.get(f"{base}/v1/plans/{key}/problem", timeout=10).json()["metadata"]["model"] == "llama \U0001F999"
    # other routes' bodies pass the same edge
    r = post_raw(base, f"/v1/plans/{key}/refine", '{"time_budget_s": 1, "x": "\\udc00"}')
    assert r.status_code == 422 and r.json()["message"].startswith("x: "), r.text
    r = post_raw(base, "/v1/plans", json.dumps({"problem": {**problem, "p2p_ms": math.nan}}))
    assert r.status_code == 422 and r.json()["message"].startswith("problem.p2p_ms: NaN"), r.text
    assert "Traceback" not in proc.output()


def test_a_document_that_would_not_read_back_is_never_stored(any_db_url):  # noqa: F811
    """The stores' own guarantee, beneath the models' validation: documents built around it
    (model_construct) are refused before anything is written, on both databases."""
    engine = migrated_engine(any_db_url)
    try:
        repo = Repository(engine)
        problem = make_problem(tag="read-back")
        key = problem.key()
        poisoned = Problem.model_construct(**{**dict(problem), "metadata": {"model": "llama\ud800"}})
        with pytest.raises(UnreadableDocument):
            repo.store_first(poisoned, gpipe_plan(problem), 5.0, key=key)
        repo.store_first(problem, gpipe_plan(problem), 5.0, key=key)
        plan = Plan.model_validate_json(repo.revision_plan(key, 1))
        trace = Trace.model_validate(faithful_trace(plan.model_dump(mode="json")))
        bad = trace.model_construct(**{**dict(trace), "makespan_ms": math.inf}).model_dump_json()
        with pytest.raises(UnreadableDocument):
            TraceStore(repo).add(key, 1, "0" * 64, bad, iteration=0, device_kind="cpu", predicted_ms=1.0,
                                 measured_ms=math.inf, calibrated_key=None)
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(TraceRow)).scalar() == 0
            assert conn.execute(select(func.count()).select_from(ProblemRow)).scalar() == 1
        assert repo.get_problem(key) == problem
    finally:
        engine.dispose()
