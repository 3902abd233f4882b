"""Shared helpers for the service/worker/migration tests: real SQLite files, a throwaway PostgreSQL
schema per test, a Redis database with a unique queue name, and live uvicorn/worker processes.

Nothing here imitates our own components; plans come from the planner's simulator.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from pipeplan.planner.contract import Device, Options, Plan, Problem, Stage
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import DeviceOrder, Schedule, Timing, build_plan, simulate
from pipeplan.planner.validator import assert_valid
from sqlalchemy import create_engine, text

PG_BASE = os.environ.get("PIPEPLAN_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_BASE = os.environ.get("PIPEPLAN_TEST_REDIS", "redis://127.0.0.1:6379")
# one database per pytest-xdist worker (gw0: 13, gw1: 12, ...): a test that flushes its database (as a
# Redis restart without persistence would) must not take the queues of a test running beside it
_XDIST_INDEX = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
REDIS_TEST_DB = int(os.environ.get("PIPEPLAN_TEST_REDIS_DB", "13")) - _XDIST_INDEX
if REDIS_TEST_DB < 1:
    raise RuntimeError(f"too many pytest-xdist workers for one Redis database each (worker {_XDIST_INDEX})")
REDIS_URL = f"{REDIS_BASE}/{REDIS_TEST_DB}"
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent


def make_problem(devices: int = 2, microbatches: int = 4, tag: str | None = None,
                 limit_mib: float | None = None, offload: bool = False) -> Problem:
    """A small problem; `tag` (metadata) makes its key unique to one test."""
    stages = [Stage(device=d, forward_ms=1.0 + 0.1 * d, backward_input_ms=1.2, backward_weight_ms=0.8,
                    offload_ms=0.6 if offload else None, activation_mib=512.0, weight_grad_mib=128.0)
              for d in range(devices)]
    return Problem(num_devices=devices, num_microbatches=microbatches, p2p_ms=0.05,
                   options=Options(split_backward=True, offload=offload), stages=stages,
                   devices=[Device(memory_limit_mib=limit_mib, static_mib=1000.0) for _ in range(devices)],
                   metadata={"test": tag or uuid.uuid4().hex, "model": "tiny-test"})


def problem_doc(problem: Problem) -> dict:
    return problem.model_dump(mode="json")


def gpipe_plan(problem: Problem, delay_ms: float = 0.0, method: str = "gpipe (test)") -> Plan:
    """All F then all B/W per device; `delay_ms` postpones every op from the first backward on,
    giving valid plans of any worse makespan (memory unlimited problems only)."""
    m = problem.num_microbatches
    devices = []
    for d in range(problem.num_devices):
        order = DeviceOrder()
        for k in problem.stages_of(d):
            order.compute += [Op(Kind.F, k, i) for i in range(m)]
        for k in reversed(problem.stages_of(d)):
            for i in range(m):
                order.compute += [Op(Kind.B, k, i), Op(Kind.W, k, i)]
        devices.append(order)
    schedule = Schedule(devices)
    timing = simulate(problem, schedule)
    if delay_ms:
        t0 = min(s for op, (s, _) in timing.times.items() if op.kind != Kind.F)
        timing = Timing({op: ((s + delay_ms, e + delay_ms) if s >= t0 else (s, e))
                         for op, (s, e) in timing.times.items()}, timing.choices)
    plan = build_plan(problem, schedule, timing, method=method)
    assert_valid(problem, plan)
    return plan


# -- databases ------------------------------------------------------------------------------------
def pg_available() -> bool:
    try:
        with create_engine(PG_BASE).connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False


@contextlib.contextmanager
def pg_schema():
    """A fresh PostgreSQL schema (URL with search_path set), dropped afterwards."""
    name = f"pp_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    sep = "&" if "?" in PG_BASE else "?"
    try:
        yield f"{PG_BASE}{sep}options=-csearch_path%3D{name}", name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        admin.dispose()


@pytest.fixture
def pg_url():
    if not pg_available():
        pytest.fail(f"PostgreSQL is not reachable at {PG_BASE} (the service tests need it)")
    with pg_schema() as (url, _):
        yield url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'pipeplan.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'pipeplan.db'}"
    else:
        with pg_schema() as (url, _):
            yield url


@pytest.fixture
def queue_name():
    """A unique RQ queue (and pub/sub channel) name; its Redis keys are deleted afterwards."""
    name = f"pp-test-{uuid.uuid4().hex[:8]}"
    yield name
    drop_queue(name)


def drop_queue(name: str) -> None:
    """Delete an RQ queue, its jobs and every Redis key that names it."""
    import redis
    from rq import Queue

    client = redis.Redis.from_url(REDIS_URL)
    Queue(name, connection=client).delete(delete_jobs=True)
    for k in client.scan_iter(f"rq:*{name}*"):
        client.delete(k)
    client.close()


def migrated_engine(url: str):
    from pipeplan.service import schema
    from pipeplan.service.db import make_engine

    engine = make_engine(url, 5)
    schema.upgrade(engine)
    return engine


# -- processes ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env(**settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPLAN_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for k, v in settings.items():
        env[f"PIPEPLAN_{k.upper()}"] = str(v)
    return env


class Proc:
    """A pipeplan subprocess in its own process group (so SIGKILL takes its forked children too)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log_path = log
        self._log = open(log, "wb")
        self.popen = subprocess.Popen([str(BIN / "pipeplan"), *args], env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(8)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.popen.wait(5)
        self.kill(signal.SIGKILL)  # stray forked horses
        self._log.close()

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]


def start_server(tmp_path: Path, **settings: object) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(["serve", "--port", str(port)], service_env(**settings), tmp_path / f"serve-{port}.log")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.output()}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.stop()
    raise AssertionError(f"server did not come up:\n{proc.output()}")


def start_worker(tmp_path: Path, name: str, **settings: object) -> Proc:
    return Proc(["worker", "--name", name], service_env(**settings), tmp_path / f"worker-{name}.log")


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class LiveServer:
    """uvicorn in a thread of the test process, for SSE and long-poll tests (TestClient buffers)."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 20, what="uvicorn start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def hard_problem(tag: str | None = None, microbatches: int = 12) -> Problem:
    """4 devices under tight memory (offload + recompute): the solver keeps improving for seconds
    instead of proving the heuristic optimal at once, so jobs are still solving when tests act."""
    from pipeplan.planner.bounds import min_memory

    stages = [Stage(device=k, forward_ms=1.0 + 0.3 * (k % 3), backward_input_ms=1.1 + 0.2 * k,
                    backward_weight_ms=0.9, recompute_ms=1.0, offload_ms=1.5, activation_mib=500.0,
                    weight_grad_mib=100.0, checkpoint_mib=20.0) for k in range(4)]
    loose = Problem(num_devices=4, num_microbatches=microbatches, p2p_ms=0.05,
                    options=Options(split_backward=True, offload=True, recompute=True), stages=stages,
                    devices=[Device(memory_limit_mib=None, static_mib=1000.0) for _ in range(4)],
                    metadata={"test": tag or uuid.uuid4().hex, "model": "hard-test"})
    return loose.model_copy(update={"devices": [Device(memory_limit_mib=m + 600.0, static_mib=1000.0)
                                                for m in min_memory(loose)]})
