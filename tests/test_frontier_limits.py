"""POST /v1/frontiers bounded like every other expensive request, against a real `pipeplan serve`:
its own size limit (points x problem size) refused before any work, its first plans computed in a
killable, time-boxed child (not in the API process), one frontier at a time, the write rate limit."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from service_support import make_problem, problem_doc, start_server, wait_for

pytestmark = pytest.mark.integration


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_frontier_too_large_for_the_server_is_refused_at_once_and_frontiers_are_rate_limited(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, write_rate_per_min=3)
    try:
        big = make_problem(devices=32, microbatches=128, offload=True, limit_mib=8000.0)  # 16,384 ops
        t0 = time.monotonic()
        r = httpx.post(f"{base}/v1/frontiers", json={"problem": problem_doc(big), "points": 64}, timeout=30)
        assert r.status_code == 422 and r.json()["error"] == "too_large", r.text
        assert r.json()["message"].startswith("points: 64 points on a problem of 16,384 ops")
        assert "at most 4 points fit this problem" in r.json()["message"]
        assert time.monotonic() - t0 < 2.0
        # every frontier request is a write: the rate limit counts it (the refused one above too)
        doc = problem_doc(make_problem(devices=2, microbatches=4, offload=True, limit_mib=4000.0, tag="rate"))
        codes = [httpx.post(f"{base}/v1/frontiers", json={"problem": doc, "points": 2}, timeout=60) for _ in range(3)]
        assert [c.status_code for c in codes[:2]] == [201, 200], [c.text for c in codes]
        assert codes[2].status_code == 429 and int(codes[2].headers["retry-after"]) >= 1, codes[2].text
    finally:
        proc.stop()


def test_frontier_first_plans_run_in_a_time_boxed_child_one_frontier_at_a_time(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, frontier_timeout_s=2,
                              max_frontier_requests=1, admission_wait_s=0)
    try:
        slow = make_problem(devices=8, microbatches=32, offload=True, limit_mib=12000.0, tag="slow")
        cpu_before = _cpu_s(proc.popen.pid)
        results: list[httpx.Response] = []
        first = threading.Thread(target=lambda: results.append(httpx.post(
            f"{base}/v1/frontiers", json={"problem": problem_doc(slow), "points": 24}, timeout=60)))
        t0 = time.monotonic()
        first.start()
        wait_for(lambda: "pipeplan_inline_running 1.0" in httpx.get(f"{base}/metrics").text, 5, 0.02,
                 what="the frontier to start")
        other = make_problem(devices=2, microbatches=4, offload=True, limit_mib=4000.0, tag="other")
        busy = httpx.post(f"{base}/v1/frontiers", json={"problem": problem_doc(other), "points": 3}, timeout=30)
        assert busy.status_code == 503 and int(busy.headers["retry-after"]) >= 1, busy.text
        assert "frontier" in busy.json()["message"]
        first.join(30)
        assert time.monotonic() - t0 < 8.0
        assert results[0].status_code == 503 and "retry-after" in results[0].headers, results[0].text
        assert "longer than 2 s" in results[0].json()["message"]
        # the seconds of planning were spent in the child that was killed, not in the API process
        assert _cpu_s(proc.popen.pid) - cpu_before < 1.5
        ok = httpx.post(f"{base}/v1/frontiers", json={"problem": problem_doc(other), "points": 3}, timeout=60)
        assert ok.status_code == 201, ok.text  # both slots were given back
        points = ok.json()["frontier"]["points"]
        assert len(points) >= 3 and all(httpx.get(f"{base}/v1/plans/{p['problem_key']}").status_code == 200
                                        for p in points)
    finally:
        proc.stop()
