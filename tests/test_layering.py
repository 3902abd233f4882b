"""The layout's rule, checked on the source: imports point down, never in a circle.

`planner/` is pure domain code at the bottom: it imports none of the packages above it (service,
worker, client, the pipeplan CLI and settings). No module of the project imports, directly or through
others, a module that imports it back; function-local imports count too, since a circle hidden in a
function is still a circle in the design.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> the name it installs as (pyproject.toml's package-dir).
PACKAGES = {"planner": "pipeplan.planner", "service": "pipeplan.service", "worker": "pipeplan.worker",
            "client": "pipeplan.client", "migrations": "pipeplan.migrations", "pipeplan": "pipeplan"}
SOURCES = (*PACKAGES, "tests", "bench", "examples")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Installed dotted module name -> (file, is a package's __init__)."""
    out = {}
    for folder, installed in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [installed, *path.relative_to(ROOT / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _project_module(name: str, modules: dict) -> str | None:
    """The project module `name` lives in (a name inside a module counts as that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its file)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # `from ..x import y`: x below the package `level` dots name
                    anchor = package.rsplit(".", node.level - 1)[0]
                    base = f"{anchor}.{base}" if base else anchor
                # `from pkg import sub` imports the submodule, not the package's __init__
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                found = _project_module(target, modules)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules, the first repeated at the end), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return exc.args[1]
    return None


def test_planner_imports_nothing_above_it():
    upward = sorted((a, b) for a, targets in import_graph().items() if a.startswith("pipeplan.planner")
                    for b in targets if not b.startswith("pipeplan.planner"))
    assert upward == []


def test_no_import_circles():
    assert circle(import_graph()) is None


def test_the_graph_holds_every_kind_of_import():
    """Absolute, relative and function-local imports are all edges, so the two checks above see them;
    and a circle, once there, is found."""
    graph = import_graph()
    assert "pipeplan.service.repository" in graph["pipeplan.worker.tasks"]  # absolute, at the top
    assert "pipeplan.planner.solver.cpsat_model" in graph["pipeplan.planner.solver.cpsat"]  # relative
    assert "pipeplan.settings" in graph["pipeplan.commands.solving"]  # inside a function
    graph["pipeplan.planner.contract"] = graph["pipeplan.planner.contract"] | {"pipeplan.planner.solver.api"}
    assert circle(graph) is not None


def bare_imports(source: str, where: str) -> list[str]:
    """Imports in `source` of a repository folder by its folder name (`from client import …`): they
    resolve only from the repository root, and shadow or are shadowed by a user's own modules."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                 else [])
        found += [f"{where}:{node.lineno} {name}" for name in names
                  if name.split(".")[0] in PACKAGES and name.split(".")[0] != "pipeplan"]
    return found


def test_every_import_uses_the_installed_namespace():
    assert [hit for folder in SOURCES for path in sorted((ROOT / folder).rglob("*.py"))
            for hit in bare_imports(path.read_text(), str(path.relative_to(ROOT)))] == []


def test_a_bare_import_is_found():
    source = "import json\nfrom pipeplan.client import PlanClient\nfrom client import PlanClient\n"
    assert bare_imports(source, "x.py") == ["x.py:3 client"]
