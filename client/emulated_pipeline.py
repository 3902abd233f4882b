"""Run plans on N gloo ranks (CPU processes) in emulated time and return their measured traces.

The fidelity harness of docs/trace.md: every stage is a small real MLP block (so autograd, the
saved-tensor hooks, offload copies and recomputes all really run), and every op is padded to the
duration a cost problem gives it (`client.emulation`). Because the ranks mostly sleep, 4-8 ranks run
a plan with known op costs on a 2-core machine. `costs` may differ from the planned problem (a slow
stage); the traces then show what the plan would meet on such hardware.

Used by `bench/fidelity.py` and the torch tests; needs the `torch` extra.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.trace import Trace


@dataclass(frozen=True)
class Job:
    """One plan to run: its problem (same shape for every job of a run) and what to measure."""

    problem: Problem
    plan: Plan
    synchronous_copies: bool = False
    costs: Problem | None = None  # emulated durations (default: run_emulated's costs, else `problem`)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_emulated(jobs: list[Job], *, costs: Problem | None = None, iterations: int = 3, warmup: int = 1,
                 width: int = 8, scale: float = 1.0) -> list[list[Trace]]:
    """Every job's measured iterations, one process start for all: traces[job][iteration].

    `costs` gives the emulated durations (default: each job's own problem). The jobs take turns:
    `warmup` rounds, then `iterations` rounds of one iteration of every job.
    """
    import torch.multiprocessing as mp

    world = jobs[0].problem.num_devices
    if any(j.problem.num_devices != world for j in jobs):
        raise ValueError("every job of one run must have the same number of devices")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    payload = [(j.problem.model_dump_json(), j.plan.model_dump_json(), j.synchronous_copies,
                j.costs.model_dump_json() if j.costs else None) for j in jobs]
    with tempfile.TemporaryDirectory(prefix="pipeplan-emulated-") as out:
        mp.spawn(_rank_main, nprocs=world, join=True,
                 args=(world, _free_port(), payload, costs.model_dump_json() if costs else None,
                       iterations, warmup, width, scale, out))
        docs = json.loads(Path(out, "traces.json").read_text())
    return [[Trace.model_validate(t) for t in job] for job in docs]


def _rank_main(rank: int, world: int, port: int, payload: list, costs_json: str | None, iterations: int,
               warmup: int, width: int, scale: float, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from .emulation import Emulation
    from .torch_runtime import build_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fixed_costs = Problem.model_validate_json(costs_json) if costs_json else None
        runs = []
        for problem_json, plan_json, sync, job_costs in payload:
            problem, plan = Problem.model_validate_json(problem_json), Plan.model_validate_json(plan_json)
            costs = Problem.model_validate_json(job_costs) if job_costs else fixed_costs
            emulation = Emulation(costs or problem, scale)
            layers = make_blocks(problem.num_stages, width)
            stages = [PipelineStage(layers[k], k, problem.num_stages, torch.device("cpu"))
                      for k in problem.stages_of(rank)]
            schedule = build_schedule(problem, plan, stages, loss_fn=_mse, trace=True, emulation=emulation,
                                      synchronous_copies=sync)
            runs.append((problem, schedule, layers, _batch(problem.num_microbatches, width)))
        results: list[list[dict]] = [[] for _ in runs]
        # round by round, one iteration of every job: a change in the machine's load during the run
        # (it is shared) then falls on every job alike instead of on whichever job ran at the time
        for n in range(warmup + iterations):
            for out, (problem, schedule, layers, (x, y)) in zip(results, runs):
                for layer in layers:
                    layer.zero_grad(set_to_none=True)
                first, last = problem.stages[0].device, problem.stages[-1].device
                args = (x,) if rank == first else ()
                if rank == last:
                    schedule.step(*args, target=y)
                else:
                    schedule.step(*args)
                trace = schedule.collect_trace(metadata={"emulated_scale": scale})
                if n >= warmup and trace is not None:
                    out.append(trace.model_dump(mode="json"))
        for _, schedule, _, _ in runs:
            schedule.executor.close()
        if rank == 0:
            Path(out_dir, "traces.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def make_blocks(num_stages: int, width: int):
    """One small residual MLP block per stage (deterministic init, the same on every process)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(width, 2 * width)
            self.down = nn.Linear(2 * width, width)

        def forward(self, x):
            return x + self.down(torch.tanh(self.up(x)))

    torch.manual_seed(0)
    return [Block() for _ in range(num_stages)]


def _mse(output, target):
    return ((output - target) ** 2).mean()


def _batch(microbatches: int, width: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return (torch.randn(2 * microbatches, width, generator=g), torch.randn(2 * microbatches, width, generator=g))
