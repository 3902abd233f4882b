"""The repository documents itself: no file points outside it, and every relative link in the README
and docs/ resolves to a file of the repository (a moved page must not leave a dead link behind)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared|CONTRACT\.md|DESIGN\.md")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_tracked_file_points_outside_the_repository() -> None:
    offenders = []
    for path in tracked():
        if path.suffix in {".png", ".svg", ".ico", ".woff2"} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not offenders, offenders


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    dead = [target for target in LINK.findall(page.read_text())
            if "://" not in target and not target.startswith("mailto:")
            and not (page.parent / target).exists()]
    assert not dead, f"{page.relative_to(ROOT)} links to missing files: {dead}"


def test_readme_stays_short() -> None:
    """The README is a user's first screens; tables and history live in docs/ (docs/benchmarks.md)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
