"""File helpers shared by the CLI commands: read a problem or spec, write JSON, fail clearly."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from pydantic import BaseModel, ValidationError

from planner.contract import Limits, Plan, Problem, error_messages

EXIT_INVALID = 1
EXIT_BAD_INPUT = 2


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except json.JSONDecodeError as exc:
        fail(f"{path}: not valid JSON ({exc})")


def load_problem(path: Path, limits: Limits | None = None) -> Problem:
    """A problem v1 document, or a model spec turned into one by the cost model (detected)."""
    from planner.costmodel import problem_from_document

    doc = read_json(path)
    try:
        problem = problem_from_document(doc)
        if limits is not None:
            problem.check_limits(limits)
        return problem
    except (ValidationError, ValueError) as exc:
        fail(f"{path}: " + "; ".join(error_messages(exc)))


def load_plan(path: Path) -> Plan:
    try:
        return Plan.model_validate(read_json(path))
    except ValidationError as exc:
        fail(f"{path}: " + "; ".join(error_messages(exc)))


def write_json(doc: BaseModel | dict, out: Path | None) -> None:
    """Write to `out`, or to stdout when no path is given."""
    text = doc.model_dump_json(indent=2) if isinstance(doc, BaseModel) else json.dumps(doc, indent=2)
    if out is None:
        sys.stdout.write(text + "\n")
    else:
        Path(out).write_text(text + "\n")
