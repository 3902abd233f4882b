"""Packaging: every folder of the project installs under the one name `pipeplan`."""

from __future__ import annotations

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
