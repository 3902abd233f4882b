"""A bench/models.py table with only the cells the readers of its gap column look at."""

from __future__ import annotations

from bench.models import cells, header


def models_table(gaps: dict[str, str]) -> str:
    """Header (limits 10 and 60 s) and one row per id whose gap cell is the given text; every other
    cell is filler."""
    head = header([10.0, 60.0])
    names = cells(head[0])
    at = names.index("gap @60s")
    rows = []
    for row_id, gap in gaps.items():
        row = [row_id] + ["x"] * (len(names) - 1)
        row[at] = gap
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(head + rows)
