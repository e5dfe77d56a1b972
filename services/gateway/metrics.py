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

import asyncio
import logging
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

from pagedserve.services.status import group_lag
from pagedserve.shared import streams
from pagedserve.shared.vllm_metrics import VllmRequestMetrics

if TYPE_CHECKING:
    from pagedserve.services.gateway.registry import ModelRegistry

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_STREAM_LAG_TIMEOUT_S = 2.0  # a scrape must not hang on a slow Redis


def is_multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class GatewayMetrics:
    def __init__(self) -> None:
        self.multiprocess = is_multiprocess()
        self._in_flight_source: Callable[[], float] | None = None
        self._collectors: list[Collector] = []
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagedserve_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "pagedserve_request_latency_seconds",
            "Request latency until the last byte",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Time from submission to the first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of finished requests", ["model"], registry=r
        )
        self.generated_tokens = Counter("pagedserve_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.in_flight = Gauge(
            "pagedserve_requests_in_flight", "Generation requests in flight", registry=r, multiprocess_mode="livesum"
        )
        self.itl = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Time between tokens of one choice",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "Submission to the end of a generation",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        lag_labels = ["model", "stream"]
        self.stream_backlog = Gauge(
            "pagedserve_stream_backlog",
            "Entries no consumer of the group has read yet",
            lag_labels,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.stream_pending = Gauge(
            "pagedserve_stream_pending",
            "Entries read but not acknowledged (in progress)",
            lag_labels,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.stream_oldest = Gauge(
            "pagedserve_stream_oldest_waiting_seconds",
            "Age of the oldest unread entry",
            lag_labels,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.vllm = VllmRequestMetrics(r)  # vllm:* latency series, alongside ours
        self._engines: ModelRegistry | None = None
        self._itl_children: dict[str, tuple[Any, Any]] = {}

    def itl_children(self, model: str) -> tuple[Any, Any]:
        """The model's inter-token-latency histograms (ours, vLLM's), looked up once: observed per token."""
        children = self._itl_children.get(model)
        if children is None:
            children = self._itl_children[model] = (self.itl.labels(model), self.vllm.itl.labels(model))
        return children

    def track_in_flight(self, source: Callable[[], float]) -> None:
        if self.multiprocess:  # a callback gauge cannot be shared between processes: refreshed per request
            self._in_flight_source = source
        else:
            self.in_flight.set_function(source)

    def refresh(self) -> None:
        if self._in_flight_source is not None:
            self.in_flight.set(self._in_flight_source())

    def watch_engines(self, registry: ModelRegistry) -> None:
        self._engines = registry
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

    async def refresh_stream_lag(self) -> None:
        """Backlog and pending entries of every known model's request and engine streams (read at scrape time)."""
        if self._engines is None:
            return
        now = time.time()
        for model in list(self._engines.models):
            for kind, stream, group in (
                ("req", streams.request_stream(model), streams.TOKENIZER_GROUP),
                ("gen", streams.generate_stream(model), streams.engine_group(model)),
            ):
                lag = await group_lag(self._engines.redis, model, stream, group, now)
                if lag is not None:
                    self.stream_backlog.labels(model, kind).set(lag.backlog)
                    self.stream_pending.labels(model, kind).set(lag.pending)
                    self.stream_oldest.labels(model, kind).set(lag.oldest_waiting_s or 0.0)

    async def endpoint(self, request: Request) -> Response:
        self.refresh()
        try:
            await asyncio.wait_for(self.refresh_stream_lag(), _STREAM_LAG_TIMEOUT_S)
        except Exception as exc:  # Redis down or slow: the scrape still answers, with the last values
            log.debug("stream lag not refreshed: %s", exc)
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
            "num_requests_finished": GaugeMetricFamily(
                "pagedserve_engine_requests_finished", "Requests finished since the engine started", labels=labels
            ),
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
        route = (
            scope["path"]
            if scope["path"].startswith(("/v1/chat", "/v1/completions", "/tokenize", "/detokenize"))
            else "other"
        )

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


def observe_generation(metrics: Any, model: str, usage: dict[str, Any], seconds: float | None = None) -> None:
    if metrics is not None:
        metrics.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
        metrics.generated_tokens.labels(model).inc(usage["completion_tokens"])
        if seconds is not None:
            metrics.e2e.labels(model).observe(seconds)
            metrics.vllm.e2e.labels(model).observe(seconds)


def observe_ttft(metrics: Any, model: str, seconds: float) -> None:
    if metrics is not None:
        metrics.ttft.labels(model).observe(seconds)
        metrics.vllm.ttft.labels(model).observe(seconds)


def observe_tokens(metrics: Any, model: str, num_tokens: int, seconds_since_last: float) -> None:
    """Inter-token latency: a delta of several tokens (one per step each) spreads its wait over them."""
    if metrics is not None and num_tokens > 0:
        per_token = seconds_since_last / num_tokens
        ours, theirs = metrics.itl_children(model)
        for _ in range(num_tokens):
            ours.observe(per_token)
            theirs.observe(per_token)
