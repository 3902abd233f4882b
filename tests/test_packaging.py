"""Packaging: every folder of the project installs under the one name `pipeplan`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_under_the_pipeplan_namespace():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {installed: Path(folder) for installed, folder in tool["package-dir"].items()}
    on_disk = set()
    for installed, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((installed, *relative)))
    assert all(name == "pipeplan" or name.startswith("pipeplan.") for name in folders)
    assert sorted(tool["packages"]) == sorted(on_disk)


def test_the_install_puts_no_bare_folder_names_on_the_path(tmp_path):
    """Outside the repository, `client`, `service`, … are free for a training codebase's own modules;
    ours answer only as pipeplan.*."""
    probe = ("import importlib.util as u; "
             "print([n for n in ('client', 'service', 'worker', 'planner', 'migrations') if u.find_spec(n)]); "
             "import pipeplan.client, pipeplan.service, pipeplan.worker, pipeplan.planner, pipeplan.migrations")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
