"""Alembic migrations on real SQLite and real PostgreSQL: upgrade -> downgrade -> upgrade, the models
agree with the migrated schema, `pipeplan migrate` works from any directory, and production refuses to
start on an unmigrated database with a message naming the command."""

from __future__ import annotations

import subprocess

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from pipeplan.service import create_app, schema
from pipeplan.service.db import make_engine
from pipeplan.service.models import Base
from service_support import BIN, any_db_url, pg_url, service_env  # noqa: F401
from sqlalchemy import inspect, text

from pipeplan.settings import Settings

TABLES = {"problems", "plan_revisions", "jobs", "frontiers", "frontier_points", "plan_traces",
          "configurations", "configuration_candidates"}


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
    with pytest.raises(schema.SchemaNotReady, match="pipeplan migrate"), TestClient(app):
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


def test_0002_turns_converged_into_done_with_an_honest_outcome_and_back(any_db_url):  # noqa: F811
    """Old "converged" rows become "done"; only a proven-optimal best plan gets outcome "optimal" (the
    others ran before outcomes were kept: NULL, not a guess). Downgrade restores "converged"."""
    engine = make_engine(any_db_url, 2)
    now = "2026-01-01 00:00:00+00:00"
    problem = ("INSERT INTO problems (key, problem, num_devices, num_microbatches, num_stages, best_revision,"
               " best_makespan_ms, lower_bound_ms, bubble_ratio, best_status, best_method, first_makespan_ms,"
               " created_at, updated_at) VALUES (:k, '{}', 2, 4, 2, 1, 10.0, 8.0, 0.1, :s, 'm', 10.0, :t, :t)")
    job = ("INSERT INTO jobs (key, run_id, state, budget_s, used_s, attempts, runs, cancel_requested,"
           " improvements, queued_at) VALUES (:k, 'r', :state, 5.0, 5.0, 1, 1, false, 0, :t)")
    rows = {"a" * 64: ("optimal", "converged"), "b" * 64: ("feasible", "converged"), "c" * 64: ("feasible", "failed")}
    try:
        schema.upgrade(engine, "0001")
        with engine.begin() as conn:
            for key, (status, state) in rows.items():
                conn.execute(text(problem), {"k": key, "s": status, "t": now})
                conn.execute(text(job), {"k": key, "state": state, "t": now})
        schema.upgrade(engine)
        with engine.connect() as conn:
            got = {r[0]: tuple(r[1:]) for r in conn.execute(text("SELECT key, state, outcome, gap_pct FROM jobs"))}
        assert got == {"a" * 64: ("done", "optimal", 0.0), "b" * 64: ("done", None, None),
                       "c" * 64: ("failed", None, None)}
        schema.downgrade(engine, "0001")
        with engine.connect() as conn:
            states = {r[0]: r[1] for r in conn.execute(text("SELECT key, state FROM jobs"))}
        assert states == {"a" * 64: "converged", "b" * 64: "converged", "c" * 64: "failed"}
        assert "outcome" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    finally:
        schema.downgrade(engine, "base")
        engine.dispose()


