"""Workers outlive Redis: a private redis-server (never the shared one) is killed while a worker is
busy and restarted seconds later; the worker stays up and the job still finishes. A killed worker
restarts under its old name at once; with Redis down, `pipeplan worker` says so in one line."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from service_support import (
    Proc,
    free_port,
    hard_problem,
    problem_doc,
    service_env,
    start_server,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.integration


class Redis:
    def __init__(self, port: int):
        self.port, self.proc = port, None

    def start(self) -> Redis:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        wait_for(lambda: _pings(redis.Redis(port=self.port)), 10, what="redis-server")
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def _pings(r) -> bool:
    try:
        return bool(r.ping())
    except Exception:
        return False


def test_busy_worker_survives_a_redis_outage_and_a_restart_keeps_its_name(tmp_path):
    rport = free_port()
    redis_srv = Redis(rport).start()
    cfg = dict(redis_url=f"redis://127.0.0.1:{rport}/0", database_url=f"sqlite:///{tmp_path}/db.sqlite",
               auto_migrate="true", solver_workers=1, stale_after_s=4, reconcile_interval_s=1,
               maintenance_interval_s=1)
    server, base = start_server(tmp_path, **cfg)
    worker = start_worker(tmp_path, "w1", **cfg)
    try:
        r = httpx.post(f"{base}/v1/plans", json={"problem": problem_doc(hard_problem()), "time_budget_s": 8}, timeout=30)
        key = r.json()["problem_key"]
        wait_for(lambda: httpx.get(f"{base}/v1/plans/{key}/job").json()["state"] == "solving", 30, what="solving")
        redis_srv.kill()
        time.sleep(6)
        assert worker.popen.poll() is None, worker.output()
        redis_srv.start()
        wait_for(lambda: httpx.get(f"{base}/v1/plans/{key}/job").json()["state"] == "done", 60, what="job done")
        assert worker.popen.poll() is None, worker.output()
        assert "unreachable" in worker.output() or "lost Redis" in worker.output()
        worker.kill()
        worker.popen.wait(5)
        again = start_worker(tmp_path, "w1", **cfg)
        time.sleep(4)
        assert again.popen.poll() is None and "There exists an active worker" not in again.output(), again.output()
        again.stop()
    finally:
        worker.stop()
        server.stop()
        redis_srv.kill()


def test_worker_without_redis_says_so_in_one_line(tmp_path):
    env = service_env(redis_url=f"redis://127.0.0.1:{free_port()}/0", database_url=f"sqlite:///{tmp_path}/db.sqlite")
    proc = Proc(["worker"], env, tmp_path / "worker.log")
    proc.popen.wait(30)
    out = proc.output().strip()
    assert proc.popen.returncode != 0 and "Traceback" not in out, out
    assert out.splitlines()[-1].startswith("error: cannot reach Redis at redis://127.0.0.1:"), out
