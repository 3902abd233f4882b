"""The OpenAPI document is the API (issue 15, item 9): schemathesis with every check against a real
`pipeplan serve` on SQLite and on PostgreSQL, bounded (a few examples per operation, a time box), and
the docs pages served from the package with no CDN."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest
from service_support import (
    BIN,
    ROOT,
    make_problem,
    pg_available,
    pg_schema,
    problem_doc,
    service_env,
    start_server,
)

CONFIG = ROOT / "tests" / "schemathesis.toml"


@pytest.fixture(params=["sqlite", "postgresql"])
def live(request, tmp_path):
    """(base URL, key of one stored plan) on a live server over each database."""
    if request.param == "postgresql" and not pg_available():
        pytest.fail("PostgreSQL is not reachable (the service tests need it)")
    ctx = pg_schema() if request.param == "postgresql" else None
    db = {"database_url": ctx.__enter__()[0], "auto_migrate": "true"} if ctx else {"data_dir": tmp_path}
    # long polls capped at 2 s: a generated `wait` would otherwise hold a request for the full 60 s
    proc, base = start_server(tmp_path, embedded_workers=0, long_poll_max_s=2, **db)
    try:
        r = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(make_problem(tag=f"st-{request.param}"))},
                       timeout=30)
        assert r.status_code == 201, r.text
        yield base, r.json()["problem_key"]
    finally:
        proc.stop()
        if ctx:
            ctx.__exit__(None, None, None)
    log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def test_schemathesis_finds_nothing(live, tmp_path):
    base, key = live
    st = shutil.which("st", path=str(BIN))
    if st is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    cmd = [st, "--config-file", str(CONFIG), "run", f"{base}/openapi.json", "--checks", "all", "--max-examples", "4",
           "--workers", "1", "--request-timeout", "10", "--seed", "15", "--generation-database", "none",
           "--max-time", "20", "--no-color"]
    out = subprocess.run(cmd, env={**service_env(), "PP_KEY": key}, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-6000:]
    assert re.search(r"\d+ generated, \d+ passed", report), report[-2000:]


def test_docs_work_offline(live, tmp_path):
    """/docs and /redoc reference only assets this server serves (no CDN), and they are served; `/`
    leads to the dashboard and the `serve` banner names both."""
    base, _ = live
    banner = "".join(p.read_text(errors="replace") for p in tmp_path.glob("serve-*.log"))
    assert f"{base}/dashboard/" in banner and f"{base}/docs" in banner, banner[:600]
    for page in ("/docs", "/redoc"):
        html = httpx.get(base + page, timeout=10)
        assert html.status_code == 200
        refs = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", html.text)
        assert refs, html.text
        for ref in refs:
            assert ref.startswith("/"), f"{page} references {ref} (not served by this process)"
            asset = httpx.get(base + ref, timeout=10)
            assert asset.status_code == 200 and len(asset.content) > 0, (page, ref, asset.status_code)
    assert httpx.get(base + "/", timeout=10, follow_redirects=False).headers["location"] == "/dashboard/"
