"""The refine job: claim the run in SQL, solve warm-started from the best stored plan, store and
publish every better revision, heartbeat, honour cancel, finish with how the search ended.

A run that ends on its own is "done" with the solver's outcome (optimal / budget / stalled) and the
best plan's gap; a cancelled one keeps its outcome ("stopped") too. Nothing is called converged.

The same `run_job` runs inside RQ work horses (`rq_refine`) and inside the embedded thread pool.
Ownership is decided in SQL: a run that cannot claim its row, or whose heartbeat finds the row taken
over, stops without writing; stored revisions are never lost because each is committed on arrival.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from pipeplan.planner.bounds import MemoryInfeasibleError
from pipeplan.planner.contract import Plan
from pipeplan.planner.validator import InvalidPlanError
from pipeplan.service.events import Publisher, job_message, revision_message
from pipeplan.service.models import CANCELLED, DONE, FAILED, SOLVING
from pipeplan.service.outcomes import OPTIMAL
from pipeplan.service.repository import EPS_MS, Repository

from pipeplan.settings import Settings, get_settings

log = logging.getLogger("pipeplan.worker")


@dataclass
class WorkerContext:
    repo: Repository
    publisher: Publisher
    settings: Settings
    name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    shutdown: threading.Event = field(default_factory=threading.Event)


def run_job(ctx: WorkerContext, key: str, run_id: str) -> str:
    """Run one queued refine run to its end. Returns the final state (or 'skipped' / 'lost')."""
    repo, settings = ctx.repo, ctx.settings
    job = repo.claim(key, run_id, f"{ctx.name}/pid={os.getpid()}/{threading.current_thread().name}")
    if job is None:
        return "skipped"
    ctx.publisher.publish(key, job_message(key, SOLVING))
    problem = repo.get_problem(key)
    hint = repo.best_plan(key)
    remaining = job.budget_s - job.used_s
    if job.used_s > 0:  # a re-run after a crash or shutdown: finish the budget, but do something
        remaining = max(remaining, min(settings.min_rerun_budget_s, job.budget_s))
    stop = threading.Event()
    reason: dict[str, str] = {}
    improved = 0  # shorter plans this run stored: "no better plan found" is said only when none
    best_ms = hint.makespan_ms if hint is not None else math.inf
    started = time.monotonic()

    def on_improvement(plan: Plan) -> None:
        nonlocal improved, best_ms
        try:
            revision = repo.store_if_better(key, plan, problem)
        except InvalidPlanError as exc:
            log.error("solver reported an invalid plan for %s: %s", key[:12], exc)
            return
        except Exception as exc:  # the DB blinked: keep solving; the final plan is stored again at the end
            log.warning("could not store an improvement for %s: %s", key[:12], exc)
            return
        if revision is not None:
            if plan.makespan_ms < best_ms - EPS_MS:  # a proof of the same makespan improves nothing
                improved += 1
            best_ms = min(best_ms, plan.makespan_ms)
            ctx.publisher.publish(key, revision_message(key, revision))

    def heartbeat() -> None:
        while not stop.wait(settings.heartbeat_s):
            if ctx.shutdown.is_set():
                reason["why"] = "shutdown"
                stop.set()
                return
            try:
                cancel = repo.heartbeat(key, run_id, job.used_s + time.monotonic() - started)
            except Exception as exc:
                log.warning("heartbeat for %s failed: %s", key[:12], exc)
                continue
            if cancel is None:
                reason["why"] = "lost"
                stop.set()
            elif cancel:
                reason["why"] = "cancel"
                stop.set()

    beat = threading.Thread(target=heartbeat, name=f"heartbeat-{key[:8]}", daemon=True)
    beat.start()
    state, error, result = DONE, None, None
    try:
        from pipeplan.planner.solver import solve

        result = solve(problem, time_limit_s=max(0.1, remaining), on_improvement=on_improvement, stop=stop,
                       hint=hint, workers=settings.solver_workers, problem_key=key)
        on_improvement(result.plan)  # e.g. the incumbent just proven optimal
    except MemoryInfeasibleError as exc:
        state, error = FAILED, f"infeasible: {exc}"
    except Exception as exc:
        log.exception("refine of %s failed", key[:12])
        state, error = FAILED, f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        beat.join(timeout=5)
    why = reason.get("why")
    if why == "lost":
        return "lost"
    used = job.used_s + time.monotonic() - started
    if why == "shutdown":
        repo.release(key, run_id, used)
        return "released"
    if why == "cancel":
        state = CANCELLED
    repo.heartbeat(key, run_id, used)
    ended = {} if result is None else {  # a proof means gap 0, not the float noise of makespan - bound
        "outcome": result.outcome, "gap_pct": 0.0 if result.outcome == OPTIMAL else 100.0 * result.gap,
        "searched_s": job.used_s + result.elapsed_s, "run_improvements": improved}
    best = None if result is None else result.plan  # the bound its gap is against (Plan.gap)
    bound = None if best is None else (best.makespan_ms if result.outcome == OPTIMAL else
                                       max(best.lower_bound_ms, best.solver_bound_ms or 0.0))
    if repo.finish(key, run_id, state, error, bound_ms=bound, **ended):
        ctx.publisher.publish(key, job_message(key, state, **ended))
    if improved:
        offer_to_frontiers(ctx, key)
    return state


def offer_to_frontiers(ctx: WorkerContext, key: str) -> None:
    """A frontier point's better plan fits every larger budget of its frontier: offer it there."""
    try:
        from pipeplan.service.frontier_store import FrontierStore

        FrontierStore(ctx.repo).propagate(
            key, lambda other, revision: ctx.publisher.publish(other, revision_message(other, revision)))
    except Exception as exc:  # noqa: BLE001 - the point's own plan is stored; this only helps others
        log.warning("offering %s to its frontiers failed: %s", key[:12], exc)


# -- RQ entry point: one context per process (the work horse is a fork of the worker) -----------------
_CONTEXT: WorkerContext | None = None
_CONTEXT_PID: int | None = None


def make_context(settings: Settings) -> WorkerContext:
    from pipeplan.service.db import ForkSafeEngine
    from pipeplan.service.events import RedisPublisher

    engine = ForkSafeEngine(settings.resolved_database_url, pool_size=2)
    if not settings.redis_url:
        raise RuntimeError("PIPEPLAN_REDIS_URL is not set: `pipeplan worker` consumes the Redis queue")
    return WorkerContext(Repository(engine.get), RedisPublisher(settings.redis_url, settings.events_channel),
                         settings)


def configure(settings: Settings) -> WorkerContext:
    global _CONTEXT, _CONTEXT_PID
    _CONTEXT, _CONTEXT_PID = make_context(settings), os.getpid()
    return _CONTEXT


def rq_refine(key: str, run_id: str) -> str:
    global _CONTEXT, _CONTEXT_PID
    if _CONTEXT is None:
        configure(get_settings())
    elif _CONTEXT_PID != os.getpid():  # forked horse: fresh publisher socket, fresh name
        _CONTEXT = WorkerContext(_CONTEXT.repo, type(_CONTEXT.publisher)(
            _CONTEXT.settings.redis_url, _CONTEXT.settings.events_channel), _CONTEXT.settings,
            name=_CONTEXT.name)
        _CONTEXT_PID = os.getpid()
    return run_job(_CONTEXT, key, run_id)
