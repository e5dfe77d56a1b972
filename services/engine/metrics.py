"""Prometheus metrics of one engine replica, served on their own HTTP port (`metrics_port`).

The compute loop calls `observe_step` once per step with the step's wall time and the engine's
stats snapshot it takes anyway: a few counter increments and gauge sets, no Redis, no locks held
for long. Counters of the engine core (preemptions, prefix-cache tokens, generated tokens) are
cumulative; they are turned into Prometheus counters by adding the difference since the last step.
The same registry carries the vLLM-compatible `vllm:*` series (services/engine/vllm_metrics.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.services.engine.outputs import EngineStats
from pagedserve.services.engine.vllm_metrics import VllmEngineMetrics

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    def __init__(self, model: str, engine_id: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model", "engine_id"]
        self._labels = (model, engine_id)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.step_time = histogram(
            "pagedserve_engine_step_duration_seconds", "Wall time of one engine step", _STEP_BUCKETS
        ).labels(*self._labels)
        self.batch_size = histogram(
            "pagedserve_engine_batch_size", "Sequences running in a step", _BATCH_BUCKETS
        ).labels(*self._labels)
        self.queue_wait = histogram(
            "pagedserve_engine_queue_wait_seconds",
            "Time from a request's arrival at the engine to its first scheduled step",
            _WAIT_BUCKETS,
        ).labels(*self._labels)
        self.stream_wait = histogram(
            "pagedserve_engine_stream_wait_seconds",
            "Time a request waited in the engine stream before this engine read it",
            _WAIT_BUCKETS,
        ).labels(*self._labels)
        self.running = gauge("pagedserve_engine_num_running", "Sequences running").labels(*self._labels)
        self.waiting = gauge("pagedserve_engine_num_waiting", "Sequences waiting").labels(*self._labels)
        self.kv_usage = gauge(
            "pagedserve_engine_kv_cache_usage_ratio", "Share of KV cache blocks in use (0..1)"
        ).labels(*self._labels)
        self.kv_blocks = gauge("pagedserve_engine_kv_cache_blocks", "KV cache blocks in all").labels(*self._labels)
        self.steps = counter("pagedserve_engine_steps", "Engine steps").labels(*self._labels)
        self.preemptions = counter("pagedserve_engine_preemptions", "Sequences preempted").labels(*self._labels)
        self.prefix_queries = counter(
            "pagedserve_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        ).labels(*self._labels)
        self.prefix_hits = counter(
            "pagedserve_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache"
        ).labels(*self._labels)
        self.prefix_host_hits = counter(
            "pagedserve_engine_prefix_cache_host_hits",
            "Prompt tokens found in the host-memory KV tier (part of the prefix cache hits), copied back",
        ).labels(*self._labels)
        self.generation_tokens = counter("pagedserve_engine_generation_tokens", "Tokens sampled").labels(*self._labels)
        self.computed_tokens = counter(
            "pagedserve_engine_computed_tokens", "Tokens run through the model (prefill and decode)"
        ).labels(*self._labels)
        self.vllm = VllmEngineMetrics(r, model, engine_id)
        self._last: EngineStats | None = None

    def observe_step(self, seconds: float, stats: EngineStats) -> None:
        self.step_time.observe(seconds)
        self.batch_size.observe(stats.num_running)
        self.steps.inc()

    def observe_load(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks.set(stats.num_total_blocks)
        self.kv_usage.set(stats.kv_usage if stats.num_total_blocks else 0.0)
        last = self._last
        self.vllm.observe(stats, last)
        if last is not None:
            _add(self.preemptions, stats.num_preemptions - last.num_preemptions)
            _add(self.prefix_queries, stats.num_prefix_cache_query_tokens - last.num_prefix_cache_query_tokens)
            _add(self.prefix_hits, stats.num_prefix_cache_hit_tokens - last.num_prefix_cache_hit_tokens)
            _add(self.prefix_host_hits, stats.num_prefix_cache_host_hit_tokens - last.num_prefix_cache_host_hit_tokens)
            _add(self.generation_tokens, stats.num_generated_tokens - last.num_generated_tokens)
            _add(self.computed_tokens, stats.num_computed_tokens - last.num_computed_tokens)
        self._last = stats


def _add(counter: Counter, amount: int) -> None:
    if amount > 0:  # the core's counters reset only at warm-up, before serving starts
        counter.inc(amount)
