"""A POST's heavy work: spec -> problem, the first plan, revision 1, bounded in time and killable.

The first plan must be out at once at every accepted size, so it is the fastest *cheap* valid plan:
the published schedules that fit (1F1B, ZB-H1, ZB-H2, interleaved, ZB-V: fixed orders, one
simulation each), else the memory-aware greedy seed
within `inline_greedy_s` (its most promising variant first; past that box, its first fitting variant,
waited for until `inline_greedy_max_s`), else the serialized schedule (fits any feasible budget); every slower
heuristic runs in the refine job (planner.solver seeds with all of them).

At a miss whose classic schedules are not at the proven bound, the cache's nearest neighbours (same
structure, other numbers: planner.reuse, docs/reuse.md) lend their best plans: re-timed, resized or
repaired for this problem, and served when faster than the usual first plan. The usual plan is
computed first, exactly as without a cache; the reuse gets what is left of the same box
(`inline_greedy_max_s` from the end of the classic schedules), at most `inline_reuse_s`, so revision
1 takes no longer than the first plan could before. (Run first, the reuse ate the greedy's box on a
loaded machine and revision 1 fell back to the serialized schedule: bench/reuse.py, docs/reuse.md.)

Small problems (at most `inline_thread_max_ops` ops: milliseconds, bounded by size) run in the API's
thread pool. Everything else, and every spec (an "auto" partition is a search), runs in a child
process forked from a preloaded forkserver: it stores revision 1 itself, and the API kills it when
`inline_timeout_s` passes or the client goes away, so no request can keep a core or gigabytes busy
after its client left, and the API process' memory does not grow with big plans.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeplan.planner.bounds import MemoryInfeasibleError, check_memory_feasible
from pipeplan.planner.contract import Limits, Plan, Problem, error_messages
from pipeplan.planner.iteration import meets_bounds
from pipeplan.planner.reuse import Reuse
from pipeplan.planner.validator import InvalidPlanError
from pydantic import ValidationError

from .errors import ApiError, unavailable
from .repository import EPS_MS

log = logging.getLogger("pipeplan.inline")

# ZB-H2 is as cheap as ZB-H1 and, where its memory fits, often optimal (Llama-2-7B on 8 GPUs at
# 80 GB: 2274 ms, the lower bound, against ZB-H1's 2292)
CLASSIC = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v")
REUSE_TRIES = 3  # neighbours tried at a miss (planner.reuse.best_reuse): the nearest few, in one box

Neighbours = Callable[[], list[tuple[Problem, Plan]]]  # the nearest stored (problem, best plan) pairs


@dataclass(frozen=True)
class First:
    """Revision 1, and where it came from when it is a neighbour's plan reused."""

    plan: Plan
    usual: Plan  # the usual first plan (`plan` unless a reuse was faster)
    neighbour: tuple[str, int] | None = None  # the (key, revision) the served plan grew from
    reuse: Reuse | None = None  # what the reuse gave, served or not (None: nothing to reuse)
    reuse_s: float = 0.0  # seconds of the neighbour lookup and the reuse


# -- the first plan ---------------------------------------------------------------------------------
def first_plan(problem: Problem, key: str, greedy_s: float = 0.5, greedy_max_s: float = 3.0) -> Plan:
    """The fastest cheap plan (see the module docstring), not yet validated: its callers store it
    through Repository.store_first, which validates it. Raises MemoryInfeasibleError."""
    return first_choice(problem, key, greedy_s, greedy_max_s).plan


