"""`OnlinePlan`: train on the current plan while the service finds better ones.

A background thread follows the key; the training loop calls `current()` (never blocks, never touches
the network) and, at an iteration boundary, `poll_swap()` to adopt a newer plan if one arrived. After a
measured iteration is posted (`post_trace`), it follows the problem calibrated to that run instead:
its plan is offered as the better plan (`current_problem()` names the problem it is for). The
service may come and go: the last plan is kept, the thread retries with backoff, and every plan is also
written to disk so that a restarted job starts from its last plan even when the service is down.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.validator import validate_plan

from .api import PlanClient, TracePosted
from .errors import PlanClientError, PlanNotFound, PlanRequestError, ServiceUnavailable

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """$PIPEPLAN_CLIENT_CACHE_DIR, else $XDG_CACHE_HOME/pipeplan/plans, else ~/.cache/pipeplan/plans."""
    if env := os.environ.get("PIPEPLAN_CLIENT_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipeplan" / "plans"


class PlanStore:
    """One JSON file per key holding the newest plan seen; written atomically (tmp + rename)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.plan.json"

    def load(self, key: str) -> Plan | None:
        try:
            return Plan.model_validate_json(self.path(key).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable cached plan %s: %s", self.path(key), exc)
            return None

    def save(self, plan: Plan) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(plan.model_dump_json())
            os.replace(tmp, self.path(plan.problem_key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class OnlinePlan:
    """Follows one problem's plans in the background; swaps only when the caller asks.

    problem_or_spec: a Problem (its key is computed locally, so a job can start from its disk copy
    with no service at all), a problem v1 dict or a model spec dict (the service computes the key).
    fallback: called with the Problem when neither the service nor the disk has a plan (e.g.
    `planner.baselines.best_heuristic`); without one, the constructor raises ServiceUnavailable.
    """

    def __init__(self, client: PlanClient | None, problem_or_spec: Any, *,
                 time_budget_s: float | None = None, store: PlanStore | str | os.PathLike | None = None,
                 fallback: Callable[[Problem], Plan] | None = None, start: bool = True,
                 poll_interval_s: float = 1.0, retry_s: float = 1.0):
        self.client = client
        self.time_budget_s = time_budget_s
        self.store = store if isinstance(store, PlanStore) else PlanStore(store)
        self.poll_interval_s = poll_interval_s
        self.retry_s = retry_s
        self.problem: Problem | None = None
        if isinstance(problem_or_spec, Problem):
            self.problem = problem_or_spec
        elif isinstance(problem_or_spec, dict) and (
                problem_or_spec.get("format") == "pipeplan.problem/v1" or "stages" in problem_or_spec):
            self.problem = Problem.model_validate(problem_or_spec)
        self._request = problem_or_spec
        self.key: str | None = self.problem.key() if self.problem is not None else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._current: Plan | None = None
        self._newest: Plan | None = None
        self._submitted = False
        self.swaps = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()  # ends the current follow (close, or a switch to a calibrated key)
        self._problems: dict[str, Problem] = {}  # problem of each key followed so far
        if self.problem is not None:
            self._problems[self.key] = self.problem

        if self.key is not None:
            self.offer(self.store.load(self.key), persist=False)
        try:
            self._submit()
        except ServiceUnavailable as exc:
            self.last_error = str(exc)
            log.warning("plan service unavailable at start (%s); using the %s plan", exc,
                        "cached" if self._newest else "fallback")
        if self._newest is None:
            if fallback is None or self.problem is None:
                raise ServiceUnavailable(
                    "no plan: the service is unavailable, nothing is cached on disk"
                    f" ({self.store.directory}) and no fallback was given" + (
                        "" if self.problem is not None else " (a model spec needs the service for its key)"))
            self.offer(fallback(self.problem), persist=False)
        with self._lock:
            self._current = self._newest
        if start and self.client is not None:
            self.start()

    # -- what the training loop calls -----------------------------------------------------------------
    def current(self) -> Plan:
        """The plan in use now (never blocks on the network)."""
        with self._lock:
            return self._current  # type: ignore[return-value]

    def latest(self) -> Plan:
        """The newest plan received, which may not be in use yet."""
        with self._lock:
            return self._newest  # type: ignore[return-value]

    def poll_swap(self) -> Plan | None:
        """At an iteration boundary: adopt and return a newer plan if one arrived, else None.

        After `post_trace`, the newer plan may be of the calibrated problem (another key): run it
        with `schedule.swap(plan, problem=online.current_problem())`, which also serves a plan of
        the same problem.
        """
        with self._lock:
            if self._newest is None or self._newest is self._current:
                return None
            if self._current is not None and self._newest.problem_key == self._current.problem_key \
                    and self._newest.revision <= self._current.revision:
                return None
            self._current = self._newest
            self.swaps += 1
            return self._current

    def current_problem(self) -> Problem | None:
        """The problem the current plan is for (the calibrated one after a switch); None if unknown."""
        with self._lock:
            key = self._current.problem_key if self._current is not None else self.key
            return self._problems.get(key)

    def post_trace(self, trace: Any, time_budget_s: float | None = None) -> TracePosted:
        """Post a measured iteration of the current plan and follow the problem calibrated to it.

        The calibrated problem's first plan becomes the newest plan at once (`poll_swap()` returns
        it); its refine job's improvements follow as usual. Raises PlanClientError when the service
        refuses the trace (e.g. not a run of a stored revision) or is unavailable.
        """
        if self.client is None:
            raise PlanClientError("post_trace needs a PlanClient")
        key = trace.problem_key if hasattr(trace, "problem_key") else trace["problem_key"]
        posted = self.client.post_trace(key, trace, time_budget_s)
        self.follow_key(posted.calibrated_key)
        return posted

    def follow_key(self, key: str, problem: Problem | None = None) -> None:
        """Follow another key from now on (e.g. a calibrated problem posted by another process): its
        best plan is offered as the newest, and the follower thread switches to its improvements."""
        assert self.client is not None
        problem = problem or self.client.problem(key)
        plan = self.client.get(key)
        with self._lock:
            self._problems[key] = problem
            self.key, self.problem, self._request = key, problem, problem
            self._submitted = True
        self.offer(plan)
        self._halt.set()  # the follower restarts on the new key

    def wait_newer(self, revision: int, timeout: float) -> Plan | None:
        """Block until a plan newer than `revision` has arrived (not swapped in); for tests/tools."""
        with self._changed:
            self._changed.wait_for(lambda: self._newest is not None and self._newest.revision > revision,
                                   timeout=timeout)
            newest = self._newest
        return newest if newest is not None and newest.revision > revision else None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"pipeplan-follow-{(self.key or '')[:8]}",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._halt.set()
        if self.client is not None:
            self.client.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> OnlinePlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------
    def _submit(self) -> None:
        if self.client is None:
            return
        submission = self.client.submit(self._request, self.time_budget_s)
        if self.key is not None and submission.key != self.key:
            log.warning("service key %s differs from the local key %s", submission.key[:12], self.key[:12])
        self.key = submission.key
        if self.problem is None:  # a spec: the service's problem lets us validate every plan
            try:
                self.problem = self.client.problem(self.key)
            except PlanClientError as exc:
                log.warning("could not fetch the problem of %s (%s); plans are not validated", self.key[:12], exc)
        if self.problem is not None:
            self._problems.setdefault(self.key, self.problem)
        if self._newest is None:
            self.offer(self.store.load(self.key), persist=False)
        self.offer(submission.plan)
        self._submitted = True

    def offer(self, plan: Plan | None, persist: bool = True) -> bool:
        """Keep `plan` as the newest if it is newer and valid; write it to disk.

        The follower thread calls this; an in-process producer (e.g. an embedded solver) may too.
        """
        if plan is None:
            return False
        if self.key is not None and plan.problem_key != self.key:
            return False  # a late plan of a key no longer followed (before a switch to a calibrated one)
        problem = self._problems.get(plan.problem_key, self.problem)
        if problem is not None:
            violations = validate_plan(problem, plan, problem_key=plan.problem_key)
            if violations:
                log.warning("ignoring revision %s: it fails validation: %s", plan.revision, violations[:3])
                return False
        with self._changed:
            if self._newest is not None and plan.problem_key == self._newest.problem_key \
                    and plan.revision <= self._newest.revision:
                return False
            self._newest = plan
            self._changed.notify_all()
        if persist:
            try:
                self.store.save(plan)
            except OSError as exc:
                log.warning("could not write the plan cache: %s", exc)
        return True

    def _run(self) -> None:
        assert self.client is not None
        while not self._stop.is_set():
            try:
                self._halt = halt = threading.Event()
                if self._stop.is_set():
                    break
                if not self._submitted:
                    self._submit()
                newest = self._newest
                after = newest.revision if newest is not None and newest.problem_key == self.key else 0
                for plan in self.client.follow(self.key, after, stop=halt,
                                               poll_interval_s=self.poll_interval_s):
                    self.offer(plan)
            except PlanNotFound:
                # the service lost the key (e.g. a fresh database): submit again to re-seed it
                self._submitted = False
                self._stop.wait(self.retry_s)
            except ServiceUnavailable as exc:
                self.last_error = str(exc)
                self._stop.wait(self.retry_s)
            except PlanRequestError as exc:
                self.last_error = str(exc)
                log.error("plan service rejected the request; keeping the current plan: %s", exc)
                self._stop.wait(max(self.retry_s, 30.0))
            except PlanClientError as exc:
                self.last_error = str(exc)
                self._stop.wait(self.retry_s)
            except Exception as exc:  # the training job must not die because the follower did
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("plan follower error")
                self._stop.wait(self.retry_s)
