"""Frontier benchmark: for models of the real-model suite (bench/model_suite.py) or example specs, the
time to a 12-point frontier, its dominance over every peer point (margin in % at each peer's own
memory per GPU) and how close it is to a denser sweep of budgets.

    .venv/bin/python bench/frontier.py [--cases llama2-7b-p8,examples/specs/phi3_mini_8xh100_15gib.json]
        [--points 12] [--time-limit 5] [--dense 24] [--budgets uniform|scaled] [--markdown]

A case is a suite name or a spec file (the issue-38 cases: examples/specs/llama3_8b_8xh100_40gib.json,
examples/specs/phi3_mini_8xh100_15gib.json).

    .venv/bin/python bench/frontier.py --first-plans 8x32x12,8x32x64,16x64x12,16x64x40,32x128x4

times what POST /v1/frontiers computes in its child (service.frontier_store.first_points, without
storing): budgets placed with the service's cheap first plans and every point's first plan, for
P x M x points on a synthetic problem with room for 8 activations per device and offload allowed;
`frontier_max_ops` is sized from it.

Closeness: the dense sweep solves `--dense` evenly spaced budgets over the same range with the same
time per point; at each dense budget we compare the 12-point curve's value there (its largest point at
or below) with the dense solve, and report the worst and mean excess in %. Offload and recompute are
allowed (the frontier's low end needs them). Figures depend on the machine; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.frontier import compute_frontier

from bench.model_suite import find

DEFAULT_CASES = "llama2-7b-p8,qwen2.5-3b-p8-tied,llama3-8b-p8-v"


def problem_of(name: str):
    spec = json.loads(Path(name).read_text()) if name.endswith(".json") else find(name).spec()
    spec["training"] = {**spec["training"], "offload": True, "recompute": True}
    return problem_from_document(spec)


def dense_excess(problem, fr, dense: int, time_limit: float, workers: int) -> tuple[float, float]:
    """(worst, mean) % by which the frontier's curve exceeds a direct solve at `dense` budgets."""
    from pipeplan.planner.solver import solve

    excess = []
    for i in range(dense):
        f = fr.factor_min + (fr.factor_max - fr.factor_min) * i / max(1, dense - 1)
        sub = fr.budgets.apply(problem, f)
        direct = solve(sub, time_limit, workers=workers).plan.makespan_ms
        curve = fr.at(f).makespan_ms
        excess.append(100.0 * (curve - direct) / direct)
    return max(excess), sum(excess) / len(excess)


def first_plans(sizes: str, markdown: bool) -> None:
    from pipeplan.planner.contract import Device, Options, Problem, Stage
    from pipeplan.planner.frontier import PUBLISHED_PEERS, heuristic_points
    from pipeplan.service.frontier_store import SETUP_POINTS
    from pipeplan.service.inline import first_plan, ops_of

    from pipeplan.settings import Settings

    s = Settings()
    head = ["P", "M", "points", "(points + 8) x ops", "first plans (s)", "points placed"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head) if markdown else "\t".join(head))
    for size in sizes.split(","):
        devices, microbatches, points = (int(x) for x in size.split("x"))
        stages = [Stage(device=d, forward_ms=1.0, backward_input_ms=1.2, backward_weight_ms=0.8, offload_ms=0.6,
                        activation_mib=512.0, weight_grad_mib=128.0) for d in range(devices)]
        problem = Problem(num_devices=devices, num_microbatches=microbatches, p2p_ms=0.05,
                          options=Options(split_backward=True, offload=True), stages=stages,
                          devices=[Device(memory_limit_mib=8000.0 + 640.0 * 8, static_mib=8000.0)] * devices,
                          metadata={"bench": f"frontier-{size}"})
        t0 = time.monotonic()
        _, placed = heuristic_points(problem, points, "uniform",
                                     lambda sub, key: first_plan(sub, key, s.inline_greedy_s, s.inline_greedy_max_s),
                                     PUBLISHED_PEERS)
        cells = [str(devices), str(microbatches), str(points), f"{(points + SETUP_POINTS) * ops_of(problem):,}",
                 f"{time.monotonic() - t0:.1f}", str(len(placed))]
        print("| " + " | ".join(cells) + " |" if markdown else "\t".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--points", type=int, default=12)
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per point")
    ap.add_argument("--dense", type=int, default=24, help="budgets of the dense sweep (0: skip)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budgets", default="uniform", help="uniform (one cap per GPU) or scaled")
    ap.add_argument("--first-plans", help="PxMxPOINTS,...: time the service's first plans instead")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.first_plans:
        first_plans(args.first_plans, args.markdown)
        return 0
    head = ["case", "points", "time to frontier (s)", "GiB/GPU range", "peer points dominated",
            "margin at peers' memory (min / median / max %)", "vs dense sweep (worst / mean % slower)"]
    print("| " + " | ".join(head) + " |" if args.markdown else "\t".join(head))
    if args.markdown:
        print("|" + "---|" * len(head))
    for name in args.cases.split(","):
        problem = problem_of(name)
        t0 = time.monotonic()
        fr = compute_frontier(problem, args.points, args.time_limit, workers=args.workers, budgets=args.budgets)
        took = time.monotonic() - t0
        dom = fr.dominance()
        margins = sorted(d["margin_pct"] for d in dom if d["margin_pct"] is not None)
        beaten = sum(d["dominated"] for d in dom)
        med = margins[len(margins) // 2] if margins else float("nan")
        closeness = "-"
        if args.dense:
            worst, mean = dense_excess(problem, fr, args.dense, args.time_limit, args.workers)
            closeness = f"{worst:.2f} / {mean:.2f}"
        lo, hi = fr.points[0].budget_mib / 1024, fr.points[-1].budget_mib / 1024
        label = Path(name).stem if name.endswith(".json") else name
        cells = [label, str(len(fr.points)), f"{took:.0f}", f"{lo:.1f}–{hi:.1f}", f"{beaten}/{len(dom)}",
                 f"{margins[0]:.1f} / {med:.1f} / {margins[-1]:.1f}" if margins else "-", closeness]
        print("| " + " | ".join(cells) + " |" if args.markdown else "\t".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