def first_choice(problem: Problem, key: str, greedy_s: float = 0.5, greedy_max_s: float = 3.0,
                 neighbours: Neighbours | None = None, reuse_s: float = 1.5) -> First:
    """The usual first plan or, when faster, a neighbour's plan reused (see the module docstring:
    `neighbours` is called only when the usual plan is not at the proven bound, after it, within
    what is left of the greedy's box). Neither is validated here: a reused plan is checked by
    store_first like any other (`store_revision_one` falls back to the usual plan should it be
    refused)."""
    from pipeplan.planner.baselines import NotApplicable, baseline_outcome
    from pipeplan.planner.baselines.classic import serialized_schedule
    from pipeplan.planner.baselines.common import DoesNotFit, better, evaluate
    from pipeplan.planner.bounds import lower_bound

    check_memory_feasible(problem)
    bound = lower_bound(problem)
    best = None
    for name in CLASSIC:
        try:
            best = better(best, baseline_outcome(problem, name))
        except (NotApplicable, DoesNotFit):
            continue
    deadline = time.monotonic() + max(greedy_s, greedy_max_s)  # the box the greedy has had all along
    if best is None:
        best = _greedy_within(problem, greedy_s, greedy_max_s)
    if best is None:
        best = evaluate(problem, serialized_schedule(problem), "serialized")
    plan = _proven(problem, best.plan(key, validate=False), bound)
    usual, reuse, neighbour, reuse_took = plan, None, None, 0.0
    left = min(reuse_s, deadline - time.monotonic())
    if neighbours is not None and plan.makespan_ms > bound + EPS_MS and left > 0:
        started = time.monotonic()
        reuse, source = _reuse_within(problem, key, neighbours, left)
        reuse_took = time.monotonic() - started
        # ties go to the usual plan: it needs no cache to reproduce
        if reuse is not None and reuse.plan is not None and reuse.plan.makespan_ms < plan.makespan_ms - EPS_MS:
            plan, neighbour = _proven(problem, reuse.plan, bound), source
    return First(plan, usual, neighbour, reuse, reuse_took)


def _proven(problem: Problem, plan: Plan, bound: float) -> Plan:
    """At its proven bounds a plan is optimal now, not as a "better" revision 2: the makespan's, and
    the iteration's it implies (planner.iteration: the solvers rank the iteration second)."""
    return plan.model_copy(update={"status": "optimal"}) if meets_bounds(problem, plan, bound, EPS_MS) else plan


def _reuse_within(problem: Problem, key: str, neighbours: Neighbours,
                  box_s: float) -> tuple[Reuse | None, tuple[str, int] | None]:
    """The fastest reuse of the nearest neighbours' plans (planner.reuse.best_reuse) within `box_s`
    from now, lookup included (a repair past the box stops at its next round), and the (key,
    revision) of the plan it grew from. (None, None): no neighbour, or the reuse failed (only an
    offer: the usual first plan follows)."""
    from pipeplan.planner.reuse import best_reuse

    deadline = time.monotonic() + box_s
    try:
        candidates = neighbours()
        got = best_reuse(problem, candidates, key, tries=REUSE_TRIES,
                         time_limit_s=max(0.0, deadline - time.monotonic()), validate=False)
    except Exception as exc:  # noqa: BLE001 - a reuse is an offer; revision 1 does not depend on it
        log.warning("reusing a neighbour's plan for %s failed: %s", key[:12], exc)
        return None, None
    if got is None:
        return None, None
    revision = next(plan.revision for _, plan in candidates if plan.problem_key == got.neighbour_key)
    return got, (got.neighbour_key, revision)


def store_revision_one(repo, problem: Problem, key: str, budget_s: float, owner: str | None,
                       greedy_s: float, greedy_max_s: float, reuse_s: float) -> tuple[bool, bool]:
    """Plan revision 1 (reusing the stored neighbours' plans) and store it. Returns (created, reused).
    A reused plan the repository refuses (a planner bug: every path validates by construction) is
    logged and the usual first plan stored instead."""
    first = first_choice(problem, key, greedy_s, greedy_max_s, lambda: repo.neighbours(problem, key, REUSE_TRIES),
                         reuse_s)
    if first.reuse is not None:
        r = first.reuse
        log.info("reuse for %s: %s in %.2f s (%s)%s", key[:12], r.how or "-", first.reuse_s,
                 "served" if first.neighbour else "not served", f": {r.reason}" if r.reason else "")
    try:
        _, created, _ = repo.store_first(problem, first.plan, budget_s, key=key, owner=owner,
                                         neighbour=first.neighbour)
        return created, created and first.neighbour is not None
    except InvalidPlanError as exc:
        if first.neighbour is None:
            raise
        log.error("the reused plan of %s was refused (%s); storing the usual first plan", key[:12], exc)
    _, created, _ = repo.store_first(problem, first.usual, budget_s, key=key, owner=owner)
    return created, False


def _top_variant(problem: Problem):
    """The greedy's most promising engine variant alone (greedy_tries' first; one engine run,
    0.15-0.4 s at P=32, M=128), evaluated and validated; None when it does not fit. Run before
    greedy_outcome, which first re-times its unit-cost patterns (as long again, and they rarely fit
    when no classic schedule does), so that a memory-aware plan is out in one engine run."""
    from pipeplan.planner.baselines.greedy import greedy_tries, run_try, treatments

    return run_try(problem, greedy_tries(problem, treatments(problem, pattern_fits=False))[0])


