"""Prometheus metrics of one tokenizer process, served on their own HTTP port (`metrics_port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class TokenizerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model
        self.requests = Counter(
            "pagedserve_tokenizer_requests", "Requests processed, by outcome", ["model", "outcome"], registry=r
        )
        self.duration = Histogram(
            "pagedserve_tokenizer_request_duration_seconds",
            "Time to render and tokenize one request",
            ["model"],
            buckets=_TIME_BUCKETS,
            registry=r,
        ).labels(model)
        self.queue_lag = Histogram(
            "pagedserve_tokenizer_queue_lag_seconds",
            "Time a request waited in the request stream before a tokenizer read it",
            ["model"],
            buckets=_LAG_BUCKETS,
            registry=r,
        ).labels(model)

        self.routes = Counter(
            "pagedserve_router_decisions",
            'Requests routed, by engine ("shared": the stream every replica pulls from) and reason',
            ["model", "engine", "reason"],
            registry=r,
        )
        self.route_overlap = Histogram(
            "pagedserve_router_prefix_overlap_ratio",
            "Share of a routed prompt's full KV blocks the chosen replica already held",
            ["model"],
            buckets=_SHARE_BUCKETS,
            registry=r,
        ).labels(model)

    def count(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()
