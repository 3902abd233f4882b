"""Train a small transformer with pipeline parallelism on a pipeplan plan, swapping to better plans.

    python examples/train_pipeline.py                              # embedded solver, 4 CPU ranks (gloo)
    python examples/train_pipeline.py --url http://127.0.0.1:8000  # plans from a running `pipeplan serve`
    python examples/train_pipeline.py --tight-memory               # limits that force offload/recompute

What it does: builds the problem of a small transformer with pipeplan's cost model (its
`metadata["partition"]` says which layers each stage holds), gets a plan (from the service, or from
the embedded heuristics + solver when no URL is given), runs it on `--devices` gloo processes with
torch.distributed.pipelining (schedule loaded through torch's own CSV loader; planned offload and
recompute executed), swaps to an improved revision at an iteration boundary when one arrives
(`--swap-at` waits for one, to show it), and checks each step's gradients against a single-process
run of the same weights (float64, tolerance 1e-6). Exit status 0 means every check passed.
Under torchrun (RANK/WORLD_SIZE set) it runs as one rank instead of spawning.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipeplan.client import OnlinePlan, PlanClient
from pipeplan.client.torch_runtime import agree_on_plan, build_schedule
from pipeplan.planner.contract import Plan, Problem
from torch import nn
from torch.distributed.pipelining import PipelineStage

HARDWARE = {"name": "cpu", "peak_tflops": 0.01, "mfu": 0.5, "hbm_gib": 1.0, "hbm_gbps": 10,
            "host_link_gbps": 1, "link_gbps": 2}


# -- the problem ------------------------------------------------------------------------------------
def build_problem(args) -> Problem:
    """The cost model's problem for the model below; --tight-memory lowers every device's limit."""
    from pipeplan.planner.documents import problem_from_document

    spec = {"model": {"name": "tiny-gpt", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                      "vocab": args.vocab, "seq_len": args.seq, "micro_batch_size": args.mbs, "dtype": "fp32",
                      "gated_mlp": False},
            "hardware": HARDWARE,
            "training": {"devices": args.devices, "microbatches": args.microbatches,
                         "placement": args.placement, "offload": args.tight_memory,
                         "recompute": args.tight_memory}}
    problem = problem_from_document(spec)
    if not args.tight_memory:
        return problem
    from pipeplan.planner.baselines import run_baseline
    from pipeplan.planner.bounds import min_memory

    # halfway between the least memory any schedule needs and what plain 1F1B uses
    peak = run_baseline(problem, "1f1b").peak_memory_mib
    floor = min_memory(problem)
    doc = problem.model_dump(mode="json")
    for d, device in enumerate(doc["devices"]):
        device["memory_limit_mib"] = round(floor[d] + 0.4 * (peak[d] - floor[d]), 6)
    return Problem.model_validate(doc)


# -- the model: embedding, pre-norm blocks, LM head; one entry of metadata["layers"] each -------------
class Embedding(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.hidden)
        self.pos = nn.Parameter(torch.randn(a.seq, a.hidden) * 0.02)

    def forward(self, ids):
        return self.tok(ids) + self.pos


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads = a.heads
        self.norm1, self.norm2 = nn.LayerNorm(a.hidden), nn.LayerNorm(a.hidden)
        self.qkv, self.out = nn.Linear(a.hidden, 3 * a.hidden), nn.Linear(a.hidden, a.hidden)
        self.up, self.down = nn.Linear(a.hidden, 4 * a.hidden), nn.Linear(4 * a.hidden, a.hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(a.hidden), nn.Linear(a.hidden, a.vocab)

    def forward(self, x):
        return self.proj(self.norm(x))


LAYER = {"embedding": Embedding, "dense": Block, "lm_head": Head}


def make_stages(problem: Problem, a) -> list[nn.Sequential]:
    """One nn.Sequential per pipeline stage, cut at the problem's partition (same init everywhere)."""
    torch.manual_seed(0)
    types = problem.metadata.get("layers") or ["embedding"] + ["dense"] * a.layers + ["lm_head"]
    layers = [LAYER[t](a) for t in types]
    ranges = problem.metadata.get("partition")
    if not ranges:  # no partition recorded: even split
        n, s = len(layers), problem.num_stages
        cuts = [round(i * n / s) for i in range(s + 1)]
        ranges = list(itertools.pairwise(cuts))
    return [nn.Sequential(*layers[lo:hi]) for lo, hi in ranges]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(a, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, a.vocab, (a.microbatches * a.mbs, a.seq), generator=g)
    target = torch.randint(0, a.vocab, (a.microbatches * a.mbs, a.seq), generator=g)
    return ids, target


