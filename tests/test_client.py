"""The training-job client against a real `pipeplan serve` (embedded: SQLite + in-process worker).

Each test talks HTTP to a service subprocess on a free port; nothing of ours is mocked.
"""

from __future__ import annotations

import threading
import time

import pytest
from core_schedules import make_problem
from pipeplan.client import (
    OnlinePlan,
    PlanClient,
    PlanNotFound,
    PlanRequestError,
    PlanStore,
    ServiceUnavailable,
    WaitTimeout,
)
from pipeplan.planner.validator import assert_valid
from service_proc import Service, free_port

pytest.importorskip("fastapi", reason="the service needs the server extra: pip install -e '.[server]'")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("serve")).start()
    yield svc
    svc.stop()


@pytest.fixture
def problem():
    """Under a memory limit ZB-H1 is revision 1, above the bound: its refine job stores a better plan."""
    return make_problem(p=4, m=8, p2p=0.1, limit=400.0)


def test_submit_get_etag_and_wait(service, problem):
    with PlanClient(service.url) as client:
        submission = client.submit(problem, time_budget_s=2)
        assert submission.key == problem.key()
        assert_valid(problem, submission.plan)
        plan, etag = client.get_with_etag(submission.key)
        assert plan.revision >= submission.revision and etag
        assert client.get(submission.key, etag=etag) is None  # 304: nothing newer
        refined = client.wait(submission.key, min_revision=2, timeout=60)
        assert refined.revision >= 2
        assert_valid(problem, refined)
        assert refined.makespan_ms <= submission.plan.makespan_ms + 1e-9
        # the export the runtime loads is served for the same key
        assert client.torch_csv(submission.key).splitlines()[0].startswith("0F0")


def test_follow_resumes_after_a_revision_over_sse_and_by_polling(service, problem):
    with PlanClient(service.url) as client:
        key = client.submit(problem, time_budget_s=2).key
        best = client.wait(key, min_revision=2, timeout=60)
        for use_sse in (True, False):
            stop = threading.Event()
            seen = []
            for plan in client.follow(key, after_revision=1, stop=stop, use_sse=use_sse, poll_interval_s=0.2):
                seen.append(plan.revision)
                if plan.revision >= best.revision:
                    break
            assert seen and seen[0] >= 2 and seen == sorted(set(seen)), (use_sse, seen)


def test_follow_stops_promptly_when_asked(service, problem):
    with PlanClient(service.url) as client:
        key = client.submit(problem).key
        latest = client.get(key).revision
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        started = time.monotonic()
        later = [p.revision for p in client.follow(key, after_revision=latest, stop=stop)]
        assert time.monotonic() - started < 5
        assert all(r > latest for r in later)


def test_errors_carry_the_servers_reason(service, problem):
    with PlanClient(service.url) as client:
        with pytest.raises(PlanNotFound) as missing:
            client.get("0" * 64)
        assert missing.value.status == 404
        bad = problem.model_dump(mode="json")
        bad["stages"][0]["forward_ms"] = -1
        with pytest.raises(PlanRequestError) as invalid:
            client.submit(bad)
        assert invalid.value.status == 422
        assert any("forward_ms" in r for r in invalid.value.reasons), invalid.value.reasons
        tight = problem.model_dump(mode="json")
        for device in tight["devices"]:
            device["memory_limit_mib"] = 50.0
        with pytest.raises(PlanRequestError) as infeasible:
            client.submit(tight)
        assert infeasible.value.status == 422
        assert "min_memory_mib" in " ".join(infeasible.value.reasons), infeasible.value.reasons
        assert infeasible.value.body["min_memory_mib"][0] > 50.0
        with pytest.raises(WaitTimeout):
            client.wait(client.submit(problem).key, min_revision=10_000, timeout=0.5)


def test_unreachable_service_is_unavailable_after_retries(problem):
    client = PlanClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01, max_backoff_s=0.02)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        client.get(problem.key())
    assert time.monotonic() - started < 5
    assert not client.health()


