"""The one settings object (environment prefix PIPEPLAN_) every pipeplan process reads.

The same object configures the CLI, the API (`create_app(settings)`), the workers and the embedded
mode, so a deployment is described by environment variables alone (see docker-compose.yml).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pipeplan.planner.contract import Limits


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pipeplan"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPEPLAN_", env_nested_delimiter="__")

    # Solver
    solver_workers: int | None = Field(
        None, ge=1,
        description="CP-SAT search workers per solve; unset, the planner's default (one per core, at"
                    " most 8: planner.solver.api.default_workers). More than the cores only slows it down.",
    )
    default_time_budget_s: float = Field(60.0, description="Refine budget when a POST gives none.")
    max_time_budget_s: float = Field(3600.0, description="Largest refine budget a client may ask for.")

    # Problem size limits
    limits: Limits = Field(default_factory=Limits)

    # Storage
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Where the embedded SQLite file lives when no database_url is given.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL (postgresql+psycopg://... in production). Empty: SQLite file in"
        " data_dir, created and migrated on first start.",
    )
    auto_migrate: bool | None = Field(
        None,
        description="Apply migrations when the app starts. Default: yes for SQLite, no for other"
        " databases (production refuses to start on an unmigrated schema instead).",
    )
    db_pool_size: int = 10
    db_pool_timeout_s: float = Field(1.0, gt=0, description="Wait at most this long for a free pooled connection"
                                     " (then 503).")
    db_statement_timeout_s: float = Field(5.0, gt=0, description="PostgreSQL statement_timeout of the API's"
                                          " connections (the server cancels longer statements).")
    db_answer_timeout_s: float = Field(
        1.0, gt=0, description="A PostgreSQL round trip the server does not answer within this is abandoned:"
        " the connection is dropped, new connections fail fast until a probe gets through, requests get 503.")

    # Queue / workers
    redis_url: str | None = Field(
        None, description="redis://host:6379/0. Empty: in-process worker pool and in-process events."
    )
    queue_name: str = Field("pipeplan", description="RQ queue name; also prefixes the pub/sub channel.")
    embedded_workers: int = Field(1, ge=0, description="Refine threads of the in-process pool.")
    worker_ttl_s: int = Field(20, ge=16, description="RQ worker TTL (RQ listens for ttl-15 s at a time).")
    maintenance_interval_s: int = Field(5, ge=1, description="RQ registry cleanup + reconcile period.")
    job_monitoring_interval_s: int = Field(5, ge=1)
    job_timeout_margin_s: float = Field(60.0, description="RQ job_timeout = budget + this margin.")
    heartbeat_s: float = Field(1.0, gt=0, description="How often a running job heartbeats and checks cancel.")
    stale_after_s: float = Field(
        15.0, gt=0, description="A solving job whose heartbeat is older than this is re-run elsewhere."
    )
    max_attempts: int = Field(3, ge=1, description="Runs of one job whose worker died; then the job fails.")
    reconcile_interval_s: float = Field(5.0, gt=0, description="API-side reconciler period.")
    min_rerun_budget_s: float = Field(5.0, description="Budget floor for a job re-run after a crash.")

    # HTTP
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated keys; when set, writes need `Authorization: Bearer <key>` or"
        " `X-API-Key: <key>`.",
    )
    read_requires_key: bool = Field(False, description="Key-gate reads too (when api_keys is set).")
    max_body_bytes: int = Field(2_000_000, description="Larger request bodies get 413.")
    long_poll_max_s: float = Field(60.0, description="Cap on ?wait= for GET /v1/plans/{key}.")
    sse_keepalive_s: float = Field(
        15.0, description="Keep-alive period of the dashboard's SSE streams (the API's: FastAPI's 15 s).")
    sse_poll_s: float = Field(5.0, description="SSE re-checks the database this often (missed events).")
    plan_cache_ttl_s: float = Field(1.0, description="In-process cache of the best plan per key.")
    plan_cache_mib: float = Field(256.0, gt=0, description="At most this many MiB of plan JSON in that cache.")
    retry_after_s: int = Field(5, description="Retry-After on 503.")
    host: str = "127.0.0.1"
    port: int = 8000
    http_workers: int = Field(
        1, ge=1, description="uvicorn processes for `pipeplan serve`; more than 1 needs redis_url (shared"
        " queue and events).",
    )

    # Admission: what one API process takes on at once (bounded work: docs/service.md, "Admission")
    inline_timeout_s: float = Field(
        30.0, gt=0, description="Time box of a POST's heavy work (spec conversion, first plan) in its own"
        " process; it is killed beyond this (503) or when the client leaves.")
    inline_greedy_s: float = Field(
        0.25, ge=0, description="Inline budget of the memory-aware greedy seed when no classic schedule fits;"
        " slower heuristics run in the refine job (0.5 s bought at most 0.3% at P=16-64, tight memory).")
    inline_greedy_max_s: float = Field(
        3.0, ge=0, description="Past inline_greedy_s, how long the first plan waits for the greedy's first"
        " fitting variant before it settles for the serialized schedule (one engine run: ~0.4 s at P=32, M=128).")
    inline_reuse_s: float = Field(
        1.5, ge=0, description="At a cache miss, at most this long reusing the nearest stored neighbours' plans"
        " (lookup included; docs/reuse.md), after the usual first plan, in what is left of its inline_greedy_max_s"
        " box. 0: no reuse.")
    inline_thread_max_ops: int = Field(
        4096, ge=0, description="Problems of at most this many ops get their first plan in the thread pool"
        " (milliseconds, bounded by size); larger ones and every spec in a killable process.")
    max_expensive_requests: int = Field(
        2, ge=1, description="Heavy POSTs (a first plan computed) running at once per process.")
    admission_wait_s: float = Field(
        10.0, ge=0, description="How long a heavy POST waits for a free slot before 503 with Retry-After.")
    frontier_max_ops: int = Field(
        196_608, ge=0, description="Largest frontier request: (points + 8) x the problem's ops, its first plans'"
        " work (the setup costs about 8 points). The default admits P=32 M=128 with 4 points, P=16 M=64 with"
        " 40, P=8 M=32 with 64: about 30 s each on 2 loaded cores (bench/frontier.py --first-plans).")
    frontier_timeout_s: float = Field(
        120.0, gt=0, description="Time box of a frontier request's first plans, computed in their own process;"
        " it is killed beyond this (503) or when the client leaves.")
    configure_timeout_s: float = Field(
        300.0, gt=0, description="Time box of a configuration search (POST /v1/configurations), run in its own"
        " process: a 64-GPU Llama-3-70B search takes 30-45 s on 2 loaded cores (bench/configure.py --llama70b).")
    configure_refine_top: int = Field(
        5, ge=0, le=100, description="A configuration search queues one refine job for each of its best this"
        " many candidates (at most the request's top); the other candidates keep their first plans.")
    max_frontier_requests: int = Field(
        1, ge=1, description="Frontier requests computing at once per process (each also takes a heavy slot);"
        " more get 503 with Retry-After at once.")
    max_streams: int = Field(
        1000, ge=1, description="Open SSE streams plus long-polls per process; more get 503 with Retry-After.")
    write_rate_per_min: float = Field(
        0.0, ge=0, description="Writes per minute per verified API key (or client address without keys); 0: no"
        " limit. Beyond it: 429 with Retry-After.")
    max_queued_solve_s: float = Field(
        7200.0, ge=0, description="Solve-seconds (budgets left) one verified API key, or client address without"
        " keys, may have queued or running; a POST or refine beyond it gets 429 with Retry-After. 0: no cap."
        " Two hours: two runs at the largest budget, while 20 one-hour POSTs could fill the workers' day.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection must send a request's complete headers within this (from connecting,"
        " or from the request's first byte); else 408 and the connection is closed (slow-header clients).")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body must arrive within this after its headers (2 MB at ~70 kB/s);"
        " else 408 and the connection is closed (slow-body clients).")
    gzip_min_bytes: int = Field(
        1024, ge=0, description="Responses at least this large are gzipped for clients that accept it (below,"
        " the header overhead and the CPU are not worth it).")
    export_cache_dir: Path | None = Field(
        None, description="Where computed exports (torch CSV, Chrome trace) are kept, gzipped, one file per"
        " revision. Empty: data_dir/exports.")
    baselines_timeout_s: float = Field(
        300.0, gt=0, description="Time box of the dashboard's baselines table of one problem (every peer"
        " schedule on it), computed once in a child process; past it the page says so.")
    dashboard_render_cache_mib: float = Field(
        64.0, ge=0, description="Rendered dashboard charts kept per process, in MiB of SVG (a P=64 M=512"
        " plan's charts are ~11 MB; counting entries instead let 64 big plans hold over a GB).")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    # -- derived ------------------------------------------------------------------------------------
    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(Path(self.data_dir) / 'pipeplan.db').resolve()}"

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")

    @property
    def should_auto_migrate(self) -> bool:
        return self.is_sqlite if self.auto_migrate is None else self.auto_migrate

    @property
    def resolved_export_cache_dir(self) -> Path:
        return Path(self.export_cache_dir or Path(self.data_dir) / "exports")

    @property
    def events_channel(self) -> str:
        return f"{self.queue_name}:improved"


@lru_cache
def get_settings() -> Settings:
    return Settings()
