"""vLLM's metric names and buckets: latency histograms from 1 ms, vLLM's label names."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry

from pagedserve.services.engine.outputs import EngineStats
from pagedserve.services.engine.vllm_metrics import VllmEngineMetrics
from pagedserve.shared.vllm_metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, VllmRequestMetrics


def test_latency_buckets_start_at_one_millisecond() -> None:
    for buckets in (TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS):
        assert buckets[0] == 0.001 and list(buckets) == sorted(buckets)


def test_a_20ms_first_token_lands_in_a_bucket_below_50ms() -> None:
    registry = CollectorRegistry()
    metrics = VllmRequestMetrics(registry)
    metrics.ttft.labels("m").observe(0.02)
    at = {
        le: registry.get_sample_value("vllm:time_to_first_token_seconds_bucket", {"model_name": "m", "le": le})
        for le in ("0.01", "0.02", "0.04")
    }
    assert at == {"0.01": 0.0, "0.02": 1.0, "0.04": 1.0}


def test_engine_counters_add_what_grew_between_snapshots() -> None:
    registry = CollectorRegistry()
    metrics = VllmEngineMetrics(registry, "m", "e1")
    first = EngineStats(
        num_running=1,
        num_waiting=0,
        num_free_blocks=10,
        num_total_blocks=10,
        num_preemptions=0,
        num_prefix_cache_query_tokens=0,
        num_prefix_cache_hit_tokens=0,
        num_computed_tokens=0,
        num_generated_tokens=0,
        num_steps=0,
    )
    later = replace(first, num_generated_tokens=7, num_finished_by_reason={"length": 2})
    metrics.observe(first, None)
    metrics.observe(later, first)
    labels = {"model_name": "m", "engine": "e1"}
    assert registry.get_sample_value("vllm:generation_tokens_total", labels) == 7
    assert registry.get_sample_value("vllm:request_success_total", {**labels, "finished_reason": "length"}) == 2
    assert registry.get_sample_value("vllm:num_requests_running", labels) == 1