def test_0006_signs_the_stored_problems_and_keeps_every_row_both_ways(any_db_url):  # noqa: F811
    """The neighbour index (migrations/versions/0006_problem_signature.py) is filled for the rows
    already stored: each readable problem gets planner.reuse.signature, an unreadable one NULL.
    Neither direction loses a job or a revision (SQLite's batch copy of `problems` would cascade)."""
    from pipeplan.planner.reuse import signature
    from service_support import make_problem

    engine = make_engine(any_db_url, 2)
    now = "2026-01-01 00:00:00+00:00"
    problem = ("INSERT INTO problems (key, problem, num_devices, num_microbatches, num_stages, best_revision,"
               " best_makespan_ms, lower_bound_ms, bubble_ratio, best_status, best_method, first_makespan_ms,"
               " created_at, updated_at) VALUES (:k, :doc, 2, 4, 2, 1, 10.0, 8.0, 0.1, 'feasible', 'm', 10.0,"
               " :t, :t)")
    revision = ("INSERT INTO plan_revisions (problem_key, revision, makespan_ms, lower_bound_ms, status, method,"
                " plan, created_at) VALUES (:k, 1, 10.0, 8.0, 'feasible', 'm', '{}', :t)")
    job = ("INSERT INTO jobs (key, run_id, state, budget_s, used_s, attempts, runs, cancel_requested,"
           " improvements, queued_at) VALUES (:k, 'r', 'done', 5.0, 5.0, 1, 1, false, 0, :t)")
    problems = [make_problem(devices=d, tag="0006", limit_mib=limit) for d, limit in ((2, 4000.0), (2, 5000.0), (3, None))]
    docs = {p.key(): p.model_dump_json() for p in problems} | {"f" * 64: '{"num_devices": "two"}'}
    count = "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM plan_revisions)"
    try:
        schema.upgrade(engine, "0005")
        with engine.begin() as conn:
            for key, doc in docs.items():
                for sql in (problem, revision, job):
                    conn.execute(text(sql), {"k": key, "doc": doc, "t": now})
        schema.upgrade(engine)
        with engine.connect() as conn:
            signed = dict(conn.execute(text("SELECT key, signature FROM problems")).all())
            assert tuple(conn.execute(text(count)).one()) == (4, 4)
        assert signed == {p.key(): signature(p) for p in problems} | {"f" * 64: None}
        assert signed[problems[0].key()] == signed[problems[1].key()] != signed[problems[2].key()]
        schema.downgrade(engine, "0005")
        assert "signature" not in {c["name"] for c in inspect(engine).get_columns("problems")}
        with engine.connect() as conn:
            assert tuple(conn.execute(text(count)).one()) == (4, 4)
    finally:
        schema.downgrade(engine, "base")
        engine.dispose()


def test_0008_fills_the_best_iteration_from_the_best_revision_and_keeps_every_row_both_ways(any_db_url):  # noqa: F811
    """problems.best_iteration_ms (migrations/versions/0008_best_iteration.py) is read from each row's
    best revision's plan: its iteration_ms where it has one, NULL for a plan without one or a document
    that does not parse; revisions other than the best are not read."""
    engine = make_engine(any_db_url, 2)
    now = "2026-01-01 00:00:00+00:00"
    problem = ("INSERT INTO problems (key, problem, num_devices, num_microbatches, num_stages, best_revision,"
               " best_makespan_ms, lower_bound_ms, bubble_ratio, best_status, best_method, first_makespan_ms,"
               " created_at, updated_at) VALUES (:k, '{}', 2, 4, 2, 2, 10.0, 8.0, 0.1, 'feasible', 'm', 10.0,"
               " :t, :t)")
    revision = ("INSERT INTO plan_revisions (problem_key, revision, makespan_ms, lower_bound_ms, status, method,"
                " plan, created_at) VALUES (:k, :r, 10.0, 8.0, 'feasible', 'm', :plan, :t)")
    best = {"a" * 64: '{"iteration_ms": 12.5}', "b" * 64: '{"makespan_ms": 10.0}', "c" * 64: "not json"}
    count = "SELECT (SELECT count(*) FROM problems), (SELECT count(*) FROM plan_revisions)"
    try:
        schema.upgrade(engine, "0007")
        with engine.begin() as conn:
            for key, plan in best.items():
                conn.execute(text(problem), {"k": key, "t": now})
                conn.execute(text(revision), {"k": key, "r": 1, "plan": '{"iteration_ms": 99.0}', "t": now})
                conn.execute(text(revision), {"k": key, "r": 2, "plan": plan, "t": now})
        schema.upgrade(engine)
        with engine.connect() as conn:
            filled = dict(conn.execute(text("SELECT key, best_iteration_ms FROM problems")).all())
            assert tuple(conn.execute(text(count)).one()) == (3, 6)
        assert filled == {"a" * 64: 12.5, "b" * 64: None, "c" * 64: None}
        schema.downgrade(engine, "0007")
        assert "best_iteration_ms" not in {c["name"] for c in inspect(engine).get_columns("problems")}
        with engine.connect() as conn:
            assert tuple(conn.execute(text(count)).one()) == (3, 6)
    finally:
        schema.downgrade(engine, "base")
        engine.dispose()
