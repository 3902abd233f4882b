"""docker-compose.yml and the Dockerfile, checked without Docker: they parse, and their services,
commands, ports and environment agree with the settings object and the CLI."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from service_support import BIN, ROOT
from sqlalchemy.engine import make_url

from pipeplan.settings import Settings

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def env_of(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[service]["environment"].items()}


def command_of(service: str) -> str:
    cmd = SERVICES[service].get("command")
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def test_services_and_health_checks():
    assert set(SERVICES) == {"postgres", "redis", "api", "worker"}
    for name, svc in SERVICES.items():
        assert "healthcheck" in svc and svc["healthcheck"]["test"], name
    assert SERVICES["api"]["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                             "redis": {"condition": "service_healthy"}}
    assert SERVICES["worker"]["depends_on"]["api"]["condition"] == "service_healthy"
    # `--scale worker=N` needs no fixed name and no published port
    assert "container_name" not in SERVICES["worker"] and "ports" not in SERVICES["worker"]


def test_environment_is_made_of_real_settings_that_point_at_the_compose_services(monkeypatch):
    for service in ("api", "worker"):
        env = env_of(service)
        for name in env:
            assert name.startswith("PIPEPLAN_")
            assert name.removeprefix("PIPEPLAN_").lower() in Settings.model_fields, name
        for k in list(Settings.model_fields):
            monkeypatch.delenv(f"PIPEPLAN_{k.upper()}", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v))  # compose default values
        settings = Settings()
        db = make_url(settings.resolved_database_url)
        pg = SERVICES["postgres"]["environment"]
        assert db.drivername == "postgresql+psycopg" and db.host == "postgres"
        assert (db.username, db.password, db.database) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
                                                           pg["POSTGRES_DB"])
        assert settings.redis_url.startswith("redis://redis:6379")
        assert not settings.should_auto_migrate  # production checks the schema instead
        assert settings.solver_workers == 2 and settings.api_keys == []
    assert env_of("api") == env_of("worker")


def test_commands_exist_and_ports_agree():
    api = command_of("api")
    assert api.index("pipeplan migrate") < api.index("pipeplan serve")
    port = re.search(r"--port (\d+)", api).group(1)
    assert "--host 0.0.0.0" in api
    assert SERVICES["api"]["ports"] == [f"{port}:{port}"]
    assert f"127.0.0.1:{port}/readyz" in " ".join(SERVICES["api"]["healthcheck"]["test"])
    assert command_of("worker") == "pipeplan worker"
    helps = {c: subprocess.run([str(BIN / "pipeplan"), c, "--help"], capture_output=True, text=True, timeout=60)
             for c in ("serve", "worker", "migrate")}
    assert all(h.returncode == 0 for h in helps.values())
    assert "--host" in helps["serve"].stdout and "--port" in helps["serve"].stdout


def test_dockerfile_copies_what_exists_and_installs_the_server_extra():
    text = (ROOT / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert 'pip install ".[server]"' in text
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "server" in pyproject["project"]["optional-dependencies"]
    copied = {line.split()[1] for line in text.splitlines() if line.startswith("COPY ")}
    assert set(pyproject["tool"]["setuptools"]["package-dir"].values()) <= copied
    assert re.search(r'CMD \["pipeplan", "serve"', text)
    assert Path(ROOT / "migrations" / "env.py").exists()
