"""vLLM-compatible Prometheus metrics, exported alongside pagedserve's own (`pagedserve_*`).

Names, types and label names follow vLLM v1 (vllm/v1/metrics/loggers.py) so that dashboards and
alerts written for vLLM work unchanged: every series has `model_name` (the served model) and the
engine-side ones `engine` (vLLM's engine index; here the replica's engine id). prometheus_client
adds `_total` to counters, so `vllm:prompt_tokens` is scraped as `vllm:prompt_tokens_total`.

Each metric lives where its fact is known:
- engine replica (its own /metrics, services/engine/vllm_metrics.py): scheduler state, KV usage,
  prefix cache, prompt/generation tokens and finished requests, from the engine core's cumulative stats;
- gateway (/metrics): TTFT, inter-token and end-to-end latency as the client sees them. vLLM
  measures these in its API-server process too (the output processor), not in the engine core.
  The gateway does not know one engine per request, so these carry `model_name` only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

# vLLM's buckets, each starting at 1 ms: a local model answers well under vLLM's 10 ms / 300 ms floors.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.001,
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, pre-created at 0 by engines


class VllmRequestMetrics:
    """The gateway's vLLM latency histograms (per model, as the client sees them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=registry,
        )
