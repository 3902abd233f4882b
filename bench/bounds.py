"""Is a bound argument ever above an optimum? Which one is tight? (docs/optimizer.md, "Bounds")

    .venv/bin/python bench/bounds.py --seed 1 --problems 150
    .venv/bin/python bench/bounds.py --seed 7 --problems 200
    .venv/bin/python bench/bounds.py --family uneven --seed 1 --problems 300
    .venv/bin/python bench/bounds.py --family copies --seed 1 --problems 300
    .venv/bin/python bench/bounds.py --family one_at_a_time --seed 1 --problems 120

Random small problems (2-4 devices, 2-5 microbatches, 1-2 chunks, split or not, offload and
recompute on or off, limits 1-2x the least memory; `--family uneven`: forwards that differ by stage,
no memory limit, where the arrival argument binds; `--family copies`: two stages per device, copies
slower than forwards, a heavy last stage, where the several-stage warm-up binds; `--family
one_at_a_time`: one stage per device, some holding one activation at a time, where the backward
stretches bind), each solved by
CP-SAT *blind* to every planner.bounds argument but the memory-free one: the solver normally gives
the bounds to the model as the makespan's floor and calls a plan meeting them optimal, so an oracle
that knew them could not catch them being too high. Every proven optimum is compared with every
argument; any violation is printed and fails the run. The table counts, per argument, the problems
where it is tight (ties go to the argument listed first) and where it alone is tight.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from core_schedules import (  # the tests' builders
    one_activation_at_a_time, problem_doc, slow_copies_chunked, uneven_forwards)
from pipeplan.planner.bounds import ALL, ARGUMENTS, min_memory, prove
from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import solve
from support.oracles import BLIND  # the tests' blind oracle


def random_problem(rng: random.Random) -> Problem:
    doc = problem_doc(p=rng.choice([2, 3, 4]), m=rng.choice([2, 3, 4, 5]), chunks=rng.choice([1, 1, 2]),
                      split=rng.random() < 0.8, b=rng.choice([1.0, 1.5]), w=rng.choice([0.5, 1.0, 2.0]),
                      weight_grad_mib=rng.choice([0.0, 50.0, 100.0]), p2p=rng.choice([0.0, 0.1]),
                      offload=rng.random() < 0.4, recompute=rng.random() < 0.3)
    need = max(min_memory(Problem.model_validate(doc)))
    for dev in doc["devices"]:
        dev["memory_limit_mib"] = need * rng.choice([1.0, 1.2, 1.5, 2.0])
    return Problem.model_validate(doc)


FAMILIES = {"memory": random_problem, "uneven": uneven_forwards, "copies": slow_copies_chunked,
            "one_at_a_time": one_activation_at_a_time}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--problems", type=int, default=150)
    ap.add_argument("--seconds", type=float, default=5.0, help="CP-SAT time per problem")
    ap.add_argument("--family", choices=tuple(FAMILIES), default="memory",
                    help="memory limits and treatments (default), uneven forwards without limits,"
                         " slow copies with two stages per device, or one activation at a time")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    build = FAMILIES[args.family]
    proven = violations = stronger = 0
    tight: Counter[str] = Counter()
    alone: Counter[str] = Counter()
    for n in range(1, args.problems + 1):
        problem = build(rng)
        proof = prove(problem, ALL)  # every bound the solver reports
        result = solve(problem, args.seconds, engine="cpsat", workers=1, bounds=BLIND)
        if result.status == "optimal":
            proven += 1
            if proof.ms > result.plan.makespan_ms + 1e-9:
                violations += 1
                print(f"VIOLATION: {proof.tight} {proof.ms} > optimum {result.plan.makespan_ms}: "
                      f"{problem.model_dump_json()}", flush=True)
        stronger += proof.ms > proof.values["memory_free"] + 1e-9
        if proof.tight is not None:
            tight[proof.tight] += 1
            if sum(v >= proof.ms - 1e-9 for v in proof.values.values()) == 1:
                alone[proof.tight] += 1
        if n % 25 == 0:
            print(f"[{n}/{args.problems}] {proven} proven optima, {violations} violations", file=sys.stderr,
                  flush=True)
    print(f"{args.problems} problems: {proven} optima proven, a bound above an optimum {violations} times, "
          f"above the memory-free bound on {stronger}\n")
    print("| argument | tight on | alone tight on |\n|---|---|---|")
    for a in ARGUMENTS:
        print(f"| {a.name} | {tight[a.name]} | {alone[a.name]} |")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
