"""A frozen PostgreSQL (SIGSTOP) must not hang requests: 503 with Retry-After within 2 s, /readyz too,
the keep-alive connection stays usable, no traceback in the log, and service resumes after SIGCONT.

A throwaway cluster (initdb/pg_ctl in a temp dir, its own port) is frozen, never the shared one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from service_support import BIN, free_port, make_problem, problem_doc, service_env, start_server, wait_for

PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


def _as_postgres() -> list[str]:
    """initdb refuses root: run the cluster as the postgres user when we are root."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@contextlib.contextmanager
def throwaway_cluster(tmp_path: Path):
    """A private PostgreSQL on a free port; yields (url, postmaster pid). Stopped (and resumed) in finally."""
    if not PG_BIN or not shutil.which("pg_ctl", path=PG_BIN[-1]):
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    bin_dir = Path(PG_BIN[-1])
    home = Path(tempfile.mkdtemp(prefix="pp-pg-"))  # pytest's tmp dirs are private to root
    data, sock = home / "pgdata", home / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        for path in (home, sock):
            shutil.chown(path, "postgres")
    port = free_port()
    run = _as_postgres()
    subprocess.run([*run, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True)
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*run, str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(home / "pg.log"),
                    "-w", "start"], check=True, capture_output=True)
    pid = int((data / "postmaster.pid").read_text().split()[0])
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", pid
    finally:
        _signal_all(pid, signal.SIGCONT)
        subprocess.run([*run, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def _cluster_pids(postmaster: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(postmaster)], capture_output=True, text=True).stdout
    return [postmaster, *(int(p) for p in out.split())]


def _signal_all(postmaster: int, sig: int) -> None:
    for pid in _cluster_pids(postmaster):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def test_frozen_postgres_gives_fast_503_and_recovers(tmp_path):
    with throwaway_cluster(tmp_path) as (url, postmaster):
        subprocess.run([str(BIN / "pipeplan"), "migrate"], env=service_env(database_url=url), check=True,
                       capture_output=True)
        proc, base = start_server(tmp_path, database_url=url, default_time_budget_s=1, embedded_workers=0)
        try:
            with httpx.Client(base_url=base, timeout=30) as client:
                created = client.post("/v1/plans", json={"problem": problem_doc(make_problem(tag="freeze"))})
                assert created.status_code in (200, 201), created.text
                key = created.json()["problem_key"]
                assert client.get(f"/v1/plans/{key}").status_code == 200
                assert client.get("/readyz").status_code == 200

                _signal_all(postmaster, signal.SIGSTOP)
                try:
                    for path in (f"/v1/plans/{key}/revisions", "/readyz", f"/v1/plans/{key}/job",
                                 "/v1/plans?limit=5", f"/v1/plans/{key}/revisions"):
                        t0 = time.monotonic()
                        r = client.get(path)
                        took = time.monotonic() - t0
                        assert r.status_code == 503, (path, r.status_code, r.text)
                        assert took < 2.0, (path, took)
                        assert "Retry-After" in r.headers, path
                        assert r.json()["error"] == "unavailable", r.text
                    assert client.get("/healthz").status_code == 200  # same keep-alive connection, still usable
                finally:
                    _signal_all(postmaster, signal.SIGCONT)

                wait_for(lambda: client.get(f"/v1/plans/{key}/revisions").status_code == 200, 10,
                         what="recovery after SIGCONT")
                assert client.get("/readyz").status_code == 200
        finally:
            proc.stop()
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log
