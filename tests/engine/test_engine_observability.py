"""Engine metrics turn the core's cumulative counters into Prometheus counters; a request's trace
moves through queue → prefill → decode with a first-token event (in-memory span exporter)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.metrics import EngineMetrics
from pagedserve.services.engine.outputs import EngineStats
from pagedserve.services.engine.request_trace import RequestTrace
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.protocol import GenerateRequest


def _stats(**overrides: Any) -> EngineStats:
    values = dict(
        num_running=0,
        num_waiting=0,
        num_free_blocks=100,
        num_total_blocks=100,
        num_preemptions=0,
        num_prefix_cache_query_tokens=0,
        num_prefix_cache_hit_tokens=0,
        num_computed_tokens=0,
        num_generated_tokens=0,
        num_steps=0,
    )
    values.update(overrides)
    return EngineStats(**values)


def _value(metrics: EngineMetrics, name: str) -> float:
    found = metrics.registry.get_sample_value(name, {"model": "m", "engine_id": "e"})
    assert found is not None, name
    return found


def test_metrics_follow_the_engine_stats() -> None:
    metrics = EngineMetrics("m", "e")
    metrics.observe_load(_stats())
    metrics.observe_step(0.02, _stats(num_running=3))
    metrics.observe_load(
        _stats(
            num_running=3,
            num_waiting=2,
            num_free_blocks=75,
            num_preemptions=1,
            num_prefix_cache_query_tokens=64,
            num_prefix_cache_hit_tokens=32,
            num_generated_tokens=3,
            num_computed_tokens=67,
        )
    )
    metrics.observe_load(
        _stats(
            num_running=1,
            num_free_blocks=90,
            num_preemptions=1,
            num_prefix_cache_query_tokens=64,
            num_prefix_cache_hit_tokens=32,
            num_generated_tokens=7,
            num_computed_tokens=71,
        )
    )
    assert _value(metrics, "pagedserve_engine_num_running") == 1
    assert _value(metrics, "pagedserve_engine_kv_cache_usage_ratio") == pytest.approx(0.10)
    assert _value(metrics, "pagedserve_engine_preemptions_total") == 1
    assert _value(metrics, "pagedserve_engine_prefix_cache_hits_total") == 32
    assert _value(metrics, "pagedserve_engine_prefix_cache_queries_total") == 64
    assert _value(metrics, "pagedserve_engine_generation_tokens_total") == 7
    assert _value(metrics, "pagedserve_engine_steps_total") == 1
    assert _value(metrics, "pagedserve_engine_batch_size_sum") == 3
    assert _value(metrics, "pagedserve_engine_step_duration_seconds_sum") == pytest.approx(0.02)


def test_vllm_series_follow_the_engine_stats() -> None:
    metrics = EngineMetrics("m", "e")
    vllm = {"model_name": "m", "engine": "e"}
    metrics.observe_load(_stats())
    assert metrics.registry.get_sample_value("vllm:request_success_total", {**vllm, "finished_reason": "stop"}) == 0
    metrics.observe_load(
        _stats(
            num_running=2,
            num_waiting=1,
            num_free_blocks=60,
            num_prefix_cache_query_tokens=40,
            num_prefix_cache_hit_tokens=16,
            num_generated_tokens=9,
            num_prompt_tokens=40,
            num_finished_by_reason={"stop": 1, "length": 2},
        )
    )
    metrics.observe_load(
        _stats(
            num_running=2,
            num_waiting=1,
            num_free_blocks=60,
            num_prefix_cache_query_tokens=40,
            num_prefix_cache_hit_tokens=16,
            num_generated_tokens=11,
            num_prompt_tokens=40,
            num_finished_by_reason={"stop": 1, "length": 3},
        )
    )

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {**vllm, **labels})

    assert (value("vllm:num_requests_running"), value("vllm:num_requests_waiting")) == (2, 1)
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(0.4)  # a 0..1 fraction, as vLLM v1's
    assert (value("vllm:prefix_cache_queries_total"), value("vllm:prefix_cache_hits_total")) == (40, 16)
    assert (value("vllm:prompt_tokens_total"), value("vllm:generation_tokens_total")) == (40, 11)
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success_total", finished_reason="stop") == 1


def test_core_counts_prefilled_prompt_tokens_and_finishes_by_reason(engine: Engine) -> None:
    before = engine.stats()
    engine.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(max_tokens=3, ignore_eos=True))
    after = engine.stats()
    assert after.num_prompt_tokens - before.num_prompt_tokens == 8  # once each, not once per step
    assert after.num_finished_by_reason.get("length", 0) - before.num_finished_by_reason.get("length", 0) == 2


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    original = trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER = provider  # the global provider can be set once per process; tests swap it
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER = original


def test_request_trace_phases(spans: InMemorySpanExporter) -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    req = GenerateRequest(
        "r1", "gw", "m", [1, 2, 3, 4], {"temperature": 0.7, "max_tokens": 5, "n": 1}, traceparent=parent
    )
    rt = RequestTrace(req, "e")
    assert rt.admitted() >= 0
    rt.first_token()
    rt.finish("length", 5, 0)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"engine.generate", "engine.queue", "engine.prefill", "engine.decode"}
    root = by_name["engine.generate"]
    assert root.context is not None and root.parent is not None
    assert f"{root.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert by_name[phase].parent is not None and by_name[phase].parent.span_id == root.context.span_id
    assert [e.name for e in root.events] == ["gen_ai.first_token"]
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.request.model"] == "m" and attrs["gen_ai.request.temperature"] == 0.7
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.usage.input_tokens"] == 4 and attrs["gen_ai.usage.output_tokens"] == 5


def test_a_request_that_prefills_in_one_step_still_gets_every_phase(spans: InMemorySpanExporter) -> None:
    rt = RequestTrace(GenerateRequest("r2", "gw", "m", [1], {}), "e")
    rt.first_token()  # admitted and sampled within one step
    rt.fail("boom")
    names = sorted(s.name for s in spans.get_finished_spans())
    assert names == ["engine.decode", "engine.generate", "engine.prefill", "engine.queue"]
