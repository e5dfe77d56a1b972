"""Process ids and the trace/GenAI helpers every service uses."""

from __future__ import annotations

import re

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from pagedserve.shared import telemetry
from pagedserve.shared.ids import new_id
from pagedserve.shared.protocol import ChatRequest, CompletionRequest


def test_new_ids_are_prefixed_and_distinct() -> None:
    ids = {new_id("gw") for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"gw-[0-9a-f]{8}", i) for i in ids)


def test_a_traceparent_carries_the_trace_to_a_child_span() -> None:
    tracer = TracerProvider().get_tracer(__name__)
    parent = tracer.start_span("gateway.generate")
    traceparent = telemetry.traceparent_of(parent)
    assert traceparent is not None and format(parent.get_span_context().trace_id, "032x") in traceparent
    child = tracer.start_span("engine.request", context=telemetry.context_from(traceparent))
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    assert isinstance(child, ReadableSpan) and child.parent is not None
    assert child.parent.span_id == parent.get_span_context().span_id
    assert telemetry.context_from(None) is None  # no traceparent: a new trace


def test_genai_attributes_follow_the_semantic_conventions() -> None:
    attrs = telemetry.genai_request_attributes("chat", "m", {"temperature": 0.5, "top_p": 0.9, "max_tokens": 7})
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert telemetry.genai_usage_attributes(3, 4) == {"gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 4}


def test_genai_operation_names_each_kind_of_request() -> None:
    chat = ChatRequest("r", "gw", "m", [{"role": "user", "content": "hi"}])
    completion = CompletionRequest("r", "gw", "m", "hi")
    embedding = CompletionRequest("r", "gw", "m", "hi", pooling={"dimensions": None})
    assert [telemetry.genai_operation(r) for r in (chat, completion, embedding)] == [
        "chat",
        "text_completion",
        "embeddings",
    ]


def test_a_stream_entry_id_gives_its_time() -> None:
    assert telemetry.entry_time_ns(b"1700000000123-4") == 1_700_000_000_123_000_000
    assert telemetry.entry_time_ns("5-0") == 5_000_000


def test_with_nothing_to_export_spans_are_not_recorded_but_the_trace_id_still_travels(monkeypatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    quiet = telemetry.tracer_provider("tokenizer").get_tracer(__name__)
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = quiet.start_span("tokenizer.process", context=telemetry.context_from(incoming))
    assert not span.is_recording()
    outgoing = telemetry.traceparent_of(span)
    assert outgoing is not None and "0af7651916cd43dd8448eb211c80319c" in outgoing
    assert telemetry.tracer_provider("engine", console=True).get_tracer(__name__).start_span("x").is_recording()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    assert telemetry.tracer_provider("engine").get_tracer(__name__).start_span("x").is_recording()


def test_tracer_is_made_once_per_provider_and_follows_a_new_provider() -> None:
    original = trace._TRACER_PROVIDER
    try:
        first, second = TracerProvider(), TracerProvider()
        trace._TRACER_PROVIDER = first
        assert telemetry.tracer("a") is telemetry.tracer("a")
        assert telemetry.tracer("a") is not telemetry.tracer("b")
        trace._TRACER_PROVIDER = second
        tracer = telemetry.tracer("a")
        assert tracer is telemetry.tracer("a") and tracer is not telemetry._tracers[(first, "a")]
        assert telemetry._tracers[(second, "a")] is tracer
    finally:
        trace._TRACER_PROVIDER = original
