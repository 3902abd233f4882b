"""Helpers for the torch tests: plans with planned offload/recompute, and a 4-rank gloo harness.

The rank function lives in an importable module so torch.multiprocessing's spawn can find it.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from pipeplan.client.emulated_pipeline import make_blocks
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import DeviceOrder, Gate, Schedule, build_plan, simulate
from pipeplan.planner.validator import assert_valid

WIDTH = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def problem_for(p: int, m: int, *, chunks: int = 1, placement: str = "loop", split: bool = True) -> Problem:
    stages = []
    for k in range(p * chunks):
        c, r = divmod(k, p)
        device = p - 1 - r if placement == "v" and c % 2 else r
        stages.append({"device": device, "forward_ms": 1.0, "backward_input_ms": 1.0, "backward_weight_ms": 1.0,
                       "offload_ms": 0.5, "activation_mib": 10.0, "weight_grad_mib": 2.0, "checkpoint_mib": 1.0})
    return Problem.model_validate({
        "num_devices": p, "num_microbatches": m, "p2p_ms": 0.1,
        "options": {"split_backward": split, "offload": True, "recompute": True},
        "stages": stages, "devices": [{"memory_limit_mib": None} for _ in range(p)]})


def tight(problem: Problem, fraction: float, dense: str) -> Problem:
    """The problem with limits `fraction` of the way from the least feasible memory to `dense`'s peak."""
    from pipeplan.planner.baselines import run_baseline
    from pipeplan.planner.bounds import min_memory

    peak, floor = run_baseline(problem, dense).peak_memory_mib, min_memory(problem)
    doc = problem.model_dump(mode="json")
    for d, device in enumerate(doc["devices"]):
        device["memory_limit_mib"] = floor[d] + fraction * (peak[d] - floor[d])
    return Problem.model_validate(doc)


def planned(problem: Problem, offload: set[tuple[int, int]], recompute: set[tuple[int, int]]) -> Plan:
    """A depth-first (1F1B-like) plan with OFFLOAD/RELOAD and RECOMPUTE on the given (stage, mb) pairs.

    Per device: forwards in (mb, stage) order, backwards in (mb, reversed stage) order, interleaved
    1F1B-style after a warm-up when the device holds one stage.
    """
    p, m = problem.num_devices, problem.num_microbatches
    orders = [DeviceOrder() for _ in range(p)]
    gates: list[Gate] = []
    split = problem.options.split_backward
    for d in range(p):
        mine = problem.stages_of(d)
        fwd = [(i, k) for i in range(m) for k in mine]
        bwd = [(i, k) for i in range(m) for k in reversed(mine)]
        # 1F1B warm-up for one stage per device; all forwards first (GPipe, deadlock-free) otherwise
        warm = min(len(fwd), p - d) if len(mine) == 1 else len(fwd)
        seq = [("F", x) for x in fwd[:warm]]
        fi, bi = warm, 0
        while bi < len(bwd):
            seq.append(("B", bwd[bi]))
            bi += 1
            if fi < len(fwd):
                seq.append(("F", fwd[fi]))
                fi += 1
        for what, (i, k) in seq:
            if what == "F":
                orders[d].compute.append(Op(Kind.F, k, i))
                if (k, i) in offload:
                    orders[d].d2h.append(Op(Kind.OFFLOAD, k, i))
            else:
                if (k, i) in offload:
                    orders[d].h2d.append(Op(Kind.RELOAD, k, i))
                    # reload as late as the op before the backward starts (not ASAP after the offload)
                    gates.append(Gate(Op(Kind.RELOAD, k, i), orders[d].compute[-1]))
                if (k, i) in recompute:
                    orders[d].compute.append(Op(Kind.RECOMPUTE, k, i))
                orders[d].compute += [Op(Kind.B, k, i), Op(Kind.W, k, i)] if split else [Op(Kind.BW, k, i)]
    schedule = Schedule(orders, gates)
    return assert_valid(problem, build_plan(problem, schedule, simulate(problem, schedule), "test-memory"))


