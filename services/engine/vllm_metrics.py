"""The engine replica's vLLM-compatible series (see pagedserve.shared.vllm_metrics for the why)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedserve.services.engine.outputs import EngineStats
from pagedserve.shared.vllm_metrics import FINISHED_REASONS


class VllmEngineMetrics:
    """The engine replica's vLLM series, fed from successive EngineStats snapshots."""

    def __init__(self, registry: CollectorRegistry, model: str, engine_id: str) -> None:
        labels, values = ["model_name", "engine"], (model, engine_id)
        r = registry
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(*values)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(*values)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        ).labels(*values)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        ).labels(*values)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r
        ).labels(*values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(*values)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        # Speculative decoding (zero without --speculative-config), as vLLM's SpecDecodingProm names them.
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=r
        ).labels(*values)
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=r
        ).labels(*values)
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels, registry=r
        ).labels(*values)
        self._spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labels, "position"],
            registry=r,
        )
        self._values = values
        for reason in FINISHED_REASONS:
            self._success.labels(*values, reason)

    def observe(self, stats: EngineStats, last: EngineStats | None) -> None:
        """Set the gauges from `stats`; add what the cumulative counters grew by since `last`."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage if stats.num_total_blocks else 0.0)
        if last is None:
            return
        _add(self.prefix_queries, stats.num_prefix_cache_query_tokens - last.num_prefix_cache_query_tokens)
        _add(self.prefix_hits, stats.num_prefix_cache_hit_tokens - last.num_prefix_cache_hit_tokens)
        _add(self.prompt_tokens, stats.num_prompt_tokens - last.num_prompt_tokens)
        _add(self.generation_tokens, stats.num_generated_tokens - last.num_generated_tokens)
        for reason, count in stats.num_finished_by_reason.items():
            _add(self._success.labels(*self._values, reason), count - last.num_finished_by_reason.get(reason, 0))
        _add(self.spec_drafts, stats.num_spec_drafts - last.num_spec_drafts)
        _add(self.spec_draft_tokens, stats.num_spec_draft_tokens - last.num_spec_draft_tokens)
        _add(self.spec_accepted_tokens, stats.num_spec_accepted_tokens - last.num_spec_accepted_tokens)
        last_per_pos = last.num_spec_accepted_tokens_per_pos
        for pos, count in enumerate(stats.num_spec_accepted_tokens_per_pos):
            before = last_per_pos[pos] if pos < len(last_per_pos) else 0
            _add(self._spec_accepted_per_pos.labels(*self._values, str(pos)), count - before)


def _add(counter: Counter, amount: int) -> None:
    if amount > 0:  # the core's counters reset only at warm-up, before serving starts
        counter.inc(amount)
