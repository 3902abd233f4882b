"""`pipeplan serve`, `pipeplan worker`, `pipeplan migrate`: the service's processes.

Configuration comes from PIPEPLAN_* environment variables (pipeplan.settings.Settings); the options
here only override the listen address. Server dependencies come with the `server` extra.
"""

from __future__ import annotations

import logging

import typer

from pipeplan.io import fail


def _settings(**overrides):
    from pipeplan.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _needs_server_extra(exc: ModuleNotFoundError) -> None:
    fail(f"{exc.name} is not installed; install the server extra: pip install 'pipeplan[server]'")


def serve(
    host: str = typer.Option(None, help="Listen address (default PIPEPLAN_HOST or 127.0.0.1)."),
    port: int = typer.Option(None, help="Listen port (default PIPEPLAN_PORT or 8000)."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Run the plan service.

    With nothing configured: a SQLite file and in-process workers."""
    try:
        import uvicorn

        from pipeplan.service.app import create_app
        from pipeplan.service.read_timeouts import PROTOCOL
    except ModuleNotFoundError as exc:
        _needs_server_extra(exc)
    settings = _settings(host=host, port=port)
    from pipeplan.service.db import make_engine
    from pipeplan.service.schema import SchemaNotReady, ensure_schema

    engine = make_engine(settings.resolved_database_url, 1)
    try:  # fail before uvicorn starts, with the message alone (the app checks again in its lifespan)
        ensure_schema(engine, settings.should_auto_migrate)
    except SchemaNotReady as exc:
        fail(str(exc))
    except Exception as exc:
        fail(f"cannot reach the database: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    finally:
        engine.dispose()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = "redis queue" if settings.redis_url else f"embedded ({settings.embedded_workers} worker thread(s))"
    base = f"http://{settings.host}:{settings.port}"
    typer.echo(f"pipeplan: {settings.resolved_database_url.split('@')[-1]} · {mode} · {base}", err=True)
    typer.echo(f"pipeplan: dashboard {base}/dashboard/ · API docs {base}/docs (ReDoc {base}/redoc)", err=True)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        typer.echo(f"warning: listening on {settings.host} without API keys: anyone who can reach this port can"
                   " submit work; set PIPEPLAN_API_KEYS", err=True)
    if settings.http_workers > 1:
        if not settings.redis_url:
            fail("PIPEPLAN_HTTP_WORKERS > 1 needs PIPEPLAN_REDIS_URL: processes must share the queue and events")
        # Each process builds its own app from the same environment (Settings()), via service.asgi.
        uvicorn.run("pipeplan.service.asgi:app_from_env", factory=True, host=settings.host, port=settings.port,
                    workers=settings.http_workers, log_level=log_level, timeout_graceful_shutdown=3, http=PROTOCOL)
        return
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=3, lifespan="on", http=PROTOCOL)
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise typer.Exit(3)


def worker(
    burst: bool = typer.Option(False, help="Exit when the queue is empty (for tests and batch runs)."),
    name: str = typer.Option(None, help="Worker name (default: RQ's random name)."),
) -> None:
    """Run one refine worker on the Redis queue.

    Start any number, on any machine."""
    try:
        from pipeplan.worker.rq_worker import run_worker
    except ModuleNotFoundError as exc:
        _needs_server_extra(exc)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeplan.service.schema import SchemaNotReady

    try:
        run_worker(_settings(), burst=burst, name=name)
    except SchemaNotReady as exc:
        fail(str(exc))


def migrate(
    revision: str = typer.Argument("head", help="Target revision ('head', or 'base' to drop everything)."),
) -> None:
    """Apply the database migrations.

    To PIPEPLAN_DATABASE_URL, by default the embedded SQLite file."""
    try:
        from pipeplan.service import schema
        from pipeplan.service.db import make_engine
    except ModuleNotFoundError as exc:
        _needs_server_extra(exc)
    settings = _settings()
    engine = make_engine(settings.resolved_database_url, 1)
    before = schema.current_revision(engine)
    if revision == "base":
        schema.downgrade(engine, "base")
    else:
        schema.upgrade(engine, revision)
    after = schema.current_revision(engine)
    typer.echo(f"{engine.url.render_as_string(hide_password=True)}: {before or 'empty'} -> {after or 'empty'}")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("worker")(worker)
    app.command("migrate")(migrate)