def run_rank(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]], out_dir: str,
             steps_per_plan: int = 1) -> None:
    """One rank: for each (problem, plans) job, MLP stages in float64 run each plan (swapping between
    them at iteration boundaries); grads and executor stats are written to out_dir/rank{r}.json."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        reports = [_run_job(rank, Problem.model_validate_json(problem_json),
                            [Plan.model_validate_json(p) for p in plans_json], steps_per_plan)
                   for problem_json, plans_json in jobs]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports))
    finally:
        dist.destroy_process_group()


def _run_job(rank: int, problem: Problem, plans: list[Plan], steps_per_plan: int) -> dict:
    import torch
    from pipeplan.client.torch_runtime import build_schedule
    from torch.distributed.pipelining import PipelineStage

    layers = make_layers(problem.num_stages)
    mine = problem.stages_of(rank)
    stages = [PipelineStage(layers[k], k, problem.num_stages, torch.device("cpu")) for k in mine]
    planned_schedule = build_schedule(problem, plans[0], stages, loss_fn=mse)
    x, y = batch(problem.num_microbatches)
    first, last = problem.stages[0].device, problem.stages[-1].device
    report: dict = {"steps": []}
    for n, plan in enumerate(plans):
        if n:
            planned_schedule.swap(plan)
        for _ in range(steps_per_plan):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            planned_schedule.executor.stats.reset()
            args = (x,) if rank == first else ()
            if rank == last:
                planned_schedule.step(*args, target=y)
            else:
                planned_schedule.step(*args)
            stats = planned_schedule.executor.stats
            report["steps"].append({
                "revision": plan.revision,
                "grads": {str(k): [g.tolist() for g in grads_of(layers[k])] for k in mine},
                "offloaded": sorted([list(kv[0]) + [kv[1]] for kv in stats.offloaded_bytes.items()]),
                "freed": sorted([list(kv[0]) + [kv[1]] for kv in stats.freed_bytes.items()]),
                "reloads": sorted(list(x) for x in stats.reloads),
                "recomputes": sorted(list(x) for x in stats.recomputes),
                "late": list(stats.late), "log": list(stats.log)})
    return report


def make_layers(num_stages: int):
    """One small residual MLP block per stage (deterministic init), same on every process."""
    return make_blocks(num_stages, WIDTH)


def mse(output, target):
    return ((output - target) ** 2).mean()


def batch(microbatches: int):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * microbatches, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(2 * microbatches, WIDTH, generator=g, dtype=torch.float64)
    return x, y


def grads_of(layer):
    return [p.grad.detach().clone() for p in layer.parameters()]


def reference_grads(num_stages: int, microbatches: int):
    """The same model on one process, no pipeline: mean of the per-microbatch losses."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the ranks run; set back so later tests see their own
    try:
        layers = make_layers(num_stages)
        x, y = batch(microbatches)
        total = 0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            h = xs
            for layer in layers:
                h = layer(h)
            total = total + mse(h, ys)
        (total / microbatches).backward()
        return [grads_of(layer) for layer in layers]
    finally:
        torch.set_default_dtype(previous)


def spawn(jobs: list[tuple[Problem, list[Plan]]], out_dir: str, steps_per_plan: int = 1) -> list[list[dict]]:
    """Run every job on one set of ranks (one process start for all); reports[job][rank]."""
    payload = [(problem.model_dump_json(), [p.model_dump_json() for p in plans]) for problem, plans in jobs]
    return _spawn(run_rank, jobs[0][0].num_devices, payload, out_dir, steps_per_plan)


def _spawn(target, world: int, payload: list, out_dir: str, *extra) -> list[list[dict]]:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(target, nprocs=world, args=(world, free_port(), payload, out_dir, *extra), join=True)
    per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    return [[per_rank[r][j] for r in range(world)] for j in range(len(payload))]


def spawn_torch_csv(jobs: list[tuple[Problem, str]], out_dir: str) -> list[list[dict]]:
    """Each (problem, CSV) on torch's own runtime and loader, no pipeplan code on the ranks:
    `_PipelineScheduleRuntime` with real `PipelineStage`s, `_load_csv(path)`, one step; reports[job][rank]
    holds this rank's gradients per stage."""
    payload = [(problem.model_dump_json(), csv) for problem, csv in jobs]
    return _spawn(run_torch_csv_rank, jobs[0][0].num_devices, payload, out_dir)


