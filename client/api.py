"""`PlanClient`: the HTTP client a training job uses to get plans from the pipeplan service.

Every call has a timeout and retries with exponential backoff (tenacity) on what is worth retrying:
connection errors, timeouts, 5xx and 429 (honouring `Retry-After`). A 4xx is the caller's mistake and
raises `PlanRequestError` at once with the server's reasons. POST is safe to retry: a problem's key is
its content hash, so a repeated submit finds the same entry.
"""

from __future__ import annotations

import email.utils
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from pipeplan.planner.contract import Plan, Problem
from pydantic import BaseModel, ValidationError
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_random_exponential

from .errors import (
    PlanClientError,
    PlanNotFound,
    PlanRequestError,
    ServiceUnavailable,
    WaitTimeout,
    reasons_of,
)

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass
class Submission:
    """What `submit` answers: the key, the best plan now, and the refine job's state."""

    key: str
    plan: Plan
    job: dict[str, Any] = field(default_factory=dict)
    links: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def revision(self) -> int:
        return self.plan.revision


@dataclass
class TracePosted:
    """What `post_trace` answers: predicted vs measured, and the calibrated problem's key and plan now."""

    key: str
    calibrated_key: str
    predicted_ms: float
    measured_ms: float
    error_pct: float
    retimed_ms: float  # the plan that ran, timed under the measured costs
    calibrated_makespan_ms: float  # the calibrated problem's best plan when the service answered
    created: bool  # False: this very trace had been posted before
    raw: dict[str, Any] = field(default_factory=dict)


class _RetryAfterOrBackoff:
    """tenacity wait: the server's Retry-After when it gave one (capped), else full-jitter backoff."""

    def __init__(self, initial: float, maximum: float):
        self.backoff = wait_random_exponential(multiplier=initial, max=maximum)
        self.maximum = maximum

    def __call__(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, ServiceUnavailable) and exc.retry_after_s is not None:
            return min(max(exc.retry_after_s, 0.0), self.maximum)
        return self.backoff(state)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time()) if when else None


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text or None


def _as_payload(problem_or_spec: Any) -> dict[str, Any]:
    """`{"problem": ...}` for a Problem or a problem v1 dict, `{"spec": ...}` for a model spec."""
    if isinstance(problem_or_spec, Problem):
        return {"problem": problem_or_spec.model_dump(mode="json")}
    if isinstance(problem_or_spec, BaseModel):
        return {"spec": problem_or_spec.model_dump(mode="json")}
    if not isinstance(problem_or_spec, dict):
        raise TypeError(f"submit() takes a Problem, a model spec or a dict, not {type(problem_or_spec).__name__}")
    if set(problem_or_spec) & {"problem", "spec"}:
        return dict(problem_or_spec)
    if problem_or_spec.get("format") == "pipeplan.problem/v1" or "stages" in problem_or_spec:
        return {"problem": problem_or_spec}
    return {"spec": problem_or_spec}


