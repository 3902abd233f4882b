"""Prometheus metrics: HTTP traffic from a pure-ASGI middleware, cache/queue gauges read at scrape."""

from __future__ import annotations

import time
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Observed(Protocol):
    """What the collector reads at scrape time (service.state.ServiceState has it); a protocol, so
    metrics does not import state and state imports metrics (imports point one way)."""

    queue: Any
    repo: Any
    hub: Any
    admission: Any


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pipeplan_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram(
            "pipeplan_http_request_duration_seconds", "HTTP request latency", ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.cold_posts = Counter("pipeplan_cold_posts", "POSTs that computed a first plan inline",
                                  registry=self.registry)
        self.reused_first_plans = Counter(
            "pipeplan_reused_first_plans", "Cold POSTs whose revision 1 is a neighbour's plan reused"
            " (docs/reuse.md)", registry=self.registry)
        self.export_cache = Counter("pipeplan_export_cache", "Export requests served from the on-disk cache"
                                    " (hit) or built for it (build)", ["kind", "result"], registry=self.registry)


class StateCollector:
    """Queue depth, jobs by state and solver improvements, read from the queue and SQL at scrape time."""

    def __init__(self, state: Observed):
        self.state = state

    def describe(self):
        return []

    def collect(self):
        depth = GaugeMetricFamily("pipeplan_queue_depth", "Refine runs waiting in the queue")
        try:
            depth.add_metric([], self.state.queue.depth())
        except Exception:
            depth.add_metric([], float("nan"))
        yield depth
        jobs = GaugeMetricFamily("pipeplan_jobs", "Refine jobs by state", labels=["state"])
        improvements = CounterMetricFamily("pipeplan_solver_improvements", "Revisions stored beyond the first")
        try:
            from .models import JOB_STATES

            counts = self.state.repo.job_counts()
            for s in JOB_STATES:
                jobs.add_metric([s], counts.get(s, 0))
            improvements.add_metric([], self.state.repo.improvements_total())
        except Exception:
            pass
        yield jobs
        yield improvements
        subs = GaugeMetricFamily("pipeplan_event_subscribers", "Open SSE / long-poll subscriptions")
        subs.add_metric([], self.state.hub.subscriber_count())
        yield subs
        delivered = CounterMetricFamily("pipeplan_events_delivered", "Plan events delivered in this process")
        delivered.add_metric([], self.state.hub.delivered)
        yield delivered
        admission = getattr(self.state, "admission", None)
        if admission is not None:
            heavy = GaugeMetricFamily("pipeplan_inline_running", "First plans being computed in this process")
            heavy.add_metric([], admission.heavy_running)
            yield heavy
            streams = GaugeMetricFamily("pipeplan_open_streams", "SSE streams and long-polls holding an"
                                        " admission slot in this process (limit: max_streams)")
            streams.add_metric([], admission.streams)
            yield streams


class MetricsMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware overhead); labels by route template, not by raw path."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "GET")
            self.metrics.requests.labels(method, path, str(status["code"])).inc()
            self.metrics.latency.labels(method, path).observe(time.perf_counter() - start)