def run_torch_csv_rank(rank: int, world: int, port: int, jobs: list[tuple[str, str]], out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        reports = []
        for n, (problem_json, csv_text) in enumerate(jobs):
            problem = Problem.model_validate_json(problem_json)
            layers = make_layers(problem.num_stages)
            mine = problem.stages_of(rank)
            stages = [PipelineStage(layers[k], k, problem.num_stages, torch.device("cpu")) for k in mine]
            schedule = _PipelineScheduleRuntime(stages, n_microbatches=problem.num_microbatches, loss_fn=mse)
            path = Path(out_dir, f"job{n}.csv")
            if rank == 0:
                path.write_text(csv_text)
            dist.barrier()
            schedule._load_csv(str(path))
            x, y = batch(problem.num_microbatches)
            args = (x,) if 0 in mine else ()
            kwargs = {"target": y} if problem.num_stages - 1 in mine else {}
            schedule.step(*args, **kwargs)
            reports.append({"grads": {str(k): [g.tolist() for g in grads_of(layers[k])] for k in mine}})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports))
    finally:
        dist.destroy_process_group()


def spawn_torchtitan(world: int, jobs: list[tuple[object, int, int]], out_dir: str) -> list[list[dict]]:
    """Each (torchtitan ParallelismConfig, local batch size, stages) through torchtitan's own schedule
    builder (`_build_pipeline_schedule`, which loads the CSV the config names) on `world` gloo ranks,
    each rank building the stages torchtitan's placement rule gives it; reports[job][rank]."""
    return _spawn(run_torchtitan_rank, world, jobs, out_dir)


def run_torchtitan_rank(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.distributed.pipeline_parallel import (
        _build_pipeline_schedule,
        _get_pp_rank_to_stage_indices_mapping,
    )

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        reports = []
        for parallelism, local_batch_size, num_stages in jobs:
            mine = _get_pp_rank_to_stage_indices_mapping(rank, world, parallelism.pipeline_parallel_schedule,
                                                         num_stages)
            layers = make_layers(num_stages)
            stages = [PipelineStage(layers[k], k, num_stages, torch.device("cpu")) for k in mine]
            microbatches = local_batch_size // parallelism.pipeline_parallel_microbatch_size

            def loss_fn(output, target, _m=microbatches):  # torchtitan's losses return (loss, extra);
                return mse(output, target) / _m, None  # its schedule does not scale the gradients

            schedule = _build_pipeline_schedule(parallelism=parallelism, local_batch_size=local_batch_size,
                                                stages=stages, loss_fn=loss_fn)
            x, y = batch(microbatches)
            args = (x,) if 0 in mine else ()
            kwargs = {"target": y} if num_stages - 1 in mine else {}
            schedule.step(*args, **kwargs)
            reports.append({"stages": list(mine), "schedule": type(schedule).__name__,
                            "grads": {str(k): [g.tolist() for g in grads_of(layers[k])] for k in mine}})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports))
    finally:
        dist.destroy_process_group()


def emulated_problem(m: int = 8, unit_ms: float = 20.0, copy_ms: float = 20.0, p2p_ms: float = 1.0) -> Problem:
    """4 devices, uniform stages whose ops take `unit_ms` (copies `copy_ms`) in emulated time.

    20-ms ops keep the runtime's own overhead between ops (about 0.5 ms per op on a loaded 2-core
    machine) small against the op; 1 ms is the gloo link latency measured there."""
    doc = problem_for(4, m).model_dump(mode="json")
    for s in doc["stages"]:
        for name in ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms"):
            s[name] = unit_ms
        s["offload_ms"] = s["reload_ms"] = copy_ms
    doc["p2p_ms"] = p2p_ms
    return Problem.model_validate(doc)


def slowed(problem: Problem, stage: int, factor: float) -> Problem:
    """`problem` with one stage's compute `factor` times slower (emulated hardware, not planned)."""
    doc = problem.model_dump(mode="json")
    s = doc["stages"][stage]
    for name in ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms"):
        s[name] *= factor
    return Problem.model_validate(doc)


def tiny_model():
    """A profiling target for `pipeplan profile`: embedding, 4 MLP blocks, LM head (random init)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 100)

        def forward(self, x):
            return self.proj(x)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(100, 32)

        def forward(self, ids):
            return self.table(ids)

    blocks = [("dense", nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))) for _ in range(4)]
    return [("embedding", Embed())] + blocks + [("lm_head", Head())], torch.randint(0, 100, (4, 16))