def test_online_plan_swaps_at_boundaries_and_restarts_from_disk(service, problem, tmp_path):
    store = PlanStore(tmp_path / "plans")
    with OnlinePlan(PlanClient(service.url), problem, time_budget_s=2, store=store, poll_interval_s=0.2) as online:
        first = online.current()
        assert first is not None and first.problem_key == problem.key()
        newer = online.wait_newer(first.revision, timeout=60) if first.revision < 2 else first
        assert newer is not None
        swapped = online.poll_swap()
        assert (swapped is None) == (first.revision >= 2)
        assert online.current().revision >= 2
        assert online.poll_swap() is None  # nothing newer: no swap
    cached = store.load(problem.key())
    assert cached is not None and cached.revision >= 2

    # a restarted job with the service gone starts from the disk copy, without blocking
    dead = PlanClient(f"http://127.0.0.1:{free_port()}", retries=0, timeout_s=1)
    with OnlinePlan(dead, problem, store=store, retry_s=0.1) as offline:
        assert offline.current().revision == cached.revision
        assert offline.last_error
    # nothing on disk and no service: the fallback plan, or a clear error without one
    empty = PlanStore(tmp_path / "empty")
    from core_schedules import one_f_one_b, plan_of

    fallback_plan = plan_of(problem, one_f_one_b(problem), method="fallback-1f1b")
    dead = PlanClient(f"http://127.0.0.1:{free_port()}", retries=0, timeout_s=1)
    with OnlinePlan(dead, problem, store=empty, fallback=lambda p: fallback_plan, retry_s=0.1) as fallback:
        assert fallback.current().method == "fallback-1f1b"
    with pytest.raises(ServiceUnavailable, match="no plan"):
        OnlinePlan(PlanClient(f"http://127.0.0.1:{free_port()}", retries=0), problem, store=empty)


def test_online_plan_recovers_when_the_service_comes_back(problem, tmp_path):
    """Start with no service (fallback plan), then the service appears: the follower submits and the
    refined revision arrives; stopping the service again leaves current() working."""
    from core_schedules import one_f_one_b, plan_of

    svc = Service(tmp_path)
    fallback_plan = plan_of(problem, one_f_one_b(problem), method="fallback-1f1b")
    client = PlanClient(svc.url, retries=0, timeout_s=2)
    with OnlinePlan(client, problem, time_budget_s=2, store=tmp_path / "plans", fallback=lambda p: fallback_plan,
                    retry_s=0.2, poll_interval_s=0.2) as online:
        assert online.current().method == "fallback-1f1b"
        svc.start()
        try:
            arrived = online.wait_newer(1, timeout=60)
            assert arrived is not None and arrived.revision >= 2, online.last_error
            swapped = online.poll_swap()  # a later revision may have arrived in between
            assert swapped is not None and swapped.revision >= arrived.revision
        finally:
            svc.stop()
        time.sleep(0.5)
        online.poll_swap()  # whatever arrived before the service stopped
        latest = online.current()
        assert latest.revision >= swapped.revision
        started = time.monotonic()
        assert online.current().revision == latest.revision
        assert online.poll_swap() is None
        assert time.monotonic() - started < 0.1


def test_online_plan_from_a_model_spec_gets_the_services_problem(service, tmp_path):
    spec = {"model": {"name": "tiny", "layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16,
                      "dtype": "fp32"},
            "hardware": {"name": "cpu", "peak_tflops": 0.01, "hbm_gib": 1.0, "host_link_gbps": 1, "link_gbps": 2},
            "training": {"devices": 2, "microbatches": 4}}
    with OnlinePlan(PlanClient(service.url), spec, time_budget_s=2, store=tmp_path, start=False) as online:
        assert online.problem is not None and online.problem.metadata["partition"]
        assert online.key == online.problem.key()
        assert_valid(online.problem, online.current())
