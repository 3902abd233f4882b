"""Stream admission against a real `pipeplan serve` process: an open SSE stream (API or dashboard) or
long-poll holds one of `max_streams` slots for its whole life, the next one gets 503 with Retry-After
at once (instead of hanging), and the slot comes back when the first stream closes."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from service_support import make_problem, problem_doc, start_server, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def server(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, max_streams=1, sse_poll_s=0.5,
                              retry_after_s=3)
    yield base
    proc.stop()


def _stream_count(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith("pipeplan_open_streams "):
            return float(line.split()[1])
    raise AssertionError("pipeplan_open_streams missing from /metrics")


def _assert_refused(base: str, path: str) -> None:
    t0 = time.monotonic()
    with httpx.stream("GET", f"{base}{path}", timeout=10) as r:
        assert r.status_code == 503, (path, r.status_code)
        assert r.headers.get("retry-after") == "3", r.headers
        assert time.monotonic() - t0 < 2.0
        r.read()
        assert "event streams are open" in r.json()["message"]


@pytest.mark.parametrize("first_path", ["/v1/plans/{key}/events", "/dashboard/events?key={key}"])
def test_second_stream_is_refused_while_the_first_is_open(server, first_path):
    # above its bound (a job stays queued: no worker), so its stream stays open
    key = httpx.post(f"{server}/v1/plans", json={"problem": problem_doc(make_problem(limit_mib=2100))},
                     timeout=30).json()["problem_key"]
    first = first_path.format(key=key)
    with httpx.stream("GET", f"{server}{first}", timeout=30) as stream:
        assert stream.status_code == 200, stream.status_code
        lines = stream.iter_lines()  # kept: a discarded iterator closes the connection
        next(lines)  # the stream is open and has sent something
        time.sleep(0.3)  # well past the handler's return: the slot must outlive it
        assert _stream_count(server) == 1
        for path in (f"/v1/plans/{key}/events", f"/dashboard/events?key={key}", "/dashboard/events",
                     f"/v1/plans/{key}?min_revision=99&wait=5"):
            _assert_refused(server, path)
    wait_for(lambda: _stream_count(server) == 0, 10, 0.1, what="the closed stream's slot to come back")
    with httpx.stream("GET", f"{server}/v1/plans/{key}/events", timeout=30) as again:
        assert again.status_code == 200
        lines = again.iter_lines()
        next(lines)


def test_long_poll_holds_its_slot_until_it_answers(server):
    key = httpx.post(f"{server}/v1/plans", json={"problem": problem_doc(make_problem())}, timeout=30).json()[
        "problem_key"]
    answers: list[httpx.Response] = []
    poll = threading.Thread(target=lambda: answers.append(
        httpx.get(f"{server}/v1/plans/{key}?min_revision=99&wait=2", timeout=30)))
    poll.start()
    wait_for(lambda: _stream_count(server) == 1, 5, 0.05, what="the long-poll to start")
    _assert_refused(server, f"/v1/plans/{key}/events")
    poll.join(10)
    assert answers[0].status_code == 200
    wait_for(lambda: _stream_count(server) == 0, 5, 0.05, what="the long-poll's slot to come back")
