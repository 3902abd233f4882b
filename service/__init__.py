"""The plan service: HTTP API, SQL plan cache, queue producer and event fan-out."""

from __future__ import annotations


def __getattr__(name: str):  # lazy: workers import service.repository without loading FastAPI
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
