"""Logging and tracing set-up shared by every service.

Traces: each service calls `setup_tracing(name)` once in main(). Spans are exported to an OTLP
collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set and `opentelemetry-exporter-otlp` is installed,
printed to stdout with `PAGEDSERVE_TRACE_CONSOLE=1`, and otherwise created but not exported. A
request's trace context crosses the streams as the W3C `traceparent` string in every message, so
one trace covers gateway, tokenizer and engine.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

log = logging.getLogger(__name__)


def setup_logging(service: str) -> None:
    level = os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", force=True
    )


def setup_tracing(service: str) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": f"pagedserve-{service}"}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed")
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if os.environ.get("PAGEDSERVE_TRACE_CONSOLE") == "1":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


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
