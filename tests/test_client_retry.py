"""Retry policy of PlanClient against a tiny scripted HTTP server (an outside service stand-in):
5xx/429 are retried honouring Retry-After, 4xx are not, and the server's reasons reach the caller."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from core_schedules import make_problem, one_f_one_b, plan_of
from pipeplan.client import PlanClient, PlanRequestError, ServiceUnavailable


class Scripted:
    """Serves the queued (status, headers, body) answers in order, then repeats the last one."""

    def __init__(self, answers):
        self.answers, self.requests, self.headers = list(answers), [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("content-length") or 0)
                outer.requests.append((self.command, self.path, time.monotonic(), self.rfile.read(length)))
                outer.headers.append(dict(self.headers))
                status, headers, body = outer.answers.pop(0) if len(outer.answers) > 1 else outer.answers[0]
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"content-type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def plan_doc():
    problem = make_problem(p=2, m=2)
    return problem, json.loads(plan_of(problem, one_f_one_b(problem)).model_dump_json())


def test_503_with_retry_after_is_retried_until_it_succeeds(plan_doc):
    problem, doc = plan_doc
    server = Scripted([(503, {"Retry-After": "0.3"}, {"error": "unavailable", "message": "db down"}),
                       (502, {}, b"bad gateway"), (200, {"etag": '"r1"'}, doc)])
    try:
        client = PlanClient(server.url, retries=3, backoff_s=0.01, max_backoff_s=1.0)
        plan = client.get(problem.key())
        assert plan.revision == doc["revision"]
        times = [t for _, _, t, _ in server.requests]
        assert len(times) == 3
        assert times[1] - times[0] >= 0.28, "Retry-After was not honoured"
    finally:
        server.close()


def test_retries_give_up_with_service_unavailable(plan_doc):
    problem, _ = plan_doc
    server = Scripted([(503, {"Retry-After": "0"}, {"error": "unavailable", "message": "the database is down"})])
    try:
        client = PlanClient(server.url, retries=2, backoff_s=0.01, max_backoff_s=0.05)
        with pytest.raises(ServiceUnavailable, match="the database is down") as err:
            client.get(problem.key())
        assert err.value.status == 503 and len(server.requests) == 3
    finally:
        server.close()


def test_4xx_is_not_retried_and_carries_every_reason(plan_doc):
    problem, _ = plan_doc
    body = {"error": "invalid_request", "message": "two problems",
            "detail": ["problem.stages.0.forward_ms: must be > 0", "problem.devices: Field required"]}
    server = Scripted([(422, {}, body)])
    try:
        client = PlanClient(server.url, retries=3, backoff_s=0.01)
        with pytest.raises(PlanRequestError) as err:
            client.submit(problem)
        assert len(server.requests) == 1
        assert err.value.reasons == body["detail"]
        sent = json.loads(server.requests[0][3])
        assert sent["problem"]["num_devices"] == 2 and "spec" not in sent
    finally:
        server.close()


def test_api_key_is_sent_and_spec_documents_go_as_spec(plan_doc):
    problem, doc = plan_doc
    answer = {"problem_key": problem.key(), "revision": 1, "cached": False, "plan": doc, "job": None, "links": {}}
    server = Scripted([(201, {}, answer)])
    try:
        client = PlanClient(server.url, api_key="s3cret")
        submission = client.submit({"model": {"layers": 2}}, time_budget_s=5)
        assert submission.key == problem.key() and submission.plan.revision == 1
        assert server.headers[0].get("Authorization") == "Bearer s3cret"
        sent = json.loads(server.requests[0][3])
        assert sent == {"spec": {"model": {"layers": 2}}, "time_budget_s": 5}
    finally:
        server.close()


def _event(plan: dict) -> bytes:
    return f"id: {plan['revision']}\nevent: revision\ndata: {json.dumps(plan)}\n\n".encode()


def test_follow_reconnects_after_a_dropped_stream_and_resumes_with_last_event_id(plan_doc):
    pytest.importorskip("httpx_sse", reason="server-sent events need httpx-sse (the client polls without it)")
    problem, doc = plan_doc
    second = {**doc, "revision": 2}
    sse = {"content-type": "text/event-stream"}
    # each stream ends after one event, as when a proxy or the server drops the connection
    server = Scripted([(200, sse, b": ping\n\n" + _event(doc)), (200, sse, _event(second))])
    try:
        client = PlanClient(server.url, backoff_s=0.01)
        seen = []
        for plan in client.follow(problem.key()):
            seen.append(plan.revision)
            if len(seen) == 2:
                break
        assert seen == [1, 2]
        assert "Last-Event-ID" not in server.headers[0]
        assert server.headers[1]["Last-Event-ID"] == "1"
    finally:
        server.close()


def test_follow_polls_with_if_none_match_when_there_is_no_event_stream(plan_doc):
    pytest.importorskip("httpx_sse", reason="without httpx-sse the client polls from the start")
    problem, doc = plan_doc
    second = {**doc, "revision": 2}
    server = Scripted([(404, {}, {"error": "not_found", "message": "Not Found"}),  # no events route
                       (200, {"etag": '"r1"'}, doc), (304, {"etag": '"r1"'}, b""),
                       (200, {"etag": '"r2"'}, second)])
    try:
        client = PlanClient(server.url, backoff_s=0.01)
        seen = []
        for plan in client.follow(problem.key(), poll_interval_s=0.05):
            seen.append(plan.revision)
            if len(seen) == 2:
                break
        assert seen == [1, 2]
        assert [p for _, p, _, _ in server.requests][0].endswith("/events?follow=true")
        assert server.headers[2].get("If-None-Match") == '"r1"'
    finally:
        server.close()
