"""Event streams a terminal can read, against a real `pipeplan serve` (embedded SQLite, one worker
thread): a stream whose job has ended says so and closes, a brief mode links each revision's plan
instead of carrying it, a malformed Last-Event-ID is a 422 before the stream starts (issue 38 point 5,
issue 39 point 3), and a first plan at its proven bound is revision 1 "optimal" with no second
"optimal" revision counted as an improvement (issue 38 point 4)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from service_support import hard_problem, make_problem, problem_doc, start_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streams")
    proc, base = start_server(tmp, data_dir=tmp, embedded_workers=1, solver_workers=1, sse_poll_s=0.5)
    yield base, proc
    proc.stop()


def read_events(response: httpx.Response, limit_s: float = 20.0) -> list[tuple[str, dict]]:
    """Every (event, data) until the server closes the stream (pings skipped)."""
    events, name, deadline = [], None, time.monotonic() + limit_s
    for line in response.iter_lines():
        assert time.monotonic() < deadline, f"the stream stayed open: {events}"
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:") and name:
            events.append((name, json.loads(line[5:])))
            name = None
    return events


def test_first_plan_at_its_bound_is_revision_1_optimal_and_its_stream_ends(server):
    base, proc = server
    problem = make_problem(devices=4, microbatches=8, tag="at-bound")  # zb-h2 meets the lower bound
    first = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(problem)}, timeout=30).json()
    key = first["problem_key"]
    assert first["plan"]["status"] == "optimal" and first["plan"]["makespan_ms"] == pytest.approx(
        first["plan"]["lower_bound_ms"]), first["plan"]["method"]
    assert (first["job"]["state"], first["job"]["outcome"], first["job"]["outcome_text"]) == (
        "done", "optimal", "optimal (proven)")
    t0 = time.monotonic()
    with httpx.stream("GET", f"{base}/v1/plans/{key}/events", timeout=30) as stream:
        events = read_events(stream)
    assert time.monotonic() - t0 < 5
    assert [e for e, _ in events] == ["revision", "end"], events
    end = events[-1][1]
    assert (end["state"], end["outcome"], end["revision"], end["plan"]) == ("done", "optimal", 1, f"/v1/plans/{key}")
    # a client that has every revision of a finished job is told to stop reconnecting
    again = httpx.get(f"{base}/v1/plans/{key}/events", headers={"Last-Event-ID": "1"}, timeout=10)
    assert again.status_code == 204 and again.content == b""
    time.sleep(1.0)  # the worker thread had the time to store a revision 2 (it used to: "optimal" again)
    assert [r["revision"] for r in httpx.get(f"{base}/v1/plans/{key}/revisions").json()["revisions"]] == [1]
    assert httpx.get(f"{base}/v1/plans/{key}/job").json()["improvements"] == 0


def test_a_followed_job_ends_its_stream_and_brief_mode_links_each_plan(server):
    base, proc = server
    problem = hard_problem(tag="brief", microbatches=8)
    first = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(problem), "time_budget_s": 2},
                       timeout=30).json()
    key = first["problem_key"]
    assert first["job"]["state"] == "queued"
    with httpx.stream("GET", f"{base}/v1/plans/{key}/events", params={"summary": "true"}, timeout=30) as stream:
        events = read_events(stream, limit_s=30)
    names = [e for e, _ in events]
    assert names[0] == "revision" and names[-1] == "end" and "job" in names, names
    end = events[-1][1]
    job = httpx.get(f"{base}/v1/plans/{key}/job").json()
    assert end["state"] == job["state"] == "done" and end["outcome"] == job["outcome"], (end, job)
    revisions = [d for e, d in events if e == "revision"]
    assert end["revision"] == revisions[-1]["revision"] == httpx.get(f"{base}/v1/plans/{key}").json()["revision"]
    for brief in revisions:  # no plan body in the stream: each event names its plan's URL
        assert "devices" not in brief and brief["plan"] == f"/v1/plans/{key}/revisions/{brief['revision']}"
        plan = httpx.get(f"{base}{brief['plan']}", timeout=10).json()
        assert (plan["revision"], plan["makespan_ms"]) == (brief["revision"], brief["makespan_ms"])
    # `follow` keeps a stream open after the job (for a later refine run)
    with httpx.stream("GET", f"{base}/v1/plans/{key}/events", params={"follow": "true", "summary": "true"},
                      timeout=httpx.Timeout(10, read=2)) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("event: revision")
        with pytest.raises(httpx.ReadTimeout):
            for line in lines:
                assert not line.startswith("event: end"), line


@pytest.mark.parametrize("header", [b"\xb2", b"1\xb2", "٣".encode(), b"9" * 5000, b"-1", b"1e3"])
def test_a_malformed_last_event_id_is_a_422_before_the_stream_starts(server, header):
    base, proc = server
    key = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem(tag="leid"))},
                     timeout=30).json()["problem_key"]
    r = httpx.get(f"{base}/v1/plans/{key}/events", headers={"Last-Event-ID": header}, timeout=10)
    assert r.status_code == 422, (header[:20], r.status_code, r.text[:200])
    assert r.json()["message"].startswith("Last-Event-ID: must be a revision number"), r.text
    assert "Traceback" not in proc.output()