class PlanClient:
    """Talks to the plan service's `/v1` API. Thread-safe (one httpx.Client shared by all calls).

    timeout_s bounds each request; retries is the number of extra attempts after a retryable failure,
    spaced by jittered exponential backoff from backoff_s up to max_backoff_s.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 10.0,
                 retries: int = 4, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 sse_read_timeout_s: float = 45.0, transport: httpx.BaseTransport | None = None):
        headers = {"Accept": "application/json", "User-Agent": "pipeplan-client/0.1"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
            headers["X-API-Key"] = api_key
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.sse_read_timeout_s = sse_read_timeout_s
        self._retrying = {
            "retry": retry_if_exception_type(ServiceUnavailable),
            "stop": stop_after_attempt(retries + 1),
            "wait": _RetryAfterOrBackoff(backoff_s, max_backoff_s),
            "reraise": True,
        }
        self._backoff = (backoff_s, max_backoff_s)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s,
                                  transport=transport)
        self._closed = threading.Event()

    # -- plumbing -------------------------------------------------------------------------------------
    def close(self) -> None:
        self._closed.set()
        self._http.close()

    def __enter__(self) -> PlanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_once(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kw: Any) -> httpx.Response:
        if self._closed.is_set():
            raise PlanClientError("the PlanClient is closed")
        try:
            response = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise ServiceUnavailable(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        except RuntimeError as exc:  # the client was closed under us
            raise ServiceUnavailable(f"{method} {path}: {exc}") from exc
        if response.status_code in ok:
            return response
        if response.status_code in RETRYABLE_STATUS:
            reasons = reasons_of(_body(response))
            raise ServiceUnavailable(
                f"{method} {path}: HTTP {response.status_code}" + (f": {'; '.join(reasons)}" if reasons else ""),
                retry_after_s=_retry_after(response), status=response.status_code)
        error = PlanNotFound if response.status_code == 404 else PlanRequestError
        raise error(response.status_code, reasons_of(_body(response)), _body(response))

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        for attempt in Retrying(**self._retrying):
            with attempt:
                return self._send_once(method, path, **kw)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the API --------------------------------------------------------------------------------------
    def submit(self, problem_or_spec: Any, time_budget_s: float | None = None) -> Submission:
        """POST a problem (or model spec): the best plan at once (cached or heuristic) and the key."""
        payload = _as_payload(problem_or_spec)
        if time_budget_s is not None:
            payload["time_budget_s"] = time_budget_s
        body = self._send("POST", "/v1/plans", json=payload, ok=(200, 201, 202)).json()
        key = body.get("key") or body.get("problem_key") or (body.get("plan") or {}).get("problem_key")
        if not key:
            raise PlanRequestError(200, ["the service's answer names no key"], body)
        plan = Plan.model_validate(body["plan"]) if isinstance(body.get("plan"), dict) else self.get(key)
        job = body.get("job") if isinstance(body.get("job"), dict) else {
            k: body[k] for k in ("job_status", "status") if k in body}
        return Submission(key=key, plan=plan, job=job or {}, links=body.get("links") or {}, raw=body)

    def get(self, key: str, *, etag: str | None = None) -> Plan | None:
        """The best stored plan of `key`; None when `etag` still matches it (304)."""
        return self.get_with_etag(key, etag)[0]

    def get_with_etag(self, key: str, etag: str | None = None) -> tuple[Plan | None, str | None]:
        """(plan or None when `etag` still matches, the current ETag) for cheap polling."""
        headers = {"If-None-Match": etag} if etag else {}
        response = self._send("GET", f"/v1/plans/{key}", headers=headers, ok=(200, 304))
        new_etag = response.headers.get("etag", etag)
        return (None if response.status_code == 304 else Plan.model_validate(response.json())), new_etag

    def wait(self, key: str, min_revision: int, timeout: float = 60.0) -> Plan:
        """Block until `key` has a plan of revision >= min_revision (server long-poll); WaitTimeout else."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"no revision >= {min_revision} of {key[:12]}… within {timeout:g} s")
            hold = max(0.0, min(left, 30.0))
            asked = time.monotonic()
            response = self._send("GET", f"/v1/plans/{key}", ok=(200, 304),
                                  params={"min_revision": min_revision, "wait": round(hold, 3)},
                                  timeout=hold + self.timeout_s)
            if response.status_code == 200:
                plan = Plan.model_validate(response.json())
                if plan.revision >= min_revision:
                    return plan
            # a server that answered early (no long-poll support) is polled gently, not hammered
            if time.monotonic() - asked < hold / 2:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def problem(self, key: str) -> Problem:
        """The normalized problem v1 stored under `key` (e.g. the cost model's answer to a spec)."""
        return Problem.model_validate(self._send("GET", f"/v1/plans/{key}/problem").json())

    def revisions(self, key: str) -> Any:
        return self._send("GET", f"/v1/plans/{key}/revisions").json()

    def refine(self, key: str, time_budget_s: float | None = None) -> dict[str, Any]:
        payload = {} if time_budget_s is None else {"time_budget_s": time_budget_s}
        return self._send("POST", f"/v1/plans/{key}/refine", json=payload, ok=(200, 201, 202)).json()

    def cancel(self, key: str) -> dict[str, Any]:
        return self._send("POST", f"/v1/plans/{key}/cancel", ok=(200, 202)).json()

    def post_trace(self, key: str, trace: Any, time_budget_s: float | None = None) -> TracePosted:
        """POST a measured iteration (`pipeplan.trace/v1`: a `planner.trace.Trace` or its dict) of
        `key`'s plan; the service stores it and plans the problem calibrated to it (docs/trace.md).

        Safe to retry: the service stores a trace once (by content), a repeat answers the same key.
        """
        doc = trace.model_dump(mode="json") if isinstance(trace, BaseModel) else trace
        params = {} if time_budget_s is None else {"time_budget_s": time_budget_s}
        body = self._send("POST", f"/v1/plans/{key}/traces", json=doc, params=params, ok=(200, 201)).json()
        t, c = body["trace"], body["calibrated"]
        return TracePosted(key=key, calibrated_key=c["problem_key"], predicted_ms=t["predicted_ms"],
                           measured_ms=t["measured_ms"], error_pct=t["error_pct"], retimed_ms=c["retimed_ms"],
                           calibrated_makespan_ms=c["makespan_ms"], created=body["created"], raw=body)

    def traces(self, key: str) -> list[dict[str, Any]]:
        """The key's measured runs, newest first (predicted, measured, error %, calibrated key)."""
        return self._send("GET", f"/v1/plans/{key}/traces").json()["traces"]

    def torch_csv(self, key: str) -> str:
        """The CSV torch's stock runtime runs (renumbered, compute order only); see `export`."""
        return self.export(key, "torch.csv")

    def export(self, key: str, kind: str, revision: int | None = None) -> str:
        """An export of `key`'s best (or a given) revision: torch.csv, torchtitan.args (naming the CSV
        schedule.csv), megatron.args, runtimes.json or chrome-trace.json. A plan the format cannot
        express raises PlanRequestError with status 409 and the reason."""
        params = {} if revision is None else {"revision": revision}
        return self._send("GET", f"/v1/plans/{key}/export/{kind}", params=params).text

    def health(self) -> bool:
        try:
            self._send_once("GET", "/healthz")
            return True
        except PlanClientError:
            return False

    # -- following improvements -----------------------------------------------------------------------
    def follow(self, key: str, after_revision: int = 0, *, stop: threading.Event | None = None,
               poll_interval_s: float = 1.0, use_sse: bool = True) -> Iterator[Plan]:
        """Yield each plan of `key` newer than `after_revision`, as it is stored, until `stop` is set.

        Setting `stop` (or `close()`) ends a waiting stream within a fraction of a second.

        Server-sent events first: reconnects after a dropped stream and resumes with `Last-Event-ID`,
        so no revision is missed and none repeats. When the service does not offer events (or httpx-sse
        is not installed) it polls with `If-None-Match` instead. Outages are waited out with backoff;
        only a 4xx (e.g. unknown key) ends the iteration with PlanRequestError.
        """
        stop = stop or threading.Event()
        last = after_revision
        failures = 0
        sse_ok = use_sse
        etag: str | None = None
        while not stop.is_set() and not self._closed.is_set():
            try:
                if sse_ok:
                    try:
                        for plan in self._sse_once(key, last, stop):
                            failures = 0
                            if plan.revision > last:
                                last = plan.revision
                                yield plan
                    except _NoEventStream as exc:
                        log.info("no event stream for %s (%s); polling instead", key[:12], exc)
                        sse_ok = False
                        continue
                    # the stream ended (server restart, proxy): reconnect with resume, not in a hot loop
                    stop.wait(self._backoff[0])
                    continue
                plan, etag = self.get_with_etag(key, etag)
                failures = 0
                if plan is not None and plan.revision > last:
                    last = plan.revision
                    yield plan
                stop.wait(poll_interval_s)
            except ServiceUnavailable as exc:
                failures += 1
                delay = min(self._backoff[1], self._backoff[0] * 2 ** min(failures, 10))
                log.info("plan service unavailable (%s); retrying in %.2f s", exc, delay)
                stop.wait(delay)

    def _sse_once(self, key: str, last: int, stop: threading.Event) -> Iterator[Plan]:
        """One event-stream connection. A reader thread does the blocking reads (they return only at
        the next event or 15 s ping), so this generator can honour `stop` within 0.2 s."""
        items: queue.Queue = queue.Queue()
        done = threading.Event()

        def reader() -> None:
            try:
                for plan in self._sse_stream(key, last, done):
                    items.put(("plan", plan))
                items.put(("end", None))
            except BaseException as exc:  # handed to the consuming thread
                items.put(("error", exc))

        threading.Thread(target=reader, name=f"pipeplan-sse-{key[:8]}", daemon=True).start()
        try:
            while not (stop.is_set() or self._closed.is_set()):
                try:
                    what, value = items.get(timeout=0.2)
                except queue.Empty:
                    continue
                if what == "plan":
                    yield value
                elif what == "end":
                    return
                else:
                    raise value
        finally:
            done.set()

    def _sse_stream(self, key: str, last: int, done: threading.Event) -> Iterator[Plan]:
        try:
            from httpx_sse import EventSource, SSEError
        except ImportError as exc:  # optional: polling works without it
            raise _NoEventStream("httpx-sse is not installed") from exc
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if last:
            headers["Last-Event-ID"] = str(last)
        timeout = httpx.Timeout(self.timeout_s, read=self.sse_read_timeout_s)
        try:
            # follow: a follower wants later refine runs' revisions too, not the `end` of this run
            with self._http.stream("GET", f"/v1/plans/{key}/events", params={"follow": "true"}, headers=headers,
                                   timeout=timeout) as response:
                if response.status_code in (404, 405, 406, 501) and "text/event-stream" not in \
                        response.headers.get("content-type", ""):
                    response.read()
                    if response.status_code == 404 and _is_unknown_key(response):
                        raise PlanNotFound(404, reasons_of(_body(response)), _body(response))
                    raise _NoEventStream(f"HTTP {response.status_code}")
                if response.status_code != 200:
                    response.read()
                    if response.status_code in RETRYABLE_STATUS:
                        raise ServiceUnavailable(f"events: HTTP {response.status_code}",
                                                 _retry_after(response), response.status_code)
                    raise PlanRequestError(response.status_code, reasons_of(_body(response)), _body(response))
                try:
                    for event in EventSource(response).iter_sse():
                        if done.is_set():
                            return
                        plan = self._plan_of_event(key, event.event, event.data)
                        if plan is not None:
                            yield plan
                except SSEError as exc:
                    raise _NoEventStream(str(exc)) from exc
        except (httpx.TransportError, httpx.StreamError, RuntimeError) as exc:
            if done.is_set() or self._closed.is_set():  # nobody is listening any more
                return
            raise ServiceUnavailable(f"events stream: {type(exc).__name__}: {exc}") from exc

    def _plan_of_event(self, key: str, event: str, data: str) -> Plan | None:
        """An event carries the plan itself or a summary naming its revision (then it is fetched)."""
        if event in ("ping", "heartbeat", "end") or not data:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        if isinstance(doc, dict) and isinstance(doc.get("plan"), dict):
            doc = doc["plan"]
        if isinstance(doc, dict) and doc.get("format") == "pipeplan.plan/v1":
            try:
                return Plan.model_validate(doc)
            except ValidationError:
                log.warning("ignoring a malformed plan event for %s", key[:12])
                return None
        if isinstance(doc, dict) and "revision" in doc:
            return self.get(key)
        return None


class _NoEventStream(Exception):
    """The service has no usable SSE endpoint here: fall back to polling."""


def _is_unknown_key(response: httpx.Response) -> bool:
    """A 404 about the key (not about a missing route): FastAPI's route 404 says 'Not Found'."""
    body = _body(response)
    return not (isinstance(body, dict) and "Not Found" in (body.get("detail"), body.get("message")))
