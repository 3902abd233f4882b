"""What the benchmarks share: a measurement in a forked child, and the best makespan of an incumbent
history at a time."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def run_forked(fn: Callable[..., dict[str, Any]], *args: Any, timeout_s: float) -> dict[str, Any]:
    """fn(*args) in a forked child, so measurements never share solver state or memory (and each has
    its own peak RSS); {"error": ...} when it raises or does not answer within `timeout_s`."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, args, child))
    proc.start()
    out = parent.recv() if parent.poll(timeout_s) else {"error": "no answer"}
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
    return out


def _child(fn: Callable[..., dict[str, Any]], args: tuple, conn) -> None:
    try:
        conn.send(fn(*args))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def best_by(history: list[tuple[float, float]], seconds: float) -> float | None:
    """Best makespan streamed within `seconds` (history: (elapsed s, makespan ms), improving)."""
    within = [ms for t, ms in history if t <= seconds]
    return min(within) if within else None
