"""Exports are built once per revision and served cheaply, against a real `pipeplan serve` process:
the second GET comes from the on-disk cache (metrics counter, file untouched), If-None-Match gives
304, gzip is sent to clients that accept it, and plain bytes to those that do not."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.exports import chrome_trace, torch_csv
from service_support import make_problem, problem_doc, start_server

pytestmark = pytest.mark.integration


@pytest.fixture
def server(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0)
    yield base, tmp_path
    proc.stop()


def _counter(base: str, kind: str, result: str) -> float:
    want = f'pipeplan_export_cache_total{{kind="{kind}",result="{result}"}}'
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


def test_export_is_built_once_then_served_from_the_cache_with_etag_and_gzip(server):
    base, data_dir = server
    problem = make_problem(devices=4, microbatches=8)
    key = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(problem)}, timeout=30).json()["problem_key"]
    stored = Problem.model_validate_json(httpx.get(f"{base}/v1/plans/{key}/problem").text)
    plan = Plan.model_validate_json(httpx.get(f"{base}/v1/plans/{key}/revisions/1").text)
    url = f"{base}/v1/plans/{key}/export/chrome-trace.json?revision=1"

    first = httpx.get(url, headers={"Accept-Encoding": "gzip"}, timeout=30)
    assert first.status_code == 200 and first.headers["content-encoding"] == "gzip", first.headers
    assert first.json() == chrome_trace(stored, plan)  # httpx decoded the gzip
    cached = data_dir / "exports" / key[:2] / key / "r1.chrome-trace.json.gz"
    assert cached.is_file()
    mtime = cached.stat().st_mtime_ns
    assert _counter(base, "chrome-trace.json", "build") == 1

    with httpx.stream("GET", url, headers={"Accept-Encoding": "gzip"}, timeout=30) as second:
        raw = b"".join(second.iter_raw())  # the bytes on the wire: the cache file as it is
    assert raw == cached.read_bytes() and json.loads(gzip.decompress(raw)) == first.json()
    assert second.headers["etag"] == first.headers["etag"]
    assert _counter(base, "chrome-trace.json", "build") == 1
    assert _counter(base, "chrome-trace.json", "hit") == 1
    assert cached.stat().st_mtime_ns == mtime

    not_modified = httpx.get(url, headers={"If-None-Match": first.headers["etag"]}, timeout=30)
    assert not_modified.status_code == 304 and not_modified.content == b""
    plain = httpx.get(url, headers={"Accept-Encoding": "identity"}, timeout=30)
    assert plain.status_code == 200 and "content-encoding" not in plain.headers
    assert json.loads(plain.content) == first.json()

    csv = httpx.get(f"{base}/v1/plans/{key}/export/torch.csv", headers={"Accept-Encoding": "identity"}, timeout=30)
    assert csv.status_code == 200 and csv.text == torch_csv(stored, plan)
    assert csv.headers["x-pipeplan-revision"] == "1" and csv.headers["etag"] != first.headers["etag"]
    assert httpx.get(f"{base}/v1/plans/{key}/export/torch.csv?revision=99").status_code == 404


def test_plans_are_gzipped_for_clients_that_accept_it(server):
    base, _ = server
    key = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem(devices=4, microbatches=8))},
                     timeout=30).json()["problem_key"]
    zipped = httpx.get(f"{base}/v1/plans/{key}", headers={"Accept-Encoding": "gzip"})
    plain = httpx.get(f"{base}/v1/plans/{key}", headers={"Accept-Encoding": "identity"})
    assert zipped.headers.get("content-encoding") == "gzip" and "content-encoding" not in plain.headers
    assert zipped.json() == plain.json() and len(zipped.content) == len(plain.content)
    assert int(zipped.headers["content-length"]) < len(plain.content) / 3
    with httpx.stream("GET", f"{base}/v1/plans/{key}/events", headers={"Accept-Encoding": "gzip"}) as sse:
        assert "content-encoding" not in sse.headers  # event streams are never buffered by gzip


def test_dashboard_baselines_are_computed_once_and_kept_on_disk(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0)
    try:
        key = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem(devices=4, microbatches=8))},
                         timeout=30).json()["problem_key"]
        page = httpx.get(f"{base}/dashboard/plans/{key}/baselines", timeout=60)
        assert page.status_code == 200 and "zb-h1" in page.text.lower()
    finally:
        proc.stop()
    stored = tmp_path / "exports" / key[:2] / key / "baselines.json"
    rows = json.loads(stored.read_text())["rows"]
    assert {"name", "makespan_ms", "peak_mib", "reason"} <= set(rows[0])
    rows[0]["name"] = "marker-from-disk"  # a restarted server shows the stored table, not a recomputed one
    stored.write_text(json.dumps({"rows": rows}))
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0)
    try:
        assert "marker-from-disk" in httpx.get(f"{base}/dashboard/plans/{key}/baselines", timeout=60).text
        assert "marker-from-disk" in httpx.get(f"{base}/dashboard/plans/{key}", timeout=60).text  # not pending
    finally:
        proc.stop()


def test_dashboard_baselines_run_in_a_time_boxed_child(tmp_path):
    """The table is computed in a killable child process, not in the API's threads: past its time box
    the page says so (nothing to kill in a thread), and the API answers on."""
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0, baselines_timeout_s=0.05)
    try:
        key = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem(devices=8, microbatches=64))},
                         timeout=30).json()["problem_key"]
        page = httpx.get(f"{base}/dashboard/plans/{key}/baselines", timeout=60)
        assert page.status_code == 200 and "could not be computed" in page.text and "0.05 s" in page.text, page.text
        assert not (tmp_path / "exports" / key[:2] / key / "baselines.json").exists()
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
    finally:
        proc.stop()
