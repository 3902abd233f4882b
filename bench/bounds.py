"""Is a memory-aware bound ever above an optimum? (docs/optimizer.md, "Bounds")

    .venv/bin/python bench/bounds.py --seed 1 --problems 150
    .venv/bin/python bench/bounds.py --seed 7 --problems 200
    .venv/bin/python bench/bounds.py --family uneven --seed 1 --problems 300
    .venv/bin/python bench/bounds.py --family copies --seed 1 --problems 300

Random small problems (2-4 devices, 2-5 microbatches, 1-2 chunks, split or not, offload and
recompute on or off, limits 1-2x the least memory; `--family uneven`: forwards that differ by stage,
no memory limit, where planner.bounds.arrival_bound binds; `--family copies`: two stages per device,
copies slower than forwards, a heavy last stage, where planner.solver.chunk_warmup binds), each
solved by CP-SAT *blind* to planner.solver.memory_bound and to planner.bounds' arrival, warmup and
exclusive bounds (it knows only free_lower_bound): the solver normally gives those bounds to the
model as the makespan's floor and calls a plan meeting them optimal, so an oracle that knew them
could not catch them being too high.
Every proven optimum is compared with all of them; any violation is printed and fails the run.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from core_schedules import problem_doc, slow_copies_chunked, uneven_forwards  # the tests' builders
from oracles import blind_to_memory_bounds  # the tests' blind CP-SAT
from pipeplan.planner.bounds import free_lower_bound, lower_bound, min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import solve
from pipeplan.planner.solver.memory_bound import memory_lower_bound


def random_problem(rng: random.Random) -> Problem:
    doc = problem_doc(p=rng.choice([2, 3, 4]), m=rng.choice([2, 3, 4, 5]), chunks=rng.choice([1, 1, 2]),
                      split=rng.random() < 0.8, b=rng.choice([1.0, 1.5]), w=rng.choice([0.5, 1.0, 2.0]),
                      weight_grad_mib=rng.choice([0.0, 50.0, 100.0]), p2p=rng.choice([0.0, 0.1]),
                      offload=rng.random() < 0.4, recompute=rng.random() < 0.3)
    need = max(min_memory(Problem.model_validate(doc)))
    for dev in doc["devices"]:
        dev["memory_limit_mib"] = need * rng.choice([1.0, 1.2, 1.5, 2.0])
    return Problem.model_validate(doc)


FAMILIES = {"memory": random_problem, "uneven": uneven_forwards, "copies": slow_copies_chunked}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--problems", type=int, default=150)
    ap.add_argument("--seconds", type=float, default=5.0, help="CP-SAT time per problem")
    ap.add_argument("--family", choices=tuple(FAMILIES), default="memory",
                    help="memory limits and treatments (default), uneven forwards without limits, or"
                         " slow copies with two stages per device")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    build = FAMILIES[args.family]
    proven = violations = stronger = warmup_wins = 0
    for n in range(1, args.problems + 1):
        problem = build(rng)
        bound = max(memory_lower_bound(problem), lower_bound(problem))  # every bound the solver reports
        with blind_to_memory_bounds():
            result = solve(problem, args.seconds, engine="cpsat", workers=1)
        if result.status == "optimal":
            proven += 1
            if bound > result.plan.makespan_ms + 1e-9:
                violations += 1
                print(f"VIOLATION: bound {bound} > optimum {result.plan.makespan_ms}: "
                      f"{problem.model_dump_json()}", flush=True)
        stronger += bound > free_lower_bound(problem) + 1e-9
        others = max(free_lower_bound(problem), memory_lower_bound(problem))
        warmup_wins += lower_bound(problem) > others + 1e-9
        if n % 25 == 0:
            print(f"[{n}/{args.problems}] {proven} proven optima, {violations} violations", file=sys.stderr,
                  flush=True)
    print(f"{args.problems} problems: {proven} optima proven, bound above an optimum {violations} times, "
          f"above the memory-free bound on {stronger}, raised by planner.bounds' arrival / warm-up / "
          f"exclusive bounds alone on {warmup_wins}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
