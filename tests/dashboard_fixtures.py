"""Small real plans for the dashboard tests, built with the planner's own simulator (no mocks).

GPipe order (all forwards, then all backwards) is valid for any problem, so it gives plans of any
size, with or without offload, without depending on the baselines module.
"""

from __future__ import annotations

from pipeplan.planner.contract import Device, Options, Plan, Problem, Stage
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import DeviceOrder, Schedule, build_plan, simulate
from pipeplan.planner.validator import assert_valid


def make_problem(devices: int = 4, microbatches: int = 8, offload: bool = False,
                 limit_mib: float | None = 20000.0, static_mib: float = 8000.0) -> Problem:
    stages = [Stage(device=d, forward_ms=1.0, backward_input_ms=1.2, backward_weight_ms=0.8,
                    offload_ms=0.6 if offload else None, activation_mib=512.0, weight_grad_mib=128.0)
              for d in range(devices)]
    return Problem(num_devices=devices, num_microbatches=microbatches, p2p_ms=0.05,
                   options=Options(split_backward=True, offload=offload),
                   stages=stages,
                   devices=[Device(memory_limit_mib=limit_mib, static_mib=static_mib) for _ in range(devices)])


def gpipe_plan(problem: Problem, offload_every: int = 0, one_f_one_b: bool = False) -> Plan:
    """All F in microbatch order, then B and W (or 1F1B order with one stage per device); every
    `offload_every`-th activation offloaded."""
    m = problem.num_microbatches
    devices = []
    for d in range(problem.num_devices):
        order = DeviceOrder()
        if one_f_one_b:
            (k,) = problem.stages_of(d)
            warm = min(problem.num_devices - d - 1, m)
            order.compute += [Op(Kind.F, k, i) for i in range(warm)]
            for i in range(m):
                if warm + i < m:
                    order.compute.append(Op(Kind.F, k, warm + i))
                order.compute += [Op(Kind.B, k, i), Op(Kind.W, k, i)]
        else:
            for k in problem.stages_of(d):
                for i in range(m):
                    order.compute.append(Op(Kind.F, k, i))
            for k in reversed(problem.stages_of(d)):
                for i in range(m):
                    order.compute += [Op(Kind.B, k, i), Op(Kind.W, k, i)]
        if offload_every:
            for k in problem.stages_of(d):
                for i in range(0, m, offload_every):
                    order.d2h.append(Op(Kind.OFFLOAD, k, i))
                    order.h2d.append(Op(Kind.RELOAD, k, i))
        devices.append(order)
    schedule = Schedule(devices)
    plan = build_plan(problem, schedule, simulate(problem, schedule), method="gpipe (test fixture)")
    assert_valid(problem, plan)
    return plan


def op_count(plan: Plan) -> int:
    return sum(len(dp.ops) for dp in plan.devices)


def slow_plan(problem: Problem) -> Plan:
    """A valid but deliberately poor plan (stage 0 runs its forwards in reverse microbatch order, so
    the whole pipeline waits): any solver warm-started from it finds a better one at once."""
    m = problem.num_microbatches
    devices = []
    for d in range(problem.num_devices):
        order = DeviceOrder()
        for k in problem.stages_of(d):
            mbs = range(m - 1, -1, -1) if k == 0 else range(m)
            order.compute += [Op(Kind.F, k, i) for i in mbs]
        for k in reversed(problem.stages_of(d)):
            for i in range(m):
                order.compute += [Op(Kind.B, k, i), Op(Kind.W, k, i)]
        devices.append(order)
    schedule = Schedule(devices)
    plan = build_plan(problem, schedule, simulate(problem, schedule), method="slow seed (test fixture)")
    assert_valid(problem, plan)
    return plan


def dashboard_app(url: str):
    """A FastAPI app with only the dashboard router over a real Repository (schema migrated by the
    service's Alembic scripts): the pages without the API, queue or workers around them."""
    from fastapi import FastAPI
    from pipeplan.service import dashboard
    from pipeplan.service.db import make_engine
    from pipeplan.service.events import Hub
    from pipeplan.service.repository import Repository
    from pipeplan.service.schema import upgrade

    engine = make_engine(url)
    upgrade(engine)
    app = FastAPI()
    app.state.repo = Repository(engine)
    app.state.hub = Hub()
    app.include_router(dashboard.router)
    return app, app.state.repo, engine