def _greedy_within(problem: Problem, soft_s: float, hard_s: float):
    """A memory-aware greedy plan: the top variant at once, then greedy_outcome's variants until
    `soft_s` (it stops between variants); past `soft_s`, whatever is found first is taken, waited for
    until `hard_s` (then None: the serialized schedule follows). Before, greedy had only `soft_s` (0.5 s)
    and a loaded machine turned revision 1 of P=32, M=128 into the serialized schedule, ~9x slower.

    The work runs in a daemon thread left behind when late (greedy_outcome goes on until one variant
    fits, minutes on the largest problems). Callers in a child process exit right after; in the API's
    threads only small problems get here (bounded by size)."""
    from pipeplan.planner.baselines.common import better
    from pipeplan.planner.baselines.greedy import greedy_outcome

    if hard_s <= 0:
        return None
    start = time.monotonic()
    soft_deadline = start + soft_s
    box: dict[str, Any] = {}
    found = threading.Event()  # set when a plan is in the box or the thread is over
    finished = threading.Event()

    def run() -> None:
        try:
            box["top"] = _top_variant(problem)
            took = time.monotonic() - start
            if box["top"] is not None:
                found.set()
            # greedy_outcome re-times its patterns, then runs variants: about twice the top variant's
            # time before it can improve on it. Not started when that would outlast the soft box (it
            # would only hold the GIL while the caller stores revision 1).
            if box["top"] is None or soft_deadline - time.monotonic() > 2 * took:
                box["greedy"] = greedy_outcome(problem, inline=True,
                                               keep_going=lambda: time.monotonic() < soft_deadline)
        except Exception as exc:  # noqa: BLE001 - only a seed; serialized follows
            log.debug("inline greedy gave no plan: %s", exc)
        finally:
            finished.set()
            found.set()

    threading.Thread(target=run, name="inline-greedy", daemon=True).start()
    finished.wait(max(0.0, soft_deadline - time.monotonic()))
    if not found.is_set():
        found.wait(max(0.0, start + max(hard_s, soft_s) - time.monotonic()))
    return better(box.get("top"), box.get("greedy"))


