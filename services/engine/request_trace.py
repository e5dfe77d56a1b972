"""The spans of one request inside an engine: generate ⊃ queue → prefill → decode, and a first-token event.

    engine.generate  (gen_ai.* request and usage attributes)
     ├─ engine.queue    arrival at the engine → first scheduled step (waiting for room)
     ├─ engine.prefill  first scheduled step → first token (prompt, in chunks if long)
     └─ engine.decode   first token → finish

Phases advance from the compute loop (`admitted`, `first_token`): each only notes the time. Every span
(and the stream.wait span of the read that brought the request, when given) is built at the end, with
those times, by `finish` or `fail`: starting and ending a span costs tens of microseconds, which on the
way to a first token would be added to it (issue 23).
"""

from __future__ import annotations

import time

from opentelemetry.trace import Span, Status, StatusCode, set_span_in_context

from pagedserve.shared import telemetry
from pagedserve.shared.protocol import GenerateRequest

StreamRead = tuple[str, bytes | str, int]  # (stream, entry id, read at: time_ns) of the entry the request came in


class RequestTrace:
    def __init__(self, req: GenerateRequest, engine_id: str, read: StreamRead | None = None) -> None:
        self.arrived = time.monotonic()
        self.is_admitted = False
        self.has_first_token = False
        self._req, self._engine_id, self._read = req, engine_id, read
        self._arrived_ns = time.time_ns()
        self._admitted_ns: int | None = None
        self._first_token_ns: int | None = None
        self._ttft_s = 0.0

    def admitted(self) -> float:
        """The request was scheduled for the first time; returns its queue wait in seconds."""
        self.is_admitted = True
        self._admitted_ns = time.time_ns()
        return time.monotonic() - self.arrived

    def first_token(self) -> None:
        if not self.is_admitted:  # admitted and finished its prefill within one step
            self.admitted()
        self.has_first_token = True
        self._first_token_ns = time.time_ns()
        self._ttft_s = time.monotonic() - self.arrived

    def finish(self, finish_reason: str | None, output_tokens: int, cached_tokens: int) -> None:
        span = self._emit()
        span.set_attributes(
            {
                "gen_ai.response.finish_reasons": [finish_reason or "none"],
                "gen_ai.usage.output_tokens": output_tokens,
                "pagedserve.finish_reason": finish_reason or "none",
                "pagedserve.cached_tokens": cached_tokens,
            }
        )
        span.end()

    def fail(self, message: str) -> None:
        span = self._emit()
        span.set_status(Status(StatusCode.ERROR, message))
        span.end()

    def _emit(self) -> Span:
        """The stream wait, the root span (left open for the caller to end) and its phases, ended now."""
        req, ended_ns = self._req, time.time_ns()
        if self._read is not None:
            telemetry.record_stream_wait(*self._read[:2], req.traceparent, self._read[2])
        tracer = telemetry.tracer(__name__)
        attrs = telemetry.genai_request_attributes("generate", req.model, req.sampling)
        attrs.update(
            {
                "pagedserve.request_id": req.request_id,
                "pagedserve.engine_id": self._engine_id,
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                "pagedserve.continued_tokens": len(req.output_token_ids),
            }
        )
        span = tracer.start_span(
            "engine.generate",
            context=telemetry.context_from(req.traceparent),
            attributes=attrs,
            start_time=self._arrived_ns,
        )
        parent = set_span_in_context(span)
        # each phase that began ends where the next one began, the last one now
        phases = [("engine.queue", self._arrived_ns)]
        if self._admitted_ns is not None:
            phases.append(("engine.prefill", self._admitted_ns))
        if self._first_token_ns is not None:
            phases.append(("engine.decode", self._first_token_ns))
        for (name, start), (_, end) in zip(phases, [*phases[1:], ("", ended_ns)]):
            tracer.start_span(name, context=parent, start_time=start).end(end_time=end)
        if self._first_token_ns is not None:
            event = {"pagedserve.ttft_engine_s": self._ttft_s}
            span.add_event("gen_ai.first_token", event, timestamp=self._first_token_ns)
        return span
