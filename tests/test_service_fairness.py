"""Fair queuing against a real `pipeplan serve` (issue 39 point 6): one identity's queued and running
solve-seconds are capped (429 with Retry-After), another identity's next run goes ahead of that backlog
on the real Redis queue, and identities are what the server verified: without configured keys, a fresh
random X-API-Key per request is the same client address for the rate limit and the cap."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest
import redis
from rq import Queue
from service_support import REDIS_URL, hard_problem, problem_doc, queue_name, start_server, wait_for  # noqa: F401

pytestmark = pytest.mark.integration


def post(base: str, budget_s: float, key: str | None = None) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(hard_problem(microbatches=4)),
                                                "time_budget_s": budget_s}, headers=headers, timeout=30)


def test_one_keys_backlog_is_capped_and_another_keys_run_goes_first(tmp_path, queue_name):  # noqa: F811
    proc, base = start_server(tmp_path, data_dir=tmp_path, redis_url=REDIS_URL, queue_name=queue_name,
                              api_keys="key-a,key-b", max_queued_solve_s=20)  # no worker: the queue stays
    try:
        a1, a2 = post(base, 8, "key-a"), post(base, 8, "key-a")
        assert (a1.status_code, a2.status_code) == (201, 201), (a1.text, a2.text)
        refused = post(base, 8, "key-a")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1, refused.text
        message = refused.json()["message"]
        assert message.startswith("time_budget_s: this client has 2 run(s) with 16 s") and "20 s" in message
        b1 = post(base, 8, "key-b")  # A's backlog is A's: B is not refused, and not queued behind it
        assert b1.status_code == 201, b1.text
        order = [job.args[0] for job in Queue(queue_name, connection=redis.Redis.from_url(REDIS_URL)).jobs]
        keys = [r.json()["problem_key"] for r in (a1, a2, b1)]
        assert order == [keys[2], keys[0], keys[1]], order
        cancel = httpx.post(f"{base}/v1/plans/{keys[1]}/cancel", headers={"X-API-Key": "key-a"}, timeout=10)
        assert cancel.json()["job"]["state"] == "cancelled"
        assert post(base, 8, "key-a").status_code == 201  # a cancelled run no longer counts
        assert "Traceback" not in proc.output()
    finally:
        proc.stop()


def test_without_keys_the_client_address_is_the_identity_whatever_key_it_sends(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, write_rate_per_min=5,
                              max_queued_solve_s=10)
    try:
        codes = [post(base, 4, uuid.uuid4().hex) for _ in range(3)]
        assert [c.status_code for c in codes] == [201, 201, 429], [c.text for c in codes]
        assert "limit of 10 s per client" in codes[2].json()["message"]  # one address: 12 s > 10 s
        assert post(base, 1, uuid.uuid4().hex).status_code == 201
        assert post(base, 1, uuid.uuid4().hex).status_code == 201
        limited = post(base, 1, uuid.uuid4().hex)  # the sixth write this minute, fresh key or not
        assert limited.status_code == 429 and "writes per minute" in limited.json()["message"], limited.text
    finally:
        proc.stop()


def test_the_embedded_queue_takes_runs_marked_at_front_first():
    from pipeplan.service.queue import LocalQueue

    ran: list[str] = []
    gate = threading.Event()
    queue = LocalQueue(lambda key, run_id: (gate.wait(10), ran.append(run_id)), workers=1)
    try:
        queue.enqueue("k", "busy", 1.0)  # holds the one worker until the gate opens
        wait_for(lambda: queue.depth() == 0, 5, 0.01, what="the worker to take the first run")
        for run_id, at_front in (("a1", False), ("a2", False), ("b1", True)):
            queue.enqueue("k", run_id, 1.0, at_front=at_front)
        assert queue.depth() == 3
        gate.set()
        wait_for(lambda: len(ran) == 4, 10, what="the four runs")
    finally:
        queue.close()
    assert ran == ["busy", "b1", "a1", "a2"]
