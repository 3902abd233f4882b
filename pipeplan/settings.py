"""The one settings object (environment prefix PIPEPLAN_) every pipeplan process reads."""

from __future__ import annotations

import os
from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from planner.contract import Limits


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPEPLAN_", env_nested_delimiter="__")

    # Solver
    solver_workers: int = Field(
        default_factory=lambda: max(1, min(8, os.cpu_count() or 1)),
        description="CP-SAT search workers per solve; more than the cores only slows it down.",
    )
    default_time_budget_s: float = 60.0
    max_time_budget_s: float = 3600.0

    # Problem size limits
    limits: Limits = Field(default_factory=Limits)


@lru_cache
def get_settings() -> Settings:
    return Settings()
