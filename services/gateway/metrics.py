"""Prometheus metrics of one gateway: requests, latency, time to first token, tokens, engine load.

Each app has its own CollectorRegistry (several apps may live in one test process). Request counts
and latency come from a plain ASGI middleware (BaseHTTPMiddleware would break streaming); for a
stream, latency runs until its last byte. Engine load is read from the registry at scrape time.

Several worker processes (`gateway --workers N`) share one port: with `PROMETHEUS_MULTIPROC_DIR`
set to an empty directory writable by every worker (and wiped before they start), prometheus-client's
multiprocess mode sums the workers' counters and histograms, and /metrics on any worker shows the
whole gateway. In-flight requests are then a gauge each worker refreshes around its requests
(summed over live workers); engine load comes from Redis and is the same in every worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from services.gateway.registry import ModelRegistry

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def is_multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class GatewayMetrics:
    def __init__(self) -> None:
        self.multiprocess = is_multiprocess()
        self._in_flight_source: Callable[[], float] | None = None
        self._collectors: list[Collector] = []
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedserve_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("pagedserve_request_latency_seconds", "Request latency until the last byte",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time from submission to the first token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests", ["model"],
                                     registry=r)
        self.generated_tokens = Counter("pagedserve_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.in_flight = Gauge("pagedserve_requests_in_flight", "Generation requests in flight", registry=r,
                               multiprocess_mode="livesum")

    def track_in_flight(self, source: Callable[[], float]) -> None:
        if self.multiprocess:  # a callback gauge cannot be shared between processes: refreshed per request
            self._in_flight_source = source
        else:
            self.in_flight.set_function(source)

    def refresh(self) -> None:
        if self._in_flight_source is not None:
            self.in_flight.set(self._in_flight_source())

    def watch_engines(self, registry: ModelRegistry) -> None:
        collector = _EngineLoad(registry)
        self._collectors.append(collector)
        self.registry.register(collector)

    def exposition(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # every worker's files
        for collector in self._collectors:
            merged.register(collector)
        return generate_latest(merged)

    async def endpoint(self, request: Request) -> Response:
        self.refresh()
        return Response(self.exposition(), media_type="text/plain; version=0.0.4")


class _EngineLoad(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self.models = registry

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "engine_id"]
        families = {
            "num_running": GaugeMetricFamily("pagedserve_engine_running", "Sequences running", labels=labels),
            "num_waiting": GaugeMetricFamily("pagedserve_engine_waiting", "Sequences waiting", labels=labels),
            "num_free_blocks": GaugeMetricFamily("pagedserve_engine_free_kv_blocks", "Free KV blocks", labels=labels),
            "num_total_blocks": GaugeMetricFamily("pagedserve_engine_kv_blocks", "KV blocks", labels=labels),
        }
        for entry in self.models.live_models():
            for beat in entry.engines:
                for name, family in families.items():
                    family.add_metric([entry.name, beat.engine_id], float(getattr(beat, name)))
        yield from families.values()


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500
        route = scope["path"] if scope["path"].startswith(("/v1/chat", "/v1/completions", "/tokenize",
                                                            "/detokenize")) else "other"

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.refresh()
        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.refresh()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


def observe_generation(metrics: Any, model: str, usage: dict[str, Any]) -> None:
    if metrics is not None:
        metrics.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
        metrics.generated_tokens.labels(model).inc(usage["completion_tokens"])
