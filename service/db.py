"""Engine creation for PostgreSQL and SQLite, with the pragmas concurrent SQLite writers need."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url


def make_engine(url: str, pool_size: int = 10) -> Engine:
    """An engine that survives restarts of the database (pre-ping) and concurrent SQLite writers."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_pre_ping=True,
            pool_size=pool_size, max_overflow=20,
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
    return create_engine(
        url, pool_pre_ping=True, pool_size=pool_size, max_overflow=20, pool_recycle=1800,
        connect_args={"connect_timeout": 5} if parsed.get_backend_name() == "postgresql" else {},
    )


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
