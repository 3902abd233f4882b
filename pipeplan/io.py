"""File helpers shared by the CLI commands: read a problem or spec, write JSON, fail clearly.

Exit codes everywhere: 0 success, 1 invalid plan, 2 bad input or infeasible; the message on stderr
starts with what went wrong ("bad input", "infeasible", "invalid plan") and then says why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from pydantic import BaseModel, ValidationError

from pipeplan.planner.contract import PROBLEM_FORMAT, Limits, Plan, Problem, error_messages

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_BAD_INPUT = 2


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def bad_input(message: str) -> NoReturn:
    fail(f"bad input: {message}", EXIT_BAD_INPUT)


def infeasible(message: str) -> NoReturn:
    fail(f"infeasible: {message}", EXIT_BAD_INPUT)


def memory_text(mib: float, gib: bool) -> str:
    return f"{mib / 1024:.1f} GiB" if gib else f"{mib:.1f} MiB"


def transfers_text(plan: Plan) -> str:
    """What a plan's transfers cost (docs/transfers.md): offloaded GiB, the most pinned host memory
    on one device, recompute time."""
    host = max(plan.host_memory_mib or [0.0])
    return (f"offloads {_amount((plan.offloaded_mib or 0.0) / 1024)} GiB (host {_amount(host / 1024)} GiB),"
            f" recomputes {_amount(plan.recompute_ms or 0.0)} ms")


def _amount(x: float) -> str:
    """Three significant digits without an exponent: 1,150 / 137 / 35.9 / 0.25."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def in_gib(problem: Problem) -> bool:
    """Whether the user gave this problem's memory in GiB: a problem converted from a spec (its
    metadata names the cost model) was budgeted in GiB (memory_budget_gib, or the GPU's memory); a
    problem document is written in MiB."""
    return "costmodel" in problem.metadata


def infeasible_memory(needed_mib: list[float], limits_mib: list[float], gib: bool) -> NoReturn:
    """Every command's words for a budget below what any schedule needs (planner.bounds.
    MemoryInfeasibleError's figures): the short devices, consecutive ones with the same figures
    together, and the least memory per GPU, in the unit the budget was given in."""
    groups: list[list[tuple[int, str, str]]] = []
    for d, (need, limit) in enumerate(zip(needed_mib, limits_mib)):
        if need <= limit + 1e-9:
            continue
        row = (d, memory_text(need, gib), memory_text(limit, gib))
        if groups and groups[-1][-1][0] == d - 1 and groups[-1][-1][1:] == row[1:]:
            groups[-1].append(row)
        else:
            groups.append([row])
    parts = [f"device {g[0][0]} needs at least {g[0][1]} but its limit is {g[0][2]}" if len(g) == 1 else
             f"devices {g[0][0]}-{g[-1][0]} need at least {g[0][1]} but their limit is {g[0][2]}" for g in groups]
    infeasible("; ".join(parts) + f"; any schedule needs at least {memory_text(max(needed_mib), gib)} per GPU,"
               " whatever the order, offload or recompute")


def read_json(path: Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        bad_input(f"{path}: no such file")
    except IsADirectoryError:
        bad_input(f"{path}: is a directory, expected a JSON file")
    except UnicodeDecodeError:
        bad_input(f"{path}: not a text file")
    except json.JSONDecodeError as exc:
        bad_input(f"{path}: not valid JSON ({exc})")


def _settings_limits() -> Limits:
    from pipeplan.settings import get_settings

    return get_settings().limits


def problem_from_doc(doc: Any) -> Problem:
    """A problem v1 document, or a model spec turned into one by the cost model (detected)."""
    if isinstance(doc, dict) and (doc.get("format") == PROBLEM_FORMAT or "stages" in doc):
        return Problem.model_validate(doc)  # no cost model needed for a problem document
    from pipeplan.planner.documents import problem_from_document

    return problem_from_document(doc)


def load_problem(path: Path, limits: Limits | None = None) -> Problem:
    """Read PROBLEM.json or SPEC.json; every error names the file, the field and the reason."""
    doc = read_json(path)
    try:
        problem = problem_from_doc(doc)
        problem.check_limits(limits or _settings_limits())
        return problem
    except (ValidationError, ValueError, TypeError, KeyError) as exc:
        bad_input(f"{path}: " + "; ".join(error_messages(exc)))


def load_plan(path: Path) -> Plan:
    doc = read_json(path)
    try:
        return Plan.model_validate(doc)
    except ValidationError as exc:
        bad_input(f"{path}: not a plan v1: " + "; ".join(error_messages(exc)))


def dumps(doc: BaseModel | dict) -> str:
    if isinstance(doc, BaseModel):
        return doc.model_dump_json(indent=2)
    return json.dumps(doc, indent=2)


def write_json(doc: BaseModel | dict, out: Path | None) -> None:
    """Write to `out`, or to stdout when no path is given."""
    write_text(dumps(doc) + "\n", out)


def write_text(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
        return
    write_bytes(text.encode(), out)


def write_bytes(data: bytes, out: Path) -> None:
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(data)
    except OSError as exc:
        bad_input(f"{out}: cannot write ({exc.strerror or exc})")
