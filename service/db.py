"""Engine creation for PostgreSQL and SQLite, with the pragmas concurrent SQLite writers need.

The API's PostgreSQL engine never waits on an unresponsive server: the server cancels statements
past `statement_timeout`, the client abandons a round trip the server does not answer within
`answer_s` (a frozen or partitioned server answers nothing, so a server-side timeout cannot help),
and after that new connections fail at once until a background probe gets through again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

log = logging.getLogger("pipeplan.db")


@dataclass(frozen=True)
class DbTimeouts:
    """Seconds: pool checkout wait, server statement timeout, client wait for one answer (the values
    come from the settings: db_pool_timeout_s, db_statement_timeout_s, db_answer_timeout_s)."""

    pool_s: float
    statement_s: float
    answer_s: float

    @classmethod
    def from_settings(cls, settings: Any) -> DbTimeouts:
        return cls(settings.db_pool_timeout_s, settings.db_statement_timeout_s, settings.db_answer_timeout_s)


class Breaker:
    """Open after the server failed to answer: connects fail fast until a probe connection succeeds."""

    def __init__(self, probe_every_s: float = 0.5):
        self.probe_every_s = probe_every_s
        self._open = threading.Event()
        self._lock = threading.Lock()
        self._connect: Any = None

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def trip(self, connect: Any) -> None:
        """Open (idempotent) and probe with `connect()` in a thread until it works."""
        with self._lock:
            if self._open.is_set():
                return
            self._open.set()
        log.warning("PostgreSQL did not answer; failing fast until it does")
        threading.Thread(target=self._probe, args=(connect,), name="pipeplan-db-probe", daemon=True).start()

    def _probe(self, connect: Any) -> None:
        while True:
            time.sleep(self.probe_every_s)
            try:
                connect().close()
            except Exception:
                continue
            self._open.clear()
            log.warning("PostgreSQL answers again")
            return


def _deadline_connection_class(answer_s: float, on_timeout: Any) -> type:
    """A psycopg Connection whose every wait on the server gives up after `answer_s` seconds."""
    import psycopg
    from psycopg import errors as pg_errors

    class DeadlineConnection(psycopg.Connection):
        def wait(self, gen, interval=0.1, timeout=None):  # type: ignore[override]
            try:
                return super().wait(gen, interval=interval, timeout=answer_s if timeout is None else timeout)
            except pg_errors._WaitTimeout:
                # mid-protocol: the connection is unusable; closing it makes SQLAlchemy drop the pool
                self.pgconn.finish()
                on_timeout()
                raise psycopg.OperationalError(f"the database did not answer within {answer_s:g} s") from None

    return DeadlineConnection


def _pg_url_with_statement_timeout(url: str, statement_s: float) -> Any:
    parsed = make_url(url)
    options = parsed.query.get("options", "")
    if isinstance(options, tuple):
        options = " ".join(options)
    options = f"{options} -c statement_timeout={int(statement_s * 1000)}".strip()
    return parsed.update_query_dict({"options": options})


def make_engine(url: str, pool_size: int = 10, timeouts: DbTimeouts | None = None) -> Engine:
    """An engine that survives restarts of the database (pre-ping) and concurrent SQLite writers.

    With `timeouts` (the API), no request waits long on the database: see the module docstring."""
    parsed = make_url(url)
    pool_timeout = timeouts.pool_s if timeouts else 30.0
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_pre_ping=True,
            pool_size=pool_size, max_overflow=20, pool_timeout=pool_timeout,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # WAL: readers never block the one writer
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    is_pg = parsed.get_backend_name() == "postgresql"
    target: Any = url
    if is_pg and timeouts:
        target = _pg_url_with_statement_timeout(url, timeouts.statement_s)
    engine = create_engine(
        target, pool_pre_ping=True, pool_size=pool_size, max_overflow=20, pool_recycle=1800,
        pool_timeout=pool_timeout, connect_args={"connect_timeout": 5 if not timeouts else 2} if is_pg else {},
    )
    if is_pg and timeouts and parsed.get_driver_name() in ("psycopg", ""):
        _fail_fast(engine, timeouts)
    return engine


def _fail_fast(engine: Engine, timeouts: DbTimeouts) -> None:
    breaker = Breaker()
    plain: dict[str, Any] = {}

    def trip() -> None:
        breaker.trip(lambda: engine.dialect.dbapi.connect(*plain["cargs"], **plain["cparams"]))

    conn_class = _deadline_connection_class(timeouts.answer_s, trip)

    @event.listens_for(engine, "do_connect")
    def _connect(dialect, _record, cargs, cparams):
        import psycopg

        plain.setdefault("cargs", cargs)
        plain.setdefault("cparams", dict(cparams))
        if breaker.is_open:
            raise psycopg.OperationalError("the database did not answer recently; not connecting until it does")
        try:
            return conn_class.connect(*cargs, **cparams)
        except psycopg.errors.ConnectionTimeout:
            trip()
            raise


class ForkSafeEngine:
    """One engine per process: a forked RQ work horse must not reuse its parent's sockets."""

    def __init__(self, url: str, pool_size: int = 10):
        self.url, self.pool_size = url, pool_size
        self._pid = os.getpid()
        self._engine = make_engine(url, pool_size)

    def get(self) -> Engine:
        if os.getpid() != self._pid:
            self._engine.dispose(close=False)
            self._engine = make_engine(self.url, self.pool_size)
            self._pid = os.getpid()
        return self._engine
