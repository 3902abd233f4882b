"""Alembic migrations on real SQLite and real PostgreSQL: upgrade -> downgrade -> upgrade, the models
agree with the migrated schema, `pipeplan migrate` works from any directory, and production refuses to
start on an unmigrated database with a message naming the command."""

from __future__ import annotations

import subprocess

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from service_support import BIN, any_db_url, pg_url, service_env  # noqa: F401
from sqlalchemy import inspect

from pipeplan.settings import Settings
from service import create_app, schema
from service.db import make_engine
from service.models import Base

TABLES = {"problems", "plan_revisions", "jobs"}


def tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade(any_db_url):  # noqa: F811
    engine = make_engine(any_db_url, 2)
    try:
        assert schema.current_revision(engine) is None
        schema.upgrade(engine)
        assert tables(engine) == TABLES
        assert schema.current_revision(engine) == schema.head_revision()
        schema.downgrade(engine, "base")
        assert tables(engine) == set()
        assert schema.current_revision(engine) is None
        schema.upgrade(engine)
        assert tables(engine) == TABLES
        with engine.connect() as conn:  # the ORM models and the migrations describe the same schema
            diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diffs == [], diffs
    finally:
        engine.dispose()


def test_pipeplan_migrate_from_another_directory(tmp_path, any_db_url):  # noqa: F811
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([str(BIN / "pipeplan"), "migrate"], cwd=elsewhere, capture_output=True, text=True,
                         env=service_env(database_url=any_db_url), timeout=60)
    assert run.returncode == 0, run.stderr
    assert "-> " + schema.head_revision() in run.stdout
    engine = make_engine(any_db_url, 1)
    assert tables(engine) == TABLES
    engine.dispose()


def test_production_refuses_unmigrated_schema(pg_url):  # noqa: F811
    app = create_app(Settings(database_url=pg_url))
    with pytest.raises(schema.SchemaNotReady, match="pipeplan migrate"):
        with TestClient(app):
            pass
    engine = make_engine(pg_url, 1)
    assert tables(engine) == set()  # and it did not create anything behind the operator's back
    engine.dispose()


def test_embedded_sqlite_is_created_and_migrated_on_first_start(tmp_path):
    app = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=0))
    with TestClient(app) as client:
        assert client.get("/readyz").json()["database"] == "ok"
    engine = make_engine(f"sqlite:///{tmp_path / 'data' / 'pipeplan.db'}", 1)
    assert tables(engine) == TABLES
    engine.dispose()


def test_serve_and_worker_refuse_to_start_on_an_unmigrated_database(pg_url):  # noqa: F811
    env = service_env(database_url=pg_url, redis_url="redis://127.0.0.1:6379/13", port=0)
    for args in (["serve", "--port", "0"], ["worker", "--burst"]):
        run = subprocess.run([str(BIN / "pipeplan"), *args], capture_output=True, text=True, env=env, timeout=60)
        assert run.returncode != 0, args
        out = run.stdout + run.stderr
        assert "Run `pipeplan migrate`" in out, out[-2000:]
        assert "Traceback" not in out, out[-2000:]
