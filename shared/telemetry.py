"""Logging and tracing set-up shared by every service.

Traces: each service calls `setup_tracing(name)` once in main(). Spans are exported to an OTLP
collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set and `opentelemetry-exporter-otlp` is installed,
printed to stdout with `PAGEDSERVE_TRACE_CONSOLE=1`, and otherwise not recorded (unless OTEL_TRACES_SAMPLER asks). A
request's trace context crosses the streams as the W3C `traceparent` string in every message, so
one trace covers gateway, tokenizer and engine.

Sampling follows the standard variables (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`): the
SDK reads them because no sampler is set here; a parent's sampling decision travels in the
traceparent's flags, so a trace is kept or dropped as a whole. Request attributes follow the
OpenTelemetry GenAI semantic conventions (`gen_ai.*`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

log = logging.getLogger(__name__)


def setup_logging(service: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", force=True)


def setup_tracing(service: str, console: bool = False) -> None:
    trace.set_tracer_provider(tracer_provider(service, console))


def tracer_provider(service: str, console: bool = False) -> TracerProvider:
    """The service's provider: exporting to OTLP and/or the console where asked; where nothing would see a
    recorded span, one that records none (unless OTEL_TRACES_SAMPLER asks): a dropped span costs a few µs, a
    recorded one ~40 per request and hop. Trace ids still cross the streams then, marked unsampled."""
    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, when set, override the default name (Resource.create merges).
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", f"pagedserve-{service}")})
    processors: list[SpanProcessor] = []
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed")
        else:
            processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        processors.append(SimpleSpanProcessor(ConsoleSpanExporter()))
    if not processors and not os.environ.get("OTEL_TRACES_SAMPLER"):
        return TracerProvider(resource=resource, sampler=sampling.ALWAYS_OFF)
    provider = TracerProvider(resource=resource)  # sampler: from OTEL_TRACES_SAMPLER(_ARG), default parent/always
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


_tracers: dict[tuple[trace.TracerProvider, str], trace.Tracer] = {}


def tracer(name: str) -> trace.Tracer:
    """The current provider's tracer for `name`, made once (the SDK's get_tracer costs ~15 µs a call)."""
    provider = trace.get_tracer_provider()
    found = _tracers.get((provider, name))
    if found is None:
        found = _tracers[(provider, name)] = provider.get_tracer(name)
    return found


def context_from(traceparent: str | None) -> context.Context | None:
    """The parent context a traceparent string names (None: start a new trace)."""
    return propagate.extract({"traceparent": traceparent}) if traceparent else None


def current_traceparent() -> str | None:
    carrier: dict[str, Any] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def traceparent_of(span: trace.Span) -> str | None:
    carrier: dict[str, Any] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


# ── GenAI semantic conventions ────────────────────────────────────────────────────────────────
_SAMPLING_ATTRIBUTES = {  # wire sampling key -> gen_ai.request.* attribute
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "n": "gen_ai.request.choice.count",
}


def genai_operation(request: Any) -> str:
    """A wire request's gen_ai.operation.name: "chat", "embeddings" (a pooling request) or "text_completion"."""
    if hasattr(request, "messages"):
        return "chat"
    return "embeddings" if getattr(request, "pooling", None) is not None else "text_completion"


def genai_request_attributes(
    operation: str, model: str, sampling: Mapping[str, Any], max_tokens: int | None = None
) -> dict[str, Any]:
    """gen_ai.* attributes of a request: operation (genai_operation), model, sampling options."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "pagedserve",
        "gen_ai.request.model": model,
    }
    if max_tokens is None:
        max_tokens = sampling.get("max_tokens")
    if max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(max_tokens)
    for key, name in _SAMPLING_ATTRIBUTES.items():
        value = sampling.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[name] = value
    return attrs


def genai_usage_attributes(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens}


# ── time spent waiting in a Redis stream ──────────────────────────────────────────────────────
def entry_time_ns(entry_id: bytes | str) -> int:
    """When Redis added a stream entry: the millisecond part of its id (`<ms>-<seq>`), in ns."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0]) * 1_000_000


def stream_wait_s(entry_id: bytes | str, read_at_ns: int) -> float:
    """How long an entry waited in its stream before it was read (0 if the clocks disagree): the
    stream.wait span's length, for a metric, without the span."""
    return max(read_at_ns - entry_time_ns(entry_id), 0) / 1e9


def record_stream_wait(
    stream: str, entry_id: bytes | str, traceparent: str | None, read_at_ns: int | None = None
) -> float:
    """A `stream.wait` span from the entry's XADD to when it was read (clocks of Redis and this
    host: a skew shows up here); returns the wait in seconds (0 if the clocks disagree)."""
    start = entry_time_ns(entry_id)
    end = max(read_at_ns or time.time_ns(), start)
    span = tracer(__name__).start_span(
        "stream.wait",
        context=context_from(traceparent),
        start_time=start,
        attributes={
            "messaging.system": "redis",
            "messaging.destination.name": stream,
            "messaging.operation.type": "receive",
            "messaging.message.id": entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        },
    )
    span.end(end_time=end)
    return (end - start) / 1e9
