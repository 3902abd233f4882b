"""The `pipeplan` console script: one Typer app assembled from the command modules.

Exit codes everywhere: 0 success, 1 invalid plan, 2 bad input or infeasible (stderr says which).
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="pipeplan",
    help="Pipeline-parallel schedule planning: heuristics, solvers, a plan service and its client.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Each module registers its own commands; a module whose optional dependencies are missing still
# registers, and its commands explain which extra to install when run.
COMMAND_MODULES = ("spec", "planning", "solving", "adaptive", "server", "frontier", "fidelity", "profile",
                   "exporting", "configure")

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"pipeplan.commands.{_name}")
    except ModuleNotFoundError as exc:  # a command module not written yet must not break the others
        if exc.name != f"pipeplan.commands.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    app()
