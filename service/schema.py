"""Schema management: apply Alembic migrations, and refuse to serve an unmigrated database.

`pipeplan migrate` and the app both locate the migrations as the installed package
`pipeplan.migrations`, so neither depends on the current directory or on alembic.ini being found.
"""

from __future__ import annotations

from importlib.resources import files

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

MIGRATIONS_DIR = str(files("pipeplan.migrations"))


class SchemaNotReady(RuntimeError):
    """The database schema is not at the migrations' head; the message says what to run."""


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_DIR)
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def ensure_schema(engine: Engine, auto_migrate: bool) -> None:
    """Migrate (embedded SQLite) or check (production) that the schema is at head."""
    if auto_migrate:
        upgrade(engine)
        return
    current, head = current_revision(engine), head_revision()
    if current != head:
        where = "no pipeplan schema yet" if current is None else f"schema revision {current}"
        raise SchemaNotReady(
            f"the database at {engine.url.render_as_string(hide_password=True)} has {where}, but this"
            f" version needs revision {head}. Run `pipeplan migrate` (same PIPEPLAN_DATABASE_URL) first."
        )