def reference_grads(problem: Problem, a, weights: list[dict], step: int) -> list[list[torch.Tensor]]:
    """The same weights on one process, no pipeline: mean of the per-microbatch losses."""
    stages = make_stages(problem, a)
    for stage, state in zip(stages, weights):
        stage.load_state_dict(state)
    model = nn.Sequential(*stages)
    ids, target = batch(a, step)
    total = sum(loss_fn(model(x), y) for x, y in zip(ids.chunk(a.microbatches), target.chunk(a.microbatches)))
    (total / a.microbatches).backward()
    return [[p.grad for p in stage.parameters()] for stage in stages]


# -- where plans come from ----------------------------------------------------------------------------
def plan_source(problem: Problem, a) -> tuple[OnlinePlan, threading.Event, threading.Thread | None]:
    """The service's OnlinePlan, or an embedded one fed by the solver in a background thread."""
    stop = threading.Event()
    store = a.cache_dir or tempfile.mkdtemp(prefix="pipeplan-plans-")
    if a.url:
        return OnlinePlan(PlanClient(a.url), problem, time_budget_s=a.time_budget, store=store,
                          poll_interval_s=0.5), stop, None
    from pipeplan.planner.baselines import best_heuristic, run_baseline
    from pipeplan.planner.solver import solve

    def first_plan(p: Problem) -> Plan:
        try:  # start from plain 1F1B so the solver has something to improve on
            return run_baseline(p, "1f1b")
        except Exception:
            return best_heuristic(p)

    online = OnlinePlan(None, problem, store=store, fallback=first_plan, start=False)
    revision = [online.current().revision]

    def improved(plan: Plan) -> None:
        """A new revision only for a shorter plan, or the same length newly proven optimal."""
        held = online.latest()
        better = plan.makespan_ms < held.makespan_ms - 1e-9
        proven = (plan.status == "optimal" and held.status != "optimal"
                  and plan.makespan_ms <= held.makespan_ms + 1e-9)
        if better or proven:
            revision[0] += 1
            online.offer(plan.model_copy(update={"revision": revision[0]}))

    def run() -> None:
        try:
            result = solve(problem, a.time_budget, on_improvement=improved, stop=stop, hint=online.current(),
                           workers=1)
            improved(result.plan)  # the final answer may add a proof of optimality
        except Exception as exc:  # the training keeps its plan
            print(f"[rank 0] embedded solver stopped: {exc}", file=sys.stderr)

    solver = threading.Thread(target=run, name="embedded-solver", daemon=True)
    solver.start()
    return online, stop, solver


# -- one rank ---------------------------------------------------------------------------------------
def run_rank(rank: int, world: int, a) -> dict | None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    problem = build_problem(a)
    if problem.num_devices != world:
        raise SystemExit(f"the problem has {problem.num_devices} devices but {world} ranks run")
    source, stop, solver = plan_source(problem, a) if rank == 0 else (None, None, None)
    plan = agree_on_plan(source.current() if source else None)
    stages = make_stages(problem, a)
    mine = problem.stages_of(rank)
    pipe = [PipelineStage(stages[k], k, problem.num_stages, torch.device("cpu")) for k in mine]
    planned = build_schedule(problem, plan, pipe, loss_fn=loss_fn)
    optimizer = torch.optim.SGD([p for k in mine for p in stages[k].parameters()], lr=a.lr)
    first, last = problem.stages[0].device, problem.stages[-1].device
    steps = []
    try:
        for step in range(a.steps):
            candidate = None
            if source is not None and step >= 1:  # step 0 runs the first plan; later boundaries may swap
                if step == a.swap_at and a.swap_wait > 0 and not any(s["swapped"] for s in steps):
                    source.wait_newer(planned.plan.revision, timeout=a.swap_wait)  # demo: let one land
                candidate = source.poll_swap()
            new = agree_on_plan(candidate)  # every rank swaps at the same boundary, or none does
            if new is not None:
                planned.swap(new)
            weights = [{n: t.detach().clone() for n, t in stages[k].state_dict().items()} for k in mine]
            for k in mine:
                stages[k].zero_grad(set_to_none=True)
            planned.executor.stats.reset()
            ids, target = batch(a, step)
            losses: list = []
            inputs = (ids,) if rank == first else ()
            started = time.perf_counter()
            if rank == last:
                planned.step(*inputs, target=target, losses=losses)
            else:
                planned.step(*inputs)
            elapsed = time.perf_counter() - started
            grads = {k: [p.grad.detach().clone() for p in stages[k].parameters()] for k in mine}
            stats = planned.executor.stats
            mine_report = {"weights": {k: weights[i] for i, k in enumerate(mine)}, "grads": grads,
                           "loss": float(torch.stack([x.detach() for x in losses]).mean()) if losses else None,
                           "offloaded": sorted(stats.offloaded_bytes), "recomputed": sorted(stats.recomputes),
                           "late": list(stats.late), "seconds": elapsed}
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(mine_report, gathered, dst=0)
            optimizer.step()
            if rank == 0:
                steps.append(check_step(problem, a, step, planned.plan, gathered, new is not None))
    finally:
        if stop is not None:
            stop.set()  # the solver honours it within a second; never exit under a running solver
            if solver is not None:
                solver.join(30)
            source.close()
    return {"steps": steps, "problem_key": problem.key()} if rank == 0 else None