# -- spec -> problem ----------------------------------------------------------------------------------
def spec_memo(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_spec(spec: dict[str, Any], limits: Limits) -> None:
    """Sizes of a raw spec, before anything is built (microseconds)."""
    from pipeplan.planner.spec import check_spec_size

    try:
        check_spec_size(spec, limits)
    except ValueError as exc:
        raise ApiError(422, "too_large", f"spec.{exc}", {"detail": [f"spec.{exc}"]}) from None


def problem_from_spec(spec: dict[str, Any], limits: Limits) -> Problem:
    """The spec's problem; 422 naming the field on any invalid or oversized input."""
    from pipeplan.planner.documents import problem_from_document

    try:
        problem = problem_from_document(spec, limits)  # "partition": "auto" goes through planner.adaptive
    except ImportError as exc:
        raise ApiError(422, "invalid_request",
                       f"spec.partition: {spec.get('partition')!r} needs {exc.name or 'a module'}, which is"
                       " not installed") from None
    except (ApiError, MemoryInfeasibleError):
        raise
    except ValidationError as exc:
        lines = [f"spec.{line}" for line in error_messages(exc)]
        raise ApiError(422, "invalid_request", "; ".join(lines), {"detail": lines}) from None
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise ApiError(422, "invalid_request", f"spec: {exc}", {"detail": [f"spec: {exc}"]}) from None
    check_problem(problem, limits)
    return problem


def check_problem(problem: Problem, limits: Limits) -> None:
    try:
        problem.check_limits(limits)
    except ValueError as exc:
        raise ApiError(422, "too_large", f"problem.{exc}") from None


def infeasible(exc: MemoryInfeasibleError) -> ApiError:
    return ApiError(422, "infeasible", str(exc), exc.to_dict())


def ops_of(problem: Problem) -> int:
    return 4 * problem.num_stages * problem.num_microbatches


# -- the child process --------------------------------------------------------------------------------
def revision_one(job: dict[str, Any]) -> dict[str, Any]:
    """Convert (spec) or parse (problem), plan (reusing the cache's neighbours), store revision 1.
    Runs in the child; returns {"key", "created", "reused"} or {"error": {...}} (exceptions do not
    cross the pipe well)."""
    from pipeplan.service.db import make_engine
    from pipeplan.service.repository import Repository

    try:
        limits = Limits(**job["limits"])
        if "spec" in job:
            problem = problem_from_spec(job["spec"], limits)
        else:
            problem = Problem.model_validate_json(job["problem"])
        key = problem.key()
        engine = make_engine(job["database_url"], 1)
        try:
            repo = Repository(engine)
            created = reused = False
            if repo.best_revision(key) is None:
                created, reused = store_revision_one(
                    repo, problem, key, job["budget_s"], job.get("owner"), job["greedy_s"],
                    job.get("greedy_max_s", 3.0), job.get("reuse_s", 0.0))
        finally:
            engine.dispose()
        return {"key": key, "created": created, "reused": reused}
    except (ApiError, MemoryInfeasibleError) as exc:
        err = infeasible(exc) if isinstance(exc, MemoryInfeasibleError) else exc
        return {"error": {"status": err.status_code, "code": err.code, "message": err.detail, "extra": err.extra}}


def _child_main(conn, job: dict[str, Any], entry=None) -> None:
    # A short-lived process building up to hundreds of thousands of small objects: the cyclic
    # collector would re-scan them all, again and again (40% of a 400,000-op first plan); what the
    # child allocates is returned when it exits.
    gc.disable()
    try:
        result = (entry or revision_one)(job)
    except Exception as exc:  # noqa: BLE001 - reported to the API, which answers 503 and logs once
        result = {"crash": f"{type(exc).__name__}: {exc}"}
    conn.send(result)
    conn.close()


_CTX_LOCK = threading.Lock()
_CTX: Any = None


def _context():
    """The forkserver context, its server preloaded with the planner (a child starts in ~10 ms)."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["pipeplan.service.inline", "pipeplan.planner.baselines", "pipeplan.planner.documents",
                                        "pipeplan.service.repository", "pipeplan.service.db", "pipeplan.service.exports_cache",
                                        "pipeplan.planner.exports"])
            _CTX = ctx
        return _CTX


def warm_up() -> None:
    """Start the forkserver now (about a second of imports) rather than on the first big POST.

    Best effort, in a daemon thread: when the server stops during those imports the forkserver's
    pipe closes under it (EOFError / OSError), which must not print a traceback at shutdown."""
    try:
        proc = _context().Process(target=_noop, daemon=True)
        proc.start()
        proc.join(30)
    except (EOFError, OSError) as exc:
        log.debug("forkserver warm-up stopped: %s", exc)


def _noop() -> None:
    return None


class Gone(Exception):
    """The client disconnected while its first plan was computed; the child was killed."""


async def run_in_child(job: dict[str, Any], timeout_s: float, is_disconnected, retry_after_s: float,
                       entry=None, what: str = "the first plan") -> dict:
    """Run `entry(job)` (default revision_one; a module-level function, it is pickled by name) in a
    fresh child; kill it at `timeout_s` or when the client leaves (`is_disconnected`; None for work
    that outlives its first requester, such as a cached export)."""
    from starlette.concurrency import run_in_threadpool

    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(child, job, entry), daemon=True)
    await run_in_threadpool(proc.start)
    child.close()
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(parent.fileno(), lambda: ready.done() or ready.set_result(None))
    deadline = time.monotonic() + timeout_s
    try:
        while not ready.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise unavailable(f"{what} took longer than {timeout_s:g} s and was stopped; POST"
                                  " a smaller problem, or retry later" if entry is None else
                                  f"{what} took longer than {timeout_s:g} s and was stopped; retry later",
                                  retry_after_s)
            await asyncio.wait({ready}, timeout=min(0.25, left))
            if not ready.done() and is_disconnected is not None and await is_disconnected():
                raise Gone()
        try:
            result = parent.recv()
        except EOFError:
            result = {"crash": f"the planning process exited with code {proc.exitcode}"}
    finally:
        loop.remove_reader(parent.fileno())
        parent.close()
        if proc.is_alive():
            proc.kill()
        await run_in_threadpool(proc.join, 5)
    if "crash" in result:
        log.error("%s failed: %s", what, result["crash"])
        raise unavailable(f"{what} could not be computed; retry later", retry_after_s)
    if "error" in result:
        e = result["error"]
        raise ApiError(e["status"], e["code"], e["message"], e["extra"])
    return result
