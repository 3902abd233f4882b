"""Problems the memory-aware bound tests share: a heavy LM head beside the embedding stage, and the
random family the pairwise exclusion and several-stage warm-up arguments are checked on."""

from __future__ import annotations

import random
from collections.abc import Callable

from core_schedules import problem_doc
from pipeplan.planner.bounds import ALL, lower_bound, min_memory, prove
from pipeplan.planner.bounds.forward_count import forward_count_bound
from pipeplan.planner.bounds.occupancy import occupancy_bound
from pipeplan.planner.contract import Problem


def other_bounds(problem: Problem) -> float:
    """Every argument but pairwise exclusion, without the several-stage warm-up (chunk_warmup.py),
    which meets or beats it on heavy_head."""
    counted = forward_count_bound(problem, chunked_warmup=False)
    return max(lower_bound(problem), counted, occupancy_bound(problem))


def others(values: dict[str, float], name: str) -> float:
    """The largest of a proof's values (`Proof.values`) but argument `name`'s."""
    return max(v for argument, v in values.items() if argument != name)


def deciding(family: Callable[[random.Random], Problem], rng: random.Random, name: str,
             tries: int = 300) -> tuple[Problem, float]:
    """The first problem `family` draws where argument `name` is above every other one, and its
    value there (the problems an argument's soundness test checks against a blind optimum)."""
    for _ in range(tries):
        problem = family(rng)
        values = prove(problem, ALL).values
        if values[name] > others(values, name) + 1e-6:
            return problem, values[name]
    raise AssertionError(f"no problem in {tries} where {name} is above every other argument")


def heavy_head(m: int, p: int = 3) -> Problem:
    """V placement: device 0 holds a light embedding stage (150 MiB, weight gradient 120) and a heavy
    last stage (300 MiB, 180 until its W); 320 MiB free there. Two head windows, or a head window and
    an embedding activation, never fit together."""
    doc = problem_doc(p=p, m=m, chunks=2, placement="v", recompute=True, checkpoint_mib=5.0)
    doc["stages"][0].update(activation_mib=150.0, weight_grad_mib=120.0, forward_ms=0.5,
                            backward_input_ms=0.5, backward_weight_ms=0.5)
    doc["stages"][-1].update(activation_mib=300.0, weight_grad_mib=180.0, forward_ms=2.0,
                             backward_input_ms=2.0, backward_weight_ms=2.0)
    doc["devices"][0]["memory_limit_mib"] = 320.0
    return Problem.model_validate(doc)


def random_problem(rng: random.Random) -> Problem:
    """bench/bounds.py's family, with a heavier last stage half the time (the shape pairwise
    exclusion is for)."""
    doc = problem_doc(p=rng.choice([2, 3]), m=rng.choice([2, 3, 4]), chunks=rng.choice([1, 2, 2]),
                      placement=rng.choice(["loop", "v"]), split=rng.random() < 0.8,
                      b=rng.choice([1.0, 1.5]), w=rng.choice([0.5, 1.0, 2.0]),
                      weight_grad_mib=rng.choice([0.0, 50.0, 100.0]), p2p=rng.choice([0.0, 0.1]),
                      offload=rng.random() < 0.4, recompute=rng.random() < 0.4)
    if rng.random() < 0.5:
        doc["stages"][-1].update(activation_mib=rng.choice([150.0, 250.0]), forward_ms=rng.choice([1.0, 2.0]),
                                 backward_input_ms=2.0, weight_grad_mib=rng.choice([60.0, 120.0]))
    need = max(min_memory(Problem.model_validate(doc)))
    for dev in doc["devices"]:
        dev["memory_limit_mib"] = need * rng.choice([1.0, 1.2, 1.5])
    return Problem.model_validate(doc)
