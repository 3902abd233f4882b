"""ASGI entry point for process managers: `uvicorn --factory service.asgi:app_from_env` (or gunicorn
with uvicorn workers). Settings come from PIPEPLAN_* in the environment of each process."""

from __future__ import annotations

from fastapi import FastAPI

from pipeplan.settings import Settings

from .app import create_app


def app_from_env() -> FastAPI:
    return create_app(Settings())
