"""A bench/models.py table with only the cells the readers of its gap column look at."""

from __future__ import annotations

from bench.models import header


def models_table(gaps: dict[str, str]) -> str:
    """Header (limits 10 and 60 s) and one row per id whose gap cell is the given text; every other
    cell is filler."""
    head = header([10.0, 60.0])
    cols = len([c for c in head[0].split("|") if c.strip()])
    rows = []
    for row_id, gap in gaps.items():
        cells = [row_id] + ["x"] * (cols - 1)
        cells[cols - 3] = gap
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(head + rows)
