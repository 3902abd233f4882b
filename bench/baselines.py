"""Our baselines next to the reference figures of docs/baselines.md (peers' generators, one simulator).

Run:  .venv/bin/python bench/baselines.py      (prints a table; `--markdown` prints it as Markdown)
      .venv/bin/python bench/baselines.py --speed   (how long best_heuristic takes, het stages)

Memory model of the reference: an activation is held from F until W (weight_grad_mib =
activation_mib = 1 per full stage), limits in activations per device ("1p" = P). uni: F=B=W=1, free
links; het: F=1, B=1.2, W=0.8, p2p 0.05. V cases: 2 chunks per device (stage k and 2P-1-k), each
chunk at half the cost and half the activation of a full stage.
"""

from __future__ import annotations

import sys
import time

from pipeplan.planner.baselines import DoesNotFit, NotApplicable, best_heuristic, run_baseline
from pipeplan.planner.bounds import lower_bound
from pipeplan.planner.contract import Problem

CASES = [  # (label, P, M, het, 1F1B, ZB-H1, ZB auto @1p, ZB auto @P/2, ZB-V @1p, V-auto @P/2)
    ("uni P=4 M=8", 4, 8, False, 33, 27, 27, 51, 25.5, 29.5),
    ("uni P=8 M=32", 8, 32, False, 117, 103, 103, 327, 99.5, 107.5),
    ("uni P=16 M=64", 16, 64, False, 237, 207, 207, 1167, 199.5, 215.5),
    ("het P=8 M=32", 8, 32, True, 120.4, 109.2, 107.2, 372.5, 101.95, 131.8),
    ("het P=16 M=64", 16, 64, True, 244.4, 220.4, 216, 1335.3, 204.9, 264.5),
]


def case(p: int, m: int, het: bool, chunks: int = 1, limit: float | None = None,
         offload_ms: float | None = None) -> Problem:
    f, b, w, link = (1.0, 1.2, 0.8, 0.05) if het else (1.0, 1.0, 1.0, 0.0)
    c = 1.0 / chunks
    stages = []
    for k in range(p * chunks):
        lap, r = divmod(k, p)
        stage = {"device": p - 1 - r if lap % 2 else r, "forward_ms": f * c, "backward_input_ms": b * c,
                 "backward_weight_ms": w * c, "activation_mib": c, "weight_grad_mib": c}
        if offload_ms is not None:
            stage["offload_ms"] = offload_ms * c
        stages.append(stage)
    return Problem.model_validate({
        "num_devices": p, "num_microbatches": m, "p2p_ms": link,
        "options": {"split_backward": True, "offload": offload_ms is not None},
        "stages": stages, "devices": [{"memory_limit_mib": limit}] * p})


def makespan(problem: Problem, name: str | None) -> str:
    try:
        plan = best_heuristic(problem) if name is None else run_baseline(problem, name)
    except (NotApplicable, DoesNotFit) as exc:
        return f"— ({type(exc).__name__})"
    return f"{plan.makespan_ms:.6g}"


def rows() -> list[list[str]]:
    out = []
    for label, p, m, het, f1b, h1, auto1, auto_half, zbv, vauto in CASES:
        start = time.perf_counter()
        plain = case(p, m, het)
        at_1p = case(p, m, het, limit=float(p))
        at_half = case(p, m, het, limit=p / 2)
        at_half_offload = case(p, m, het, limit=p / 2, offload_ms=1.0)
        v_1p = case(p, m, het, chunks=2, limit=float(p))
        v_half = case(p, m, het, chunks=2, limit=p / 2)
        out.append([
            label,
            f"{f1b} / {makespan(plain, '1f1b')}",
            f"{h1} / {makespan(plain, 'zb-h1')}",
            f"{auto1} / {makespan(at_1p, None)}",
            f"{auto_half} / {makespan(at_half, None)}",
            f"{makespan(at_half_offload, None)}",
            f"{zbv} / {makespan(v_1p, 'zb-v')}",
            f"{makespan(case(p, m, het, chunks=2), 'zb-v')}",
            f"{vauto} / {makespan(v_half, None)}",
            f"{lower_bound(plain):.6g}",
            f"{time.perf_counter() - start:.1f}",
        ])
    return out


HEADER = ["case", "1F1B ref/ours", "ZB-H1 ref/ours", "ZB auto @1p ref / best", "ZB auto @P/2 ref / best",
          "@P/2 + offload (link = F) best", "ZB-V @1p ref/ours", "ZB-V no limit (peak 1p)", "V-auto @P/2 ref / best", "lower bound",
          "time s"]


# (P, M, limit in activations or None, offload at a forward's time): best_heuristic's speed table
SPEED = [(8, 32, None, False), (8, 32, 8.0, False), (8, 32, 4.0, True),
         (32, 128, None, False), (32, 128, 32.0, False), (32, 128, 16.0, True)]
SPEED_HEADER = ["problem", "limit (activations)", "offload", "makespan", "method", "seconds"]


def speed_rows() -> list[list[str]]:
    out = []
    for p, m, limit, offload in SPEED:
        problem = case(p, m, True, limit=limit, offload_ms=1.0 if offload else None)
        start = time.perf_counter()
        plan = best_heuristic(problem)
        out.append([f"het P={p} M={m}", "none" if limit is None else f"{limit:g}", "yes" if offload else "no",
                    f"{plan.makespan_ms:.2f}", plan.method, f"{time.perf_counter() - start:.2f}"])
    return out


def main() -> None:
    speed = "--speed" in sys.argv
    header, table = (SPEED_HEADER, speed_rows()) if speed else (HEADER, rows())
    if "--markdown" in sys.argv:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in table:
            print("| " + " | ".join(row) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="best_heuristic: makespan and seconds" if speed
              else "reference figures (docs/baselines.md): reference / ours (makespan, lower is better)")
    for h in header:
        t.add_column(h)
    for row in table:
        t.add_row(*row)
    Console().print(t)


if __name__ == "__main__":
    main()
