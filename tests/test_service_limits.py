"""Bounded work against a real `pipeplan serve` process: sizes refused before any expensive step,
heavy POSTs time-boxed and killed, admission limits (heavy POSTs, streams, write rate) answered
with 503/429 and Retry-After instead of queueing without end."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from service_support import make_problem, problem_doc, start_server, wait_for

pytestmark = pytest.mark.integration


def _spec(devices: int, microbatches: int, layers: int = 8, **extra) -> dict:
    return {"model": {"layers": layers, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096},
            "hardware": "H100-80GB", "training": {"devices": devices, "microbatches": microbatches}, **extra}


@pytest.fixture
def server(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, inline_timeout_s=2, max_expensive_requests=1,
                              admission_wait_s=0, write_rate_per_min=0)
    yield base
    proc.stop()


def test_oversized_spec_fields_are_refused_before_conversion(server):
    tiny = {"model": {"layers": 10**7, "hidden": 8, "heads": 1, "vocab": 8, "seq_len": 8},
            "hardware": "H100-80GB", "training": {"devices": 2, "microbatches": 4}}
    assert len(json.dumps({"spec": tiny})) < 430
    t0 = time.monotonic()
    r = httpx.post(f"{server}/v1/plans", json={"spec": tiny}, timeout=30)
    assert r.status_code == 422 and r.json()["error"] == "too_large", r.text
    assert r.json()["message"].startswith("spec.model.layers: 10000000 layers exceed the limit")
    assert time.monotonic() - t0 < 1.0
    auto = httpx.post(f"{server}/v1/plans", json={"spec": _spec(64, 256, layers=160, partition="auto")}, timeout=30)
    assert auto.status_code == 422 and auto.json()["message"].startswith('spec.partition: "auto"'), auto.text
    for field, spec in (("training.devices", _spec(100_000, 4)), ("training.microbatches", _spec(2, 10**6))):
        r = httpx.post(f"{server}/v1/plans", json={"spec": spec}, timeout=30)
        assert r.status_code == 422 and r.json()["message"].startswith(f"spec.{field}"), r.text
    doc = problem_doc(make_problem())
    doc["p2p_ms"] = 1e8
    r = httpx.post(f"{server}/v1/plans", json={"problem": doc}, timeout=30)
    assert r.status_code == 422 and r.json()["message"].startswith("problem.p2p_ms"), r.text


def test_heavy_first_plan_is_time_boxed_and_admission_limited(server):
    big = {"spec": _spec(128, 256, layers=256)}  # its first plan takes far longer than the 2-s box
    results: list[httpx.Response] = []
    first = threading.Thread(target=lambda: results.append(httpx.post(f"{server}/v1/plans", json=big, timeout=60)))
    t0 = time.monotonic()
    first.start()
    wait_for(lambda: "pipeplan_inline_running 1.0" in httpx.get(f"{server}/metrics").text, 5, 0.02,
             what="the first plan to start")
    other = httpx.post(f"{server}/v1/plans", json={"spec": _spec(64, 64, layers=128)}, timeout=60)
    assert other.status_code == 503 and "retry-after" in other.headers, other.text  # the one slot is taken
    first.join(30)
    assert time.monotonic() - t0 < 6.0
    assert results[0].status_code == 503 and "retry-after" in results[0].headers, results[0].text
    assert "longer than 2 s" in results[0].json()["message"]
    small = httpx.post(f"{server}/v1/plans", json={"problem": problem_doc(make_problem())}, timeout=30)
    assert small.status_code == 201, small.text  # the slot was given back; the server is fine


def test_write_rate_limit_per_client_answers_429(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, write_rate_per_min=2)
    try:
        codes = [httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem())}, timeout=30)
                 for _ in range(3)]
        assert [c.status_code for c in codes[:2]] == [201, 201]
        assert codes[2].status_code == 429 and int(codes[2].headers["retry-after"]) >= 1, codes[2].text
    finally:
        proc.stop()
