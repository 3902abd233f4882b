"""`pipeplan serve` (embedded mode: SQLite + in-process worker) as a test subprocess on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from service_support import free_port

ROOT = Path(__file__).resolve().parent.parent


class Service:
    """`pipeplan serve` as a subprocess, restartable on the same port and database: embedded mode
    (SQLite), or on the database a `database_url=` setting names (migrated first: production mode)."""

    def __init__(self, data_dir: Path, port: int | None = None, **settings: object):
        self.data_dir, self.port = data_dir, port or free_port()
        self.settings = {f"PIPEPLAN_{name.upper()}": str(value) for name, value in settings.items()}
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Service:
        # the caller's environment never picks the database, queue or keys; the settings given here may
        env = {name: value for name, value in os.environ.items()
               if name not in ("PIPEPLAN_DATABASE_URL", "PIPEPLAN_REDIS_URL", "PIPEPLAN_API_KEYS")}
        env.update({"PIPEPLAN_DATA_DIR": str(self.data_dir), "PIPEPLAN_SOLVER_WORKERS": "1",
                    "PIPEPLAN_DEFAULT_TIME_BUDGET_S": "2", "PIPEPLAN_EMBEDDED_WORKERS": "1", **self.settings})
        self.log = open(self.data_dir / f"serve-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from pipeplan.cli import main; main()", "serve", "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pipeplan serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"pipeplan serve did not answer within 60 s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