def check_step(problem: Problem, a, step: int, plan: Plan, gathered: list[dict], swapped: bool) -> dict:
    weights = [None] * problem.num_stages
    grads = [None] * problem.num_stages
    for report in gathered:
        for k, w in report["weights"].items():
            weights[k] = w
        for k, g in report["grads"].items():
            grads[k] = g
    reference = reference_grads(problem, a, weights, step)
    diff = max((g - r).abs().max().item() for k in range(problem.num_stages)
               for g, r in zip(grads[k], reference[k]))
    loss = next(r["loss"] for r in gathered if r["loss"] is not None)
    row = {"step": step, "revision": plan.revision, "method": plan.method, "makespan_ms": plan.makespan_ms,
           "swapped": swapped, "loss": loss, "max_grad_diff": diff,
           "offloaded": sorted(tuple(x) for r in gathered for x in r["offloaded"]),
           "recomputed": sorted(tuple(x) for r in gathered for x in r["recomputed"]),
           "late": [x for r in gathered for x in r["late"]],
           "seconds": max(r["seconds"] for r in gathered)}
    print(f"step {step}: loss {loss:.4f} · plan r{plan.revision} {plan.method} ({plan.makespan_ms:.2f} ms"
          f" planned){' · swapped' if swapped else ''} · offloaded {len(row['offloaded'])}, recomputed"
          f" {len(row['recomputed'])} (stage, mb) pairs · max |grad - reference| {diff:.2e}", flush=True)
    return row


def _spawned(rank: int, world: int, port: int, a) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run_rank(rank, world, a)
        if result is not None and a.report:
            Path(a.report).write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="plan service URL (default: embedded heuristics + solver)")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--placement", choices=["loop", "v"], default="loop")
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks (plus embedding and head)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=2, help="samples per microbatch")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--tight-memory", action="store_true", help="memory limits that need offload/recompute")
    ap.add_argument("--time-budget", type=float, default=3.0, help="refinement budget, seconds")
    ap.add_argument("--swap-at", type=int, default=2, help="step at which to wait for an improved plan")
    ap.add_argument("--swap-wait", type=float, default=30.0, help="how long to wait there (0: never wait)")
    ap.add_argument("--cache-dir", help="where OnlinePlan keeps its on-disk plan copies")
    ap.add_argument("--report", help="write the per-step report (JSON) here")
    ap.add_argument("--tolerance", type=float, default=1e-6)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        result = run_rank(dist.get_rank(), dist.get_world_size(), a)
        dist.destroy_process_group()
        if result is None:
            return 0
    else:
        import torch.multiprocessing as mp

        report = a.report or tempfile.mktemp(suffix=".json")
        a.report = report
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, nprocs=a.devices, args=(a.devices, port, a), join=True)
        result = json.loads(Path(report).read_text())
    worst = max(s["max_grad_diff"] for s in result["steps"])
    swaps = [s["step"] for s in result["steps"] if s["swapped"]]
    late = [x for s in result["steps"] for x in s["late"]]
    print(f"{len(result['steps'])} steps · swaps at steps {swaps or 'none'} · worst gradient difference"
          f" {worst:.2e} (tolerance {a.tolerance:g}) · late memory ops: {len(late)}")
    return 0 if worst <= a.tolerance and not late else 1


if __name__ == "__main__":
    sys.exit(main())
